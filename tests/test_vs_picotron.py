"""benchmarks/vs_picotron.py writes Picotron a config of pjax's shape (no Picotron checkout needed)."""
import importlib.util
from pathlib import Path

from pjax.config_io import load_config

# The sections of Picotron's template/base_config.json that the script fills in.
TEMPLATE = {section: {} for section in ("distributed", "model", "training", "dataset", "checkpoint", "logging",
                                        "environment")}


def _vs_picotron():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_picotron.py"
    spec = importlib.util.spec_from_file_location("vs_picotron", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_picotron_config_has_the_model_and_the_tokens_per_step_of_the_pjax_config():
    cfg = load_config("picotron-cpu", ["mesh.dp=2"])
    out = _vs_picotron().picotron_config(TEMPLATE, cfg, {"dp": 2, "pp": 1, "cp": 1, "tp": 1}, "/model", "/data",
                                         12, 1, "/ckpt")
    dist, model, train = out["distributed"], out["model"], out["training"]
    assert (dist["dp_size"], dist["pp_size"], dist["cp_size"], dist["tp_size"], dist["use_cpu"]) == (2, 1, 1, 1, True)
    assert (model["num_hidden_layers"], model["num_attention_heads"], model["num_key_value_heads"]) == (4, 8, 4)
    # Picotron's step is micro_batch_size x gradient_accumulation_steps x dp sequences of seq_length tokens.
    assert (train["micro_batch_size"], train["gradient_accumulation_steps"], train["seq_length"]) == (2, 4, 256)
    assert train["learning_rate"] == cfg.train.lr and train["total_train_steps"] == 12
    assert out["environment"]["FLASH_ATTEN"] == "0" and out["checkpoint"]["save_frequency"] > 12
