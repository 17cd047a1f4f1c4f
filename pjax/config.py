"""Run configuration: frozen dataclasses, one per YAML section. The key names are a contract used by tests,
docs and notebooks; README.md's table describes each key."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from mesh.errors import require, require_choice
from mesh.mesh import MeshConfig
from models.config import LlamaConfig
from models.moe import MoeConfig
from models.precision import PrecisionConfig
from models.remat import DEFAULT_NAMES as DEFAULT_REMAT_NAMES
from models.remat import NAMES as REMAT_NAMES
from pjax.parallel.context.strategy import ContextConfig
from pjax.parallel.pipeline.table import PipelineConfig

# The choices each string option accepts; the first is the default.
DTYPES = ("auto", "float32", "bfloat16")
REMATS = ("none", "full", "dots", "dots_no_batch", "offload", "names")
ZERO_STAGES = (0, 1, 3)
ATTENTIONS = ("auto", "reference", "blocked", "chunked", "cudnn")
ON_NONFINITE = ("stop", "skip")
GRAD_COMPRESSIONS = ("none", "bf16", "int8", "powersgd")
META_ALGORITHMS = ("reptile", "fomaml", "maml")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and step layout; `batch_size` is global, split into `grad_accum` micro-batches."""

    steps: int = 100
    # Saved with checkpoints (ARCHITECTURE.md, "The schedule's length is saved with the checkpoint").
    schedule_steps: int | None = None
    seed: int = 0
    seq_len: int = 128
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    dtype: str = "auto"
    remat: str = "none"
    remat_names: tuple[str, ...] | None = None
    zero: int = 0
    zero_shard: int = 0  # HSDP: ZeRO shards over groups of this many consecutive data replicas, copied across (0: all)
    sequence_parallel: bool = False
    scan_layers: bool = True
    attention: str = "auto"
    loss_chunk: int = 0
    init_from: str | None = None
    on_nonfinite: str = "stop"
    max_skipped: int = 5
    grad_compression: str = "none"  # the once-per-step data reduction's payload (pjax/parallel/compression.py)
    powersgd_rank: int | None = None  # with grad_compression=powersgd; null: 1
    powersgd_start: int = 0  # exact reductions before PowerSGD's first (PyTorch's start_powerSGD_iter)
    local_steps: int = 0  # DiLoCo's inner steps per outer step, H (pjax/parallel/outer.py); 0: synchronous
    outer_lr: float = 0.7  # DiLoCo's outer SGD learning rate and Nesterov momentum (the paper's values)
    outer_momentum: float = 0.9
    diloco_groups: int | None = None  # null: one group per dp replica; else groups of dp / diloco_groups replicas
    diloco_fragments: int = 1  # streaming DiLoCo (pjax/parallel/streaming.py): fragments synchronised in turn
    diloco_overlap: int = 0  # streaming DiLoCo's tau: inner steps between a fragment's send and its arrival
    diloco_mix: float = 0.0  # at an arrival, the share of the groups' own fragment kept (0: the global one alone)
    xla_options: bool = True  # pjax's XLA:GPU options on GPU steps (pjax/xla_options.py); false: XLA's defaults

    def __post_init__(self) -> None:
        # Sizes that must be divisible by the mesh are checked in mesh/validate.py, which knows the mesh.
        for key in ("steps", "seq_len", "batch_size", "grad_accum", "max_skipped"):
            require(getattr(self, key) >= 1, f"train.{key}", getattr(self, key), "use an integer >= 1")
        require(self.schedule_steps is None or self.schedule_steps >= 1, "train.schedule_steps", self.schedule_steps,
                 "use an integer >= 1, or null for train.steps")
        require_choice("train.on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        # jax.random.key keeps the low 32 bits without x64: seed 2**32 would initialise like seed 0.
        require(0 <= self.seed < 2**32, "train.seed", self.seed, "use an integer in [0, 2**32)")
        require(self.lr > 0, "train.lr", self.lr, "use a learning rate > 0")
        require(self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "use an integer >= 0")
        require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "use a value in [0, 1]")
        require(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "use a value >= 0")
        for key in ("beta1", "beta2"):
            require(0 <= getattr(self, key) < 1, f"train.{key}", getattr(self, key), "use a value in [0, 1)")
        require(self.eps > 0, "train.eps", self.eps, "use a value > 0")
        require(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "use a value >= 0 (0 disables clipping)")
        require_choice("train.dtype", self.dtype, DTYPES)
        require(isinstance(self.xla_options, bool), "train.xla_options", self.xla_options, "use true or false")
        require_choice("train.remat", self.remat, REMATS)
        if self.remat_names is not None:
            unknown = [n for n in self.remat_names if n not in REMAT_NAMES]
            require(not unknown, "train.remat_names", list(self.remat_names),
                     f"{', '.join(map(repr, unknown))} {'is not a name' if len(unknown) == 1 else 'are not names'}; choose from {', '.join(REMAT_NAMES)}")
            require(self.remat == "names", "train.remat_names", list(self.remat_names),
                     f"it applies only with train.remat=names (train.remat={self.remat}): set that, "
                     "or leave train.remat_names unset")
        require_choice("train.zero", self.zero, ZERO_STAGES)
        require(isinstance(self.zero_shard, int) and not isinstance(self.zero_shard, bool) and self.zero_shard >= 0,
                "train.zero_shard", self.zero_shard, "use an integer >= 1 that divides mesh.dp, or 0 for all of dp")
        require(self.zero_shard == 0 or self.zero > 0, "train.zero_shard", self.zero_shard,
                "it applies only with train.zero=1 or 3: set one, or leave train.zero_shard unset")
        require_choice("train.attention", self.attention, ATTENTIONS)
        require(self.loss_chunk >= 0, "train.loss_chunk", self.loss_chunk, "use an integer >= 0 (0 turns it off)")
        require_choice("train.grad_compression", self.grad_compression, GRAD_COMPRESSIONS)
        if self.powersgd_rank is not None:
            require(self.powersgd_rank >= 1, "train.powersgd_rank", self.powersgd_rank, "use an integer >= 1")
            require(self.grad_compression == "powersgd", "train.powersgd_rank", self.powersgd_rank,
                    f"it applies only with train.grad_compression=powersgd (it is {self.grad_compression}): set "
                    "that, or leave train.powersgd_rank unset")
        require(self.powersgd_start >= 0, "train.powersgd_start", self.powersgd_start, "use an integer >= 0")
        require(self.powersgd_start == 0 or self.grad_compression == "powersgd", "train.powersgd_start",
                self.powersgd_start, f"it applies only with train.grad_compression=powersgd (it is "
                f"{self.grad_compression}): set that, or leave train.powersgd_start at 0")
        require(self.local_steps >= 0, "train.local_steps", self.local_steps, "use an integer >= 0 (0: synchronous)")
        require(self.outer_lr > 0, "train.outer_lr", self.outer_lr, "use a learning rate > 0")
        require(0 <= self.outer_momentum < 1, "train.outer_momentum", self.outer_momentum, "use a value in [0, 1)")
        require(self.diloco_groups is None or self.diloco_groups >= 1, "train.diloco_groups", self.diloco_groups,
                "use an integer >= 1 (groups of dp / diloco_groups replicas), or null for one group per replica")
        require(self.diloco_groups is None or self.local_steps > 0, "train.diloco_groups", self.diloco_groups,
                "it applies only with train.local_steps > 0 (DiLoCo): set that, or leave train.diloco_groups unset")
        require(self.diloco_fragments >= 1, "train.diloco_fragments", self.diloco_fragments,
                "use an integer >= 1 (1: the whole model at once)")
        require(self.diloco_overlap >= 0, "train.diloco_overlap", self.diloco_overlap, "use an integer >= 0")
        require(0 <= self.diloco_mix < 1, "train.diloco_mix", self.diloco_mix, "use a value in [0, 1)")
        for key in ("diloco_fragments", "diloco_overlap", "diloco_mix"):
            default = type(self).__dataclass_fields__[key].default
            require(getattr(self, key) == default or self.local_steps > 0, f"train.{key}", getattr(self, key),
                    f"it applies only with train.local_steps > 0 (DiLoCo): set that, or leave train.{key} unset")

    @property
    def compression_rank(self) -> int:
        """PowerSGD's rank: train.powersgd_rank, 1 when unset."""
        return self.powersgd_rank or 1


    @property
    def saved_names(self) -> tuple[str, ...]:
        """The activations remat=names keeps."""
        return DEFAULT_REMAT_NAMES if self.remat_names is None else self.remat_names


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The text and its tokenizer; a relative path is read from the working directory, else from `pjax/assets/`."""

    path: str = "data/prideprejudice.txt"
    tokenizer: str = "data/tokenizer/gpt2"
    cache_dir: str | None = None
    eval_fraction: float = 0.05
    split: str = "train"
    column: str = "text"
    streaming: bool = False
    prefetch: int = 2
    curriculum: str | None = None  # sequence-length stages "LENGTHxSTEPS,...", pjax/data/curriculum.py

    def __post_init__(self) -> None:
        require(0 <= self.eval_fraction < 1, "data.eval_fraction", self.eval_fraction, "use a value in [0, 1)")
        require(bool(self.split), "data.split", self.split, "name a split of the dataset, e.g. train")
        require(bool(self.column), "data.column", self.column, "name the column that holds the text, e.g. text")
        require(self.prefetch >= 0, "data.prefetch", self.prefetch, "use an integer >= 0 (0 builds batches "
                 "on the training loop's thread)")
        require(not self.streaming or self.eval_fraction <= 0.5, "data.eval_fraction", self.eval_fraction,
                 "with data.streaming=true every round(1/eval_fraction)-th document is held out, so use at most 0.5")

    @property
    def eval_stride(self) -> int:
        """Streaming holds out every eval_stride-th document (0: none): the corpus's length is unknown."""
        return round(1 / self.eval_fraction) if self.eval_fraction > 0 else 0

    @property
    def cache_path(self) -> Path:
        """Where the tokenized corpus is cached, never inside the installed package (may be read-only)."""
        if self.cache_dir is not None:
            return Path(self.cache_dir).expanduser()
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "pjax", "tokens")


@dataclasses.dataclass(frozen=True)
class LogConfig:
    dir: str = "runs/debug"
    every: int = 1
    eval_every: int = 50
    eval_batches: int = 4
    peak_flops: float | None = None
    spike_sigma: float = 6.0
    inspect: bool = False
    profile_steps: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        require(self.every >= 1, "log.every", self.every, "use an integer >= 1")
        require(self.eval_every >= 0, "log.eval_every", self.eval_every, "use an integer >= 0 (0 disables evaluation)")
        require(self.eval_batches >= 1, "log.eval_batches", self.eval_batches, "use an integer >= 1")
        require(self.peak_flops is None or self.peak_flops > 0, "log.peak_flops", self.peak_flops,
                 "use a positive FLOP/s figure or null")
        require(self.spike_sigma >= 0, "log.spike_sigma", self.spike_sigma, "use a value >= 0 (0 turns it off)")
        steps = self.profile_steps
        require(steps is None or (isinstance(steps, tuple) and len(steps) == 2 and
                                   all(type(n) is int and n >= 1 for n in steps)),
                 "log.profile_steps", list(steps) if isinstance(steps, tuple) else steps,
                 "use [start, count] (trace count >= 1 steps from step start >= 1), or null for no trace")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    every: int = 0
    keep: int = 3
    resume: bool = True

    def __post_init__(self) -> None:
        require(self.every >= 0, "checkpoint.every", self.every, "use an integer >= 0 (0 saves only at the end)")
        require(self.keep >= 1, "checkpoint.keep", self.keep, "use an integer >= 1")
        require(self.every == 0 or self.dir is not None, "checkpoint.every", self.every,
                 "it saves only with a checkpoint.dir: set one, or checkpoint.every=0")


@dataclasses.dataclass(frozen=True)
class MetaConfig:
    """Meta-learning over tasks (pjax/parallel/meta.py): off while `algorithm` is null."""

    algorithm: str | None = None  # reptile, fomaml or maml
    inner_steps: int = 1  # SGD steps that adapt to a task, one micro-batch each
    inner_lr: float = 0.1
    tasks: tuple[str, ...] = ()  # data sources, one task each, read like data.path with data.tokenizer
    task_field: str | None = None  # set: `tasks` are values of this field of data.path's .jsonl/.parquet records

    def __post_init__(self) -> None:
        if self.algorithm is not None:
            require_choice("meta.algorithm", self.algorithm, META_ALGORITHMS)
        require(self.inner_steps >= 1, "meta.inner_steps", self.inner_steps, "use an integer >= 1")
        require(self.inner_lr > 0, "meta.inner_lr", self.inner_lr, "use a learning rate > 0")
        require(self.algorithm is None or len(self.tasks) > 0, "meta.tasks", list(self.tasks),
                "name at least one data source per dp group, e.g. meta.tasks=[data/emma.txt,data/persuasion.txt]")
        require(self.algorithm is not None or not self.tasks, "meta.tasks", list(self.tasks),
                "it applies only with a meta.algorithm: set one, or leave meta.tasks unset")
        for key in ("inner_steps", "inner_lr"):
            unchanged = getattr(self, key) == MetaConfig.__dataclass_fields__[key].default
            require(self.algorithm is not None or unchanged, f"meta.{key}", getattr(self, key),
                    "it applies only with a meta.algorithm: set one, or leave it unset")
        require(self.task_field is None or (self.algorithm is not None and bool(self.task_field)), "meta.task_field",
                self.task_field, "name a field of data.path's records, and only with a meta.algorithm")

    @property
    def query(self) -> int:
        """Micro-batches after the adapting ones that the meta-gradient is taken on: 1 (fomaml, maml) or 0."""
        return 0 if self.algorithm == "reptile" else 1


@dataclasses.dataclass(frozen=True)
class Config:
    model: LlamaConfig = dataclasses.field(default_factory=LlamaConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    context: ContextConfig = dataclasses.field(default_factory=ContextConfig)
    moe: MoeConfig = dataclasses.field(default_factory=MoeConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    meta: MetaConfig = dataclasses.field(default_factory=MetaConfig)
