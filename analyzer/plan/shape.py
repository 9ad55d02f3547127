"""The model's shape, read from run.json: parameters, FLOPs and activations per rank of a layout.

Two kinds of run carry a model: the trainer's (``model.config`` with ``n_layer``, ``d_model``,
``n_head``, ...; its layout knobs under ``train`` and ``parallel``) and the simulator's
(``layers``, ``hidden``, ...; a GPT whose stages hold ``12 h^2`` parameters per layer and whose
compute is those parameters' matrix multiplies only). Everything a layout changes is counted
here from the shape, never measured: a stage's layers are split as the trainer splits them
(contiguous, earlier stages taking one more), its tensor-parallel matrices are divided by
``tp``, the norms, row-parallel biases and learned positions are replicated, the vocabulary
(embedding and head) is split over ``tp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class PlanError(ValueError):
    """A run the planner cannot model; the message is one line."""


@dataclass(frozen=True)
class Shape:
    """The GPT and the batch of a run (see the module docstring)."""

    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab: int
    ff: int
    micro_batch: int
    microbatches: int
    dp: int  # the run's data-parallel size (the global batch is dp x microbatches)
    act_bytes: int  # bytes of one activation element (4 fp32, 2 bf16)
    bias: bool = True
    layernorm: bool = True
    learned_pos: bool = False
    simulated: bool = False  # the simulator's GPT: 12 h^2 per layer, matmul FLOPs only
    sp: bool = False
    recompute: str = "none"
    bucket_bytes: int = 4 * 2**20  # the trainer's DP bucket size
    sim_buckets: int = 2  # the simulator's DP buckets per step
    optimizer: str = "adamw"
    world: int = 1  # the run's ranks: every layout of the plan has as many

    @property
    def global_microbatches(self) -> int:
        """Microbatches of the global batch (every layout of the plan trains the same)."""
        return self.dp * self.microbatches

    @property
    def tokens_per_microbatch(self) -> int:
        """Tokens in one microbatch: sequences times sequence length."""
        return self.micro_batch * self.seq_len

    def stage_layers(self, pp: int, stage: int) -> int:
        """Layers of ``stage`` (the trainer's split: earlier stages take one more)."""
        base, extra = divmod(self.n_layer, pp)
        return base + (1 if stage < extra else 0)

    # ---------------------------------------------------------------- parameters

    def _layer_params(self) -> tuple[int, int]:
        """One block's parameters: (split over tp, replicated over tp)."""
        d, ff, b = self.d_model, self.ff, int(self.bias)
        if self.simulated:
            return 12 * d * d, 0
        norm = d * (2 if self.layernorm and self.bias else 1)
        split = 3 * d * d + 3 * d * b + d * d + d * ff + ff * b + ff * d
        replicated = 2 * norm + d * b + d * b  # two norms, the two row-parallel biases
        return split, replicated

    def rank_params(self, pp: int, tp: int, stage: int) -> float:
        """Parameters held by one rank of ``stage`` (its tensor-parallel shard)."""
        split, rep = self._layer_params()
        n = self.stage_layers(pp, stage) * (split / tp + rep)
        if self.simulated:
            return n
        d = self.d_model
        if stage == 0:
            n += self.vocab * d / tp + (self.seq_len * d if self.learned_pos else 0)
        if stage == pp - 1:
            n += self.vocab * d / tp + d * (2 if self.layernorm and self.bias else 1)
        return n

    def dp_buckets(self, pp: int, tp: int, stage: int) -> list[int]:
        """Bytes of the DP gradient buckets of one rank of ``stage`` (fp32 gradients)."""
        total = int(self.rank_params(pp, tp, stage) * (2 if self.simulated else 4))
        if self.simulated:
            return [total // self.sim_buckets] * self.sim_buckets
        n = max(1, -(-total // self.bucket_bytes))
        return [total // n] * n

    # ---------------------------------------------------------------- compute

    def forward_flops(self, pp: int, tp: int, cp: int, stage: int) -> float:
        """FLOPs of one microbatch's forward on one rank of ``stage``."""
        tokens = self.tokens_per_microbatch / cp
        split, rep = self._layer_params()
        layers = self.stage_layers(pp, stage)
        flops = 2.0 * split / tp * tokens * layers
        if self.simulated:
            return flops
        flops += 4.0 * self.d_model * self.seq_len * tokens * layers / tp  # q k^T and att v
        if stage == pp - 1:
            flops += 2.0 * self.vocab * self.d_model * tokens / tp  # the head
        return flops

    def pass_extras(
        self, pp: int, tp: int, cp: int, stage: int, backward: bool
    ) -> list[tuple[str, float]]:
        """The trainer's collectives of one pass that the step graph's layers leave out, as
        ``(op, bytes)`` over the tp group: the vocabulary-parallel embedding's all-reduce of
        its output (first stage, forward), the head's all-reduce of its input gradient (last
        stage, backward) and the vocabulary-parallel loss's two small ones (its max and sums,
        last stage, forward). None on a simulated run or without tp."""
        if self.simulated or tp == 1:
            return []
        tokens = self.tokens_per_microbatch / cp
        act = tokens * self.d_model * self.act_bytes
        out: list[tuple[str, float]] = []
        if stage == 0 and not backward:
            out.append(("all_reduce", act))
        if stage == pp - 1:
            out += (
                [("all_reduce", act)]
                if backward
                else [("all_reduce", tokens * 4.0), ("all_reduce", tokens * 8.0)]
            )
        return out

    def step_extras(self, mesh: dict[str, int]) -> list[tuple[str, str, int]]:
        """The trainer's small per-step collectives, as ``(axis, op, size)``: the loss and the
        gradient norm all-reduced over every axis of more than one rank (the norm over tp too)."""
        if self.simulated:
            return []
        out = []
        for axis in ("pp", "dp", "cp"):
            if mesh[axis] > 1:
                out += [(axis, "all_reduce", mesh[axis])] * 2
        if mesh["tp"] > 1:
            out.append(("tp", "all_reduce", mesh["tp"]))
        return out

    # ---------------------------------------------------------------- activations

    def activation_bytes(self, pp: int, tp: int, cp: int, stage: int, recompute: str) -> float:
        """Activations one rank of ``stage`` holds at its peak under 1F1B: ``min(pp - stage,
        M)`` microbatches in flight, each keeping, per layer, ``T d (10 + 24 / tp)`` half
        precision elements (Korthikanti et al. 2022, with an attention core that keeps no
        score matrix, as ``scaled_dot_product_attention``'s kernels), its ``10`` divided by
        ``tp`` too under sequence parallelism; with full recompute only the layer's input,
        plus one layer's full set while it is recomputed. The last stage adds the logits."""
        m = self.global_microbatches // max(1, self.dp_for(pp, tp, cp))
        in_flight = min(pp - stage, max(1, m))
        tokens = self.tokens_per_microbatch / cp
        scale = self.act_bytes / 2.0
        per_layer = tokens * self.d_model * ((10.0 / tp if self.sp else 10.0) + 24.0 / tp) * scale
        layers = self.stage_layers(pp, stage)
        if recompute == "full":
            held = in_flight * layers * tokens * self.d_model * self.act_bytes + per_layer
        else:
            held = in_flight * layers * per_layer
        if stage == pp - 1 and not self.simulated:
            held += tokens * self.vocab / tp * 4.0  # fp32 logits of the microbatch in hand
        return held

    def dp_for(self, pp: int, tp: int, cp: int) -> int:
        """The data-parallel size a layout of the run's world would have."""
        return self.world // (pp * tp * cp)


def shape_of(meta: dict[str, Any]) -> Shape:
    """The :class:`Shape` of a run's run.json, or :class:`PlanError` (one line)."""
    model = meta.get("model") or {}
    cfg = model.get("config") or {}
    mesh = meta.get("mesh") or {}
    world = int(meta.get("world_size") or 0)
    dp = int(mesh.get("dp") or 1)
    if not cfg:
        raise PlanError("run.json holds no model configuration (model.config): nothing to plan")
    try:
        if "n_layer" in cfg:
            return _trainer_shape(meta, cfg, dp, world)
        if "layers" in cfg:
            return _synth_shape(meta, cfg, dp, world)
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"run.json model.config is incomplete: {e}") from None
    raise PlanError("run.json model.config is neither the trainer's nor the simulator's")


def _trainer_shape(meta: dict[str, Any], cfg: dict[str, Any], dp: int, world: int) -> Shape:
    train = meta.get("train") or {}
    parallel = meta.get("parallel") or {}
    if int(cfg.get("experts") or 0):
        raise PlanError("a mixture of experts is not modelled by the planner (dense GPTs only)")
    d = int(cfg["d_model"])
    return Shape(
        n_layer=int(cfg["n_layer"]),
        d_model=d,
        n_head=int(cfg["n_head"]),
        seq_len=int(cfg["seq_len"]),
        vocab=int(cfg["vocab_size"]),
        ff=int(cfg.get("d_ff") or 0) or 4 * d,
        micro_batch=int(train.get("micro_batch_size", 2)),
        microbatches=int(train.get("microbatches", 4)),
        dp=dp,
        act_bytes=2 if train.get("dtype") == "bf16" else 4,
        bias=bool(cfg.get("bias", True)),
        layernorm=cfg.get("norm", "layernorm") == "layernorm",
        learned_pos=cfg.get("pos") == "learned",
        sp=bool(parallel.get("sp", False)),
        recompute=str(train.get("recompute", "none")),
        bucket_bytes=int(float(train.get("bucket_size_mb", 4.0)) * 2**20),
        optimizer=str(train.get("optimizer", "adamw")),
        world=world,
    )


def _synth_shape(meta: dict[str, Any], cfg: dict[str, Any], dp: int, world: int) -> Shape:
    if int(cfg.get("experts") or 0) or int(cfg.get("vpp") or 1) > 1:
        raise PlanError("a simulated run with experts or model chunks (--vpp) is not modelled")
    h = int(cfg["hidden"])
    return Shape(
        n_layer=int(cfg["layers"]),
        d_model=h,
        n_head=max(1, h // 128),
        seq_len=int(cfg["seq_len"]),
        vocab=int(cfg["vocab"]),
        ff=4 * h,
        micro_batch=int(cfg["micro_batch"]),
        microbatches=int(cfg["microbatches"]),
        dp=dp,
        act_bytes=2,
        bias=False,
        simulated=True,
        sp=bool((meta.get("tracer") or {}).get("sp", True)),
        world=world,
    )
