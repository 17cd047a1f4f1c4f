"""Config loading: shipped YAML files, overrides, round trips, and one-sentence errors."""
from __future__ import annotations

import dataclasses
import importlib.resources
from pathlib import Path

import pytest

from mesh.errors import ConfigError
from mesh.mesh import MeshConfig
from mesh.validate import validate_batch, validate_model
from pjax import assets
from pjax.data import text as data
from pjax.config import Config
from pjax.config_io import CONFIG_DIR, available_configs, config_to_dict, dump_config, load_config, resolve_config_path

REAL_SHAPES = ["smollm-135m", "smollm-360m", "smollm-1.7b", "llama2-7b", "llama3-8b", "mixtral-8x7b", "qwen3-30b-a3b"]
REPO = Path(__file__).resolve().parent.parent

# Keys that the README, notebooks and the other modules rely on.
CONTRACT_KEYS = {
    "mesh": ["dp", "pp", "cp", "tp"],
    "train": ["steps", "seed", "seq_len", "batch_size", "grad_accum", "lr", "dtype", "remat", "zero"],
    "data": ["path", "tokenizer"],
    "log": ["dir", "every", "eval_every"],
    "checkpoint": ["dir", "every"],
    "pipeline": ["schedule", "virtual_stages"],
    "model": ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings"],
}


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_every_shipped_config_is_listed():
    assert {"debug", "picotron-cpu", "mixtral-tiny", *REAL_SHAPES} <= set(available_configs())


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_shipped_config_loads_and_sets_every_section(name):
    cfg = load_config(name)
    text = (CONFIG_DIR / f"{name}.yaml").read_text()
    # finetune's model comes from train.init_from and its mesh is fitted to it (pjax/fit.py): it names neither
    sections = ("train", "data", "log", "checkpoint") if name == "finetune" else \
        ("model", "mesh", "train", "data", "log", "checkpoint", "pipeline")
    for section in sections:
        assert f"\n{section}:" in "\n" + text, f"{name}.yaml has no {section} section"
    assert cfg.model.head_dim * cfg.model.num_attention_heads == cfg.model.hidden_size or "\n  head_dim:" in text
    assert cfg.model.vocab_size >= 4096


@pytest.mark.parametrize("name,devices", [("debug", 4), ("picotron-cpu", 1), ("mixtral-tiny", 4)]
                         + [(n, d) for n in REAL_SHAPES for d in (16, 64)])
def test_shipped_config_fits_its_intended_device_counts(name, devices):
    cfg = load_config(name)
    mesh = cfg.mesh.resolve(devices)
    m = cfg.model
    validate_model(mesh, num_layers=m.num_hidden_layers, num_heads=m.num_attention_heads,
                   num_kv_heads=m.num_key_value_heads, hidden_size=m.hidden_size,
                   intermediate_size=m.intermediate_size, vocab_size=m.vocab_size, zero=cfg.train.zero)
    validate_batch(mesh, batch_size=cfg.train.batch_size, grad_accum=cfg.train.grad_accum, seq_len=cfg.train.seq_len)
    assert cfg.train.seq_len <= m.max_position_embeddings
    assert m.num_local_experts % mesh.dp == 0  # MoE: the experts split evenly over dp (0 % dp: dense)


@pytest.mark.parametrize("name", REAL_SHAPES)
def test_real_shape_configs_use_bf16_remat_and_zero(name):
    train = load_config(name).train
    assert train.dtype == "auto" and train.remat in ("dots_no_batch", "full") and train.zero in (1, 3)
    assert 2048 <= train.seq_len <= 8192


def test_real_shape_parameter_counts_match_the_released_models():
    billions = {n: load_config(n).model.num_params / 1e9 for n in REAL_SHAPES}
    # The released figures, rounded: the counts are within 4e-4 (MoE: 2.8e-3); an untied head on smollm-135m adds 0.028
    assert billions["smollm-135m"] == pytest.approx(0.1345, abs=1e-3)
    assert billions["smollm-360m"] == pytest.approx(0.3618, abs=1e-3)
    assert billions["smollm-1.7b"] == pytest.approx(1.711, abs=1e-3)
    assert billions["llama2-7b"] == pytest.approx(6.738, abs=1e-3)
    assert billions["llama3-8b"] == pytest.approx(8.030, abs=1e-3)
    assert billions["mixtral-8x7b"] == pytest.approx(46.70, abs=1e-2)
    assert billions["qwen3-30b-a3b"] == pytest.approx(30.53, abs=1e-2)


def test_data_paths_in_shipped_configs_are_shipped_files():
    for name in set(available_configs()) - {"finetune"}:  # its data and checkpoint are the user's to name
        data_cfg = load_config(name).data
        shipped_text = assets.shipped(data_cfg.path)
        assert shipped_text is not None and shipped_text.is_file(), f"{name}: {data_cfg.path}"
        assert assets.shipped(data_cfg.tokenizer) is not None, f"{name}: {data_cfg.tokenizer}"


def test_named_configs_and_the_shipped_text_resolve_through_the_package_from_any_directory(tmp_path, monkeypatch):
    assert assets.ROOT == Path(str(importlib.resources.files("pjax.assets"))) and CONFIG_DIR == assets.ROOT / "configs"
    monkeypatch.chdir(tmp_path)  # nothing of the repository around
    assert resolve_config_path("picotron-cpu") == CONFIG_DIR / "picotron-cpu.yaml"
    assert resolve_config_path("configs/picotron-cpu.yaml") == CONFIG_DIR / "picotron-cpu.yaml"
    assert resolve_config_path(None) == CONFIG_DIR / "debug.yaml"
    data_cfg = load_config().data
    assert assets.locate(data_cfg.path) == assets.ROOT / "data" / "prideprejudice.txt"
    assert data.source_files(data_cfg.path) == [assets.ROOT / "data" / "prideprejudice.txt"]
    assert data.load_tokenizer(data_cfg.tokenizer).get_vocab_size() == 4096


def test_a_file_in_the_working_directory_wins_over_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prideprejudice.txt").write_text("my own text")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "picotron-cpu.yaml").write_text("train:\n  steps: 7\n")
    assert assets.locate("data/prideprejudice.txt") == Path("data/prideprejudice.txt")
    assert load_config("configs/picotron-cpu.yaml").train.steps == 7
    assert load_config("picotron-cpu").model.vocab_size == 4096  # a bare name is always a shipped config


def test_the_token_cache_defaults_to_the_user_cache_not_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert load_config().data.cache_path == tmp_path / "pjax" / "tokens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert load_config().data.cache_path == Path.home() / ".cache" / "pjax" / "tokens"
    assert load_config(overrides=["data.cache_dir=~/tokens"]).data.cache_path == Path.home() / "tokens"


def test_every_shipped_file_is_declared_as_package_data():
    """A file under pjax/assets that no package-data pattern in pyproject.toml covers would be
    missing from a wheel (`pip install .` or `git+URL`); the CI install check catches it too."""
    tomllib = pytest.importorskip("tomllib")
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pjax.assets"]
    files = [p.relative_to(assets.ROOT) for p in assets.ROOT.rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc")]
    # Path.match anchors at the right; equal depth makes it a whole-path match, as setuptools' globs are.
    covered = lambda f: any(f.match(pattern) and len(f.parts) == len(Path(pattern).parts) for pattern in patterns)
    assert len(files) >= 10 and [f for f in files if not covered(f)] == []


def test_no_path_loads_debug_yaml():
    assert load_config() == load_config(str(CONFIG_DIR / "debug.yaml"))
    assert load_config().log.dir == "runs/debug"


def test_bare_names_with_or_without_yaml_resolve_in_configs_dir():
    assert load_config("picotron-cpu") == load_config("picotron-cpu.yaml")
    assert load_config("picotron-cpu").model.vocab_size == 4096


def test_partial_yaml_keeps_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  steps: 7\n"))
    assert cfg.train.steps == 7
    assert dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=100)) == Config()


def test_empty_yaml_is_all_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == Config()


def test_overrides_parse_ints_floats_bools_and_null():
    cfg = load_config(overrides=["train.steps=50", "train.lr=3e-4", "model.tie_word_embeddings=true",
                                 "checkpoint.dir=null", "mesh.tp=1", "model.rope_theta=500000"])
    assert cfg.train.steps == 50 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.model.tie_word_embeddings is True
    assert cfg.checkpoint.dir is None
    assert cfg.mesh.tp == 1
    assert cfg.model.rope_theta == 500000.0 and isinstance(cfg.model.rope_theta, float)


def test_override_beats_file_and_last_override_wins():
    cfg = load_config("debug", ["train.steps=5", "train.steps=6", "checkpoint.dir=runs/x/ckpt"])
    assert cfg.train.steps == 6 and cfg.checkpoint.dir == "runs/x/ckpt"


def test_integral_float_is_accepted_for_int_fields():
    assert load_config(overrides=["train.steps=2.0"]).train.steps == 2
    assert load_config(overrides=["train.steps=1e3"]).train.steps == 1000


def test_exponent_floats_without_dot_load_as_numbers_from_yaml(tmp_path):
    assert load_config(write(tmp_path, "train:\n  lr: 1e-3\nmodel:\n  rms_norm_eps: 1e-6\n")).train.lr == 1e-3


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_dump_then_load_round_trips(name, tmp_path):
    cfg = load_config(name, ["train.lr=3e-4", "log.peak_flops=1e12", "log.profile_steps=[3, 5]"])
    assert load_config(write(tmp_path, dump_config(cfg))) == cfg


LLAMA3_ROPE = ["model.rope_type=llama3", "model.rope_factor=8", "model.rope_low_freq_factor=1",
               "model.rope_high_freq_factor=4", "model.rope_original_max_position_embeddings=8192"]


def test_rope_scaling_overrides_load_and_round_trip(tmp_path):
    cfg = load_config("debug", LLAMA3_ROPE)
    m = cfg.model
    assert (m.rope_type, m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
            m.rope_original_max_position_embeddings) == ("llama3", 8.0, 1.0, 4.0, 8192)
    assert isinstance(m.rope_factor, float) and isinstance(m.rope_original_max_position_embeddings, int)
    assert load_config(write(tmp_path, dump_config(cfg))) == cfg
    assert load_config("debug", ["model.rope_type=linear", "model.rope_factor=2"]).model.rope_factor == 2.0


@pytest.mark.parametrize("overrides,match", [
    (["model.rope_type=llama3", "model.rope_factor=8"], r"model.rope_type='llama3' needs model.rope_low_freq_factor, "
                                                        r"model.rope_high_freq_factor, model.rope_original_max_"),
    (["model.rope_type=linear"], r"model.rope_type='linear' needs model.rope_factor; set it"),
    (["model.rope_factor=2"], r"model.rope_type='default' does not use model.rope_factor; set it to null"),
    (["model.rope_type=linear", "model.rope_factor=0"], r"model.rope_factor=0.0 is invalid; use a finite number > 0"),
    ([*LLAMA3_ROPE, "model.rope_original_max_position_embeddings=0"],
     r"model.rope_original_max_position_embeddings=0 is invalid"),
    (["model.rope_type=yarn"], r"model.rope_type='yarn' is not supported: YaRN .*; use one of default, linear, "
                               r"llama3"),
])
def test_rope_scaling_mistakes_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("debug", overrides)


def test_config_to_dict_is_plain_nested_dicts():
    d = config_to_dict(load_config())
    assert d["train"]["steps"] == 200 and d["model"]["head_dim"] == 32 and d["checkpoint"]["dir"] is None
    assert all(type(v) is dict for v in d.values())
    assert d["log"]["profile_steps"] is None
    # A tuple key comes out as a list: YAML's safe dumper refuses tuples, and JSON has none.
    assert config_to_dict(load_config(overrides=["log.profile_steps=[3,5]"]))["log"]["profile_steps"] == [3, 5]


@pytest.mark.parametrize("section,keys", CONTRACT_KEYS.items())
def test_contract_keys_exist(section, keys):
    fields = {f.name for f in dataclasses.fields(getattr(Config(), section))}
    assert set(keys) <= fields


# ---- errors: one ConfigError sentence that names the key ----

def test_unknown_section_lists_valid_sections(tmp_path):
    """The closest section where one is close, else every section (one or the other: a line holds one)."""
    with pytest.raises(ConfigError, match=r"unknown config section 'trian'.*\(did you mean 'train'\?\)\.$"):
        load_config(write(tmp_path, "trian:\n  steps: 3\n"))
    with pytest.raises(ConfigError, match=r"unknown config section 'zzz'.*; valid sections: checkpoint, context, "
                                          r"data, log, mesh, meta, model, moe, pipeline, precision, train"):
        load_config(write(tmp_path, "zzz:\n  steps: 3\n"))


def test_context_strategy_is_checked():
    assert load_config(overrides=["context.strategy=ulysses"]).context.strategy == "ulysses"
    with pytest.raises(ConfigError, match=r"context.strategy='rings' is invalid; choose one of ring, all_gather, ulysses"):
        load_config(overrides=["context.strategy=rings"])


def test_unknown_key_suggests_close_match():
    with pytest.raises(ConfigError, match=r"unknown key 'train.stpes'.*did you mean 'train.steps'.*"
                       r"every train key: docs/training.md#every-config-key") as caught:
        load_config(overrides=["train.stpes=10"])
    assert len(str(caught.value)) < 160, str(caught.value)  # the suggestion and a pointer, not every key


def test_unknown_key_in_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'model.hidden'.*cfg.yaml.*did you mean 'model.hidden_size'"):
        load_config(write(tmp_path, "model:\n  hidden: 64\n"))


@pytest.mark.parametrize("override,match", [
    ("train.steps=ten", r"train.steps must be an integer, got 'ten'"),
    ("train.steps=2.5", r"train.steps must be an integer, got 2.5"),
    ("train.steps=true", r"train.steps must be an integer, got True"),
    ("train.steps=null", r"train.steps must be an integer, got null"),
    ("train.lr=fast", r"train.lr must be a finite number, got 'fast'"),
    ("model.tie_word_embeddings=1", r"model.tie_word_embeddings must be true or false, got 1"),
    ("data.path=123", r"data.path must be a string"),
    ("checkpoint.dir=[a, b]", r"checkpoint.dir must be a string .*or null, got a list"),
    ("log.profile_steps=5", r"log.profile_steps must be a list of 2 integers or null, got 5"),
    ("log.profile_steps=[3]", r"log.profile_steps must be a list of 2 integers or null, got a list \[3\]"),
    ("log.profile_steps=[3, x]", r"log.profile_steps must be a list of 2 integers or null, got a list \[3, 'x'\]"),
])
def test_wrong_type_names_key_and_value(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[override])


@pytest.mark.parametrize("override", ["train.steps", "=5", "train.steps 5"])
def test_malformed_override_says_key_equals_value(override):
    with pytest.raises(ConfigError, match=r"must look like key=value"):
        load_config(overrides=[override])


def test_override_without_section_asks_for_dotted_key():
    with pytest.raises(ConfigError, match=r"override key 'steps' must be section.key"):
        load_config(overrides=["steps=5"])


def test_missing_file_lists_available_configs():
    with pytest.raises(ConfigError, match=r"config file 'nope.yaml' not found; available configs: .*debug.*picotron-cpu"):
        load_config("nope.yaml")


def test_yaml_syntax_error_is_one_line_with_line_number(tmp_path):
    with pytest.raises(ConfigError, match=r"is not valid YAML.*line 3") as info:
        load_config(write(tmp_path, "train:\n  steps: 3\n  lr: 1: 2\n"))
    assert "\n" not in str(info.value)


def test_non_mapping_document_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"must be a mapping of sections.*got a list"):
        load_config(write(tmp_path, "- train\n- mesh\n"))


def test_non_mapping_section_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"config section 'train'.*must be a mapping of keys, got 5"):
        load_config(write(tmp_path, "train: 5\n"))


@pytest.mark.parametrize("override,key", [
    ("train.steps=0", "train.steps"), ("train.seq_len=0", "train.seq_len"),
    ("train.batch_size=0", "train.batch_size"), ("train.grad_accum=0", "train.grad_accum"),
    ("train.lr=0", "train.lr"), ("train.warmup_steps=-1", "train.warmup_steps"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio"), ("train.min_lr_ratio=-0.1", "train.min_lr_ratio"),
    ("train.dtype=float16", "train.dtype"), ("train.remat=some", "train.remat"), ("train.zero=2", "train.zero"),
    ("train.attention=flash", "train.attention"), ("pipeline.schedule=gpipe", "pipeline.schedule"),
    ("pipeline.virtual_stages=0", "pipeline.virtual_stages"), ("log.every=0", "log.every"),
    ("log.eval_every=-1", "log.eval_every"), ("checkpoint.every=-1", "checkpoint.every"),
    ("checkpoint.keep=0", "checkpoint.keep"), ("data.eval_fraction=1.0", "data.eval_fraction"),
    ("log.profile_steps=[0,5]", "log.profile_steps"), ("log.profile_steps=[3,0]", "log.profile_steps"),
    ("train.seed=-1", "train.seed"), ("train.seed=4294967296", "train.seed"),
])
def test_impossible_value_names_key(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}=.* is invalid; "):
        load_config(overrides=[override])


def test_choice_errors_list_the_valid_choices():
    remats = "none, full, dots, dots_no_batch, offload, names"
    with pytest.raises(ConfigError, match=rf"train.remat='some' is invalid; choose one of {remats}"):
        load_config(overrides=["train.remat=some"])
    with pytest.raises(ConfigError, match=r"pipeline.schedule='gpipe' is invalid; choose one of 1f1b, 1f1b_lockstep, afab, interleaved"):
        load_config(overrides=["pipeline.schedule=gpipe"])


def test_remat_names_is_a_list_checked_against_the_layer_names(tmp_path):
    train = load_config(overrides=["train.remat=names", "train.remat_names=[q_proj, gate_proj]"]).train
    assert train.remat_names == ("q_proj", "gate_proj") and train.saved_names == ("q_proj", "gate_proj")
    assert load_config(overrides=["train.remat=names"]).train.saved_names == ("q_proj", "k_proj", "v_proj", "o_proj")
    cfg = load_config(write(tmp_path, "train:\n  remat: names\n  remat_names:\n  - attn_out\n"))
    assert cfg.train.remat_names == ("attn_out",) and load_config(write(tmp_path, dump_config(cfg))) == cfg
    with pytest.raises(ConfigError, match=r"^train.remat_names=\['q_prj'\] is invalid; 'q_prj' is not a name; "
                                          r"choose from attn_norm, q_proj, k_proj, v_proj, attn_out, o_proj, "
                                          r"mlp_norm, gate_proj, up_proj\.$"):
        load_config(overrides=["train.remat=names", "train.remat_names=[q_prj]"])
    with pytest.raises(ConfigError, match=r"^train.remat_names must be a list of strings"):
        load_config(overrides=["train.remat=names", "train.remat_names=q_proj"])


def test_remat_names_without_remat_names_is_an_error_not_ignored():
    with pytest.raises(ConfigError, match=r"^train.remat_names=\['q_proj'\] is invalid; it applies only with "
                                          r"train.remat=names \(train.remat=dots\)"):
        load_config(overrides=["train.remat=dots", "train.remat_names=[q_proj]"])


def test_model_shape_errors_propagate_from_llama_config():
    with pytest.raises(ConfigError, match=r"model.hidden_size=130 is not divisible by model.num_attention_heads"):
        load_config(overrides=["model.hidden_size=130", "model.head_dim=null"])


def test_mesh_sizes_are_left_to_mesh_validation():
    assert load_config(overrides=["mesh.tp=3"]).mesh == MeshConfig(dp=-1, pp=1, cp=1, tp=3)


def test_a_dense_checkpoint_resumes_whatever_num_experts_per_tok_says():
    """A dense model reads no num_experts_per_tok: a value there must not refuse a resume, while an
    MoE model's top-k (and any dense shape key) still must match."""
    from pjax.checkpoint.checkpointer import check_compatible

    saved = load_config()
    check_compatible(saved, load_config(overrides=["model.num_experts_per_tok=1"]), "in runs/x")
    with pytest.raises(ConfigError, match=r"model.hidden_size=64 \(checkpoint: 128\)"):
        check_compatible(saved, load_config(overrides=["model.hidden_size=64"]), "in runs/x")
    moe = load_config("mixtral-tiny")
    with pytest.raises(ConfigError, match=r"model.num_experts_per_tok=1 \(checkpoint: 2\)"):
        check_compatible(moe, load_config("mixtral-tiny", ["model.num_experts_per_tok=1"]), "in runs/x")
