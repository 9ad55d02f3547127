"""Configuration of the trainer: the model, the parallel layout and the training run.

Three frozen dataclasses, each validated on construction with a one-line ``ValueError``:

* :class:`ModelConfig` — the GPT's shape (byte-level vocabulary of 256 by default);
* :class:`ParallelConfig` — the mesh sizes ``dp``, ``pp``, ``tp``, ``cp`` and sequence parallelism;
* :class:`TrainConfig` — steps, microbatching, optimizer, precision, device, DP bucket size.

:func:`check_compatible` checks the three against each other (a head count that the TP size
does not divide, more stages than layers, ...). :func:`configs_from_mapping` builds all three
from a nested mapping such as a parsed TOML file with ``[model]``, ``[parallel]`` and
``[train]`` tables. Presets: :data:`TINY` (a CPU model that trains a step in tens of
milliseconds at dp2 pp2 tp2) and :data:`GPT_1B` (about 1.2 billion parameters, for one GPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_POS = ("rope", "learned")
_NORM = ("layernorm", "rmsnorm")
_OPTIMIZERS = ("adamw", "lamb")
_DEVICES = ("cpu", "cuda")
_DTYPES = ("fp32", "bf16")
_RECOMPUTE = ("none", "full", "selective")
_DATA = ("fixed", "varlen")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    """A GPT decoder. ``d_ff=0`` means ``4 * d_model``; embeddings are untied (the input
    embedding lives on the first pipeline stage and the output head on the last)."""

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 64
    seq_len: int = 64
    d_ff: int = 0
    pos: str = "rope"
    norm: str = "layernorm"
    parallel_block: bool = False
    sliding_window: int | None = None
    bias: bool = True
    experts: int = 0  # 0: a dense MLP; N: a mixture of N experts in every block's MLP
    top_k: int = 2  # experts each token is routed to (with experts > 0)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len"):
            _require(getattr(self, name) >= 1, f"model.{name} must be >= 1")
        _require(self.d_ff >= 0, "model.d_ff must be >= 0 (0 means 4 * d_model)")
        _require(
            self.d_model % self.n_head == 0,
            f"model.d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})",
        )
        _require(self.pos != "rope" or self.head_dim % 2 == 0, "rope needs an even head dimension")
        _require(self.pos in _POS, f"model.pos must be one of {_POS}, not {self.pos!r}")
        _require(self.norm in _NORM, f"model.norm must be one of {_NORM}, not {self.norm!r}")
        _require(
            self.sliding_window is None or self.sliding_window >= 1,
            "model.sliding_window must be >= 1 or None",
        )
        _require(self.experts >= 0, "model.experts must be >= 0 (0: a dense MLP)")
        _require(
            self.experts == 0 or 1 <= self.top_k <= self.experts,
            f"model.top_k must be in 1..experts={self.experts}, got {self.top_k}",
        )

    @property
    def ff(self) -> int:
        """Hidden size of the MLP."""
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_head


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh sizes. ``sp`` (sequence parallelism) shards the activations outside the tensor
    parallel regions along the sequence over the TP group; it needs ``tp > 1`` to matter.
    ``cp`` (context parallelism, DeepSpeed Ulysses) splits every sequence into ``cp``
    contiguous chunks, one per rank of the CP group (``trainer/parallel/context.py``).
    ``ep`` (expert parallelism) is carved from ``dp``, as in Megatron and torchtitan: the
    experts are sharded over groups of ``ep`` consecutive data-parallel ranks, and it adds no
    ranks to the world."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    sp: bool = False
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "cp", "ep"):
            _require(getattr(self, name) >= 1, f"parallel.{name} must be >= 1")
        _require(self.dp % self.ep == 0, f"ep={self.ep} must divide dp={self.dp}")

    @property
    def world_size(self) -> int:
        """dp x pp x tp x cp (ep is carved from dp and adds none)."""
        return self.dp * self.pp * self.tp * self.cp

    @property
    def sizes(self) -> dict[str, int]:
        """``{dp, pp, tp, cp}``."""
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "cp": self.cp}


@dataclass(frozen=True)
class TrainConfig:
    """One training run. The global batch is ``dp * microbatches * micro_batch_size``
    sequences of ``seq_len`` tokens. The learning rate warms up linearly over ``warmup``
    steps, then follows a cosine down to ``min_lr_ratio * lr`` at ``steps``."""

    steps: int = 20
    microbatches: int = 4
    micro_batch_size: int = 2
    lr: float = 1e-3
    warmup: int = 2
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    optimizer: str = "adamw"
    grad_clip: float = 1.0
    seed: int = 1234
    device: str = "cpu"
    dtype: str = "fp32"
    compile: bool | None = None  # torch.compile of the blocks; None: on CUDA, not on CPU
    recompute: str = "none"  # none | full (each block) | selective (each attention)
    checkpoint_every: int = 0
    checkpoint_async: bool = False  # persist checkpoints in the background (trainer/checkpoint.py)
    bucket_size_mb: float = 4.0
    data: str = "fixed"  # fixed: windows of seq_len tokens | varlen: packed documents
    # share of each rank's optimizer state (Adam moments, masters) kept and updated on the
    # host, its transfers overlapped with the next step's forward (trainer/offload.py)
    optimizer_offload: float = 0.0

    @property
    def compiles(self) -> bool:
        """Whether the blocks are compiled: ``compile`` when set, else on CUDA only (on a CPU
        the compile time outweighs what a short run gains)."""
        return self.device == "cuda" if self.compile is None else self.compile

    def __post_init__(self) -> None:
        for name in ("steps", "microbatches", "micro_batch_size"):
            _require(getattr(self, name) >= 1, f"train.{name} must be >= 1")
        for name in ("warmup", "checkpoint_every", "weight_decay", "grad_clip"):
            _require(getattr(self, name) >= 0, f"train.{name} must be >= 0")
        _require(self.lr > 0, "train.lr must be > 0")
        _require(self.bucket_size_mb > 0, "train.bucket_size_mb must be > 0")
        _require(
            self.optimizer in _OPTIMIZERS,
            f"train.optimizer must be one of {_OPTIMIZERS}, not {self.optimizer!r}",
        )
        _require(self.device in _DEVICES, f"train.device must be one of {_DEVICES}")
        _require(self.dtype in _DTYPES, f"train.dtype must be one of {_DTYPES}")
        _require(self.recompute in _RECOMPUTE, f"train.recompute must be one of {_RECOMPUTE}")
        _require(self.data in _DATA, f"train.data must be one of {_DATA}, not {self.data!r}")
        _require(
            0.0 <= self.optimizer_offload <= 1.0,
            f"train.optimizer_offload must be a fraction in [0, 1], not {self.optimizer_offload}",
        )
        if self.optimizer_offload > 0:
            _require(self.optimizer == "adamw", "train.optimizer_offload needs the adamw optimizer")
            _require(
                not self.checkpoint_every,
                "train.optimizer_offload does not save checkpoints yet (checkpoint_every 0)",
            )

    @property
    def bucket_numel(self) -> int:
        """Elements (float32) per DP gradient bucket."""
        return max(1, int(self.bucket_size_mb * 2**20 / 4))


TINY = ModelConfig()
"""The default CPU model: 4 layers, d_model 64, 4 heads, 64 tokens (~0.2M parameters)."""

GPT_1B = ModelConfig(n_layer=24, n_head=16, d_model=2048, seq_len=2048, pos="rope", bias=False)
"""About 1.2 billion parameters: a one-GPU preset (bf16 autocast, flash attention)."""

PRESETS: dict[str, ModelConfig] = {"tiny": TINY, "gpt-1b": GPT_1B}


def check_compatible(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> None:
    """Raise a one-line ``ValueError`` if the layout cannot split this model."""
    tp, pp, cp = parallel.tp, parallel.pp, parallel.cp
    _require(model.n_head % tp == 0, f"tp={tp} must divide model.n_head={model.n_head}")
    _require(model.seq_len % cp == 0, f"cp={cp} must divide seq_len={model.seq_len}")
    _require(
        (model.n_head // tp) % cp == 0,
        f"cp={cp} must divide the {model.n_head // tp} attention heads per tensor-parallel rank "
        f"(n_head={model.n_head}, tp={tp})",
    )
    _require(model.ff % tp == 0, f"tp={tp} must divide the MLP size {model.ff}")
    _require(model.vocab_size % tp == 0, f"tp={tp} must divide vocab_size={model.vocab_size}")
    _require(
        not parallel.sp or model.seq_len % (tp * cp) == 0,
        f"sequence parallelism needs tp={tp} to divide seq_len={model.seq_len}"
        if cp == 1
        else f"sequence parallelism needs tp={tp} to divide each cp chunk of "
        f"{model.seq_len // cp} tokens (seq_len={model.seq_len} / cp={cp})",
    )
    _require(pp <= model.n_layer, f"pp={pp} stages need at least {pp} layers, not {model.n_layer}")
    ep = parallel.ep
    _require(ep == 1 or model.experts > 0, f"ep={ep} needs a mixture of experts (--experts N)")
    _require(
        model.experts % ep == 0,
        f"ep={ep} must divide the number of experts ({model.experts})",
    )
    del train  # nothing in TrainConfig constrains the layout today


def _build(cls: type, section: str, values: Any) -> Any:
    if values is None:
        return cls()
    if not isinstance(values, Mapping):
        raise ValueError(f"[{section}] must be a table")
    known = {f.name for f in dataclasses.fields(cls)} | (
        {"preset"} if cls is ModelConfig else set()
    )
    unknown = sorted(set(values) - known)
    _require(not unknown, f"[{section}] has unknown keys: {', '.join(unknown)}")
    kwargs = dict(values)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    base = PRESETS.get(str(kwargs.pop("preset", ""))) if cls is ModelConfig else None
    try:
        return dataclasses.replace(base, **kwargs) if base else cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"[{section}]: {e}") from None


def configs_from_mapping(
    data: Mapping[str, Any],
) -> tuple[ModelConfig, ParallelConfig, TrainConfig]:
    """Build the three configs from ``{"model": {...}, "parallel": {...}, "train": {...}}``.

    ``model.preset`` (``"tiny"`` or ``"gpt-1b"``) starts from a preset; other keys override it.
    Unknown sections or keys are errors, so a typo never silently falls back to a default.
    """
    unknown = sorted(set(data) - {"model", "parallel", "train"})
    _require(not unknown, f"unknown config sections: {', '.join(unknown)}")
    model_values = data.get("model")
    if isinstance(model_values, Mapping) and "preset" in model_values:
        _require(
            model_values["preset"] in PRESETS,
            f"model.preset must be one of {sorted(PRESETS)}",
        )
    model = _build(ModelConfig, "model", model_values)
    parallel = _build(ParallelConfig, "parallel", data.get("parallel"))
    train = _build(TrainConfig, "train", data.get("train"))
    check_compatible(model, parallel, train)
    return model, parallel, train
