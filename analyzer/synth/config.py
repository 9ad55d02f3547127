"""What the simulator is asked to simulate: the mesh, the model, the faults, the extras.

Everything here is plain data plus validation. Text given on the command line (``--mesh``,
the extra conditions) is parsed by the functions below, which raise :class:`SynthError` with a
one-line message; the CLI turns that into ``megascope: error: ...`` and exit status 2.

The model is a GPT whose layers are split evenly over the pipeline stages: dense, or with a
mixture of experts in every MLP (``experts``, sharded over expert-parallel groups of ``ep``
data-parallel ranks; :mod:`analyzer.synth.work` models its work). Compute times
follow from its FLOPs at a fixed fraction of the device's peak; message sizes follow from its
activations and parameters, so that a bigger mesh behaves like a bigger job rather than a
rescaled small one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from tracer.faults import Fault, FaultSpecError, parse_faults

AXES = ("dp", "pp", "tp", "cp")
GPUS_PER_HOST = 8  # analyzer.synth.cluster's too
DETAILS = ("fine", "coarse")


class SynthError(ValueError):
    """Unusable simulator input; the message is one line."""


@dataclass(frozen=True)
class ModelShape:
    """The simulated GPT and the hardware it runs on (defaults: a 7B-class model on H100s)."""

    layers_per_stage: int = 4
    hidden: int = 4096
    seq_len: int = 4096
    vocab: int = 50304
    micro_batch: int = 1
    peak_flops: float = 989e12  # dense bf16 per GPU
    efficiency: float = 0.45  # achieved fraction of peak inside compute spans
    nvlink_busbw: float = 150e9  # bytes/s, members on one host
    network_busbw: float = 22e9  # bytes/s, members on several hosts
    latency_s: float = 12e-6  # per collective or transfer
    data_ms: float = 2.0  # loading one step's batch
    optimizer_ms_per_gparam: float = 30.0  # optimizer span per 1e9 parameters of a shard
    grad_buckets: int = 2  # DP reduce-scatter / all-gather buckets per step

    def layer_params(self) -> float:
        """Parameters of one transformer layer: ``12 * hidden^2`` (attention and MLP weights)."""
        return 12.0 * self.hidden * self.hidden

    def params(self, pp: int) -> float:
        """Parameters of the model over ``pp`` stages: its layers plus the input and output
        embeddings."""
        return self.layer_params() * self.layers_per_stage * pp + 2.0 * self.vocab * self.hidden

    def flops_per_token(self, pp: int) -> float:
        """6 N per token for forward + backward (the usual dense estimate)."""
        return 6.0 * self.params(pp)


@dataclass(frozen=True)
class Extras:
    """Conditions beyond SPEC §5 that other detectors look for (all off by default)."""

    imbalance: tuple[tuple[int, float], ...] = ()  # (stage, compute factor)
    throttle: tuple[tuple[int, float, int], ...] = ()  # (rank, factor, from step)
    regression: float = 1.0  # step time drifts up to this factor by the last step
    # lognormal sigma of a per-(dp rank, step) factor on the forward and backward compute of
    # every rank of that dp rank (all its microbatches, stages, tp and cp ranks): the uneven
    # work of a step's batches, as with sequences of varying length; 0: off
    work_imbalance: float = 0.0


@dataclass(frozen=True)
class HwClassRange:
    """A hardware class of ``synth --hw-classes``: ranks ``first``..``last`` (both included)
    run on hardware ``name`` whose compute takes ``speed`` times as long (1.0: the reference)."""

    name: str
    first: int
    last: int
    speed: float


@dataclass(frozen=True)
class SynthConfig:
    """One simulated run (``megascope synth``): the mesh, steps and microbatches, the faults, the
    noise, and the model and hardware."""

    mesh: dict[str, int]
    steps: int
    microbatches: int
    faults: tuple[Fault, ...] = ()
    seed: int = 0
    noise: float = 0.02  # lognormal sigma of compute times
    rank_spread: float = 0.004  # lognormal sigma of a rank's lasting speed (healthy variation)
    sp: bool = True  # sequence parallel: all_gather + reduce_scatter instead of all_reduce
    detail: str = "fine"  # fine: TP collectives per layer; coarse: one per forward/backward
    vpp: int = 1  # model chunks per stage: > 1 runs Megatron's interleaved 1F1B schedule
    hang_timeout_s: float = 120.0
    flush_steps: int = 10  # a crashed rank loses the rows of its unflushed steps
    model: ModelShape = field(default_factory=ModelShape)
    extras: Extras = field(default_factory=Extras)
    # mixture of experts: ``experts`` per MLP (0: dense), over expert-parallel groups of ``ep``
    # data-parallel ranks (dp index d: group d // ep, ep index d % ep, holding experts
    # [ep_index * experts / ep, (ep_index + 1) * experts / ep))
    experts: int = 0
    ep: int = 1
    hosts: tuple[str, ...] = ()  # host names, 8 ranks on each in rank order (): node0, node1...
    hw_classes: tuple[HwClassRange, ...] = ()  # --hw-classes: ranks outside them have no class

    @property
    def world_size(self) -> int:
        """dp x pp x tp x cp."""
        return self.mesh["dp"] * self.mesh["pp"] * self.mesh["tp"] * self.mesh["cp"]


def parse_hosts(text: str, world: int) -> tuple[str, ...]:
    """``h1,h2,...`` or ``@FILE`` (names split by commas, spaces or lines; ``#`` comments):
    the hosts that ranks are placed on, 8 per host in rank order."""
    names = text
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as f:
                names = "\n".join(line.split("#")[0] for line in f)
        except OSError as e:
            raise SynthError(f"--hosts {text}: {e.strerror or e}") from None
    hosts = tuple(h for h in re.split(r"[\s,]+", names) if h)
    if len(set(hosts)) != len(hosts):
        raise SynthError(f"--hosts {text!r}: a host is named twice")
    need = -(-world // GPUS_PER_HOST)
    if len(hosts) < need:
        raise SynthError(
            f"--hosts {text!r}: {len(hosts)} hosts for {world} ranks "
            f"({GPUS_PER_HOST} per host: {need} needed)"
        )
    return hosts


def parse_hw_classes(text: str, world: int) -> tuple[HwClassRange, ...]:
    """``NAME:FIRST-LAST:SPEED,...`` (``h200:0-6143:1.0,h100:6144-12287:1.15``): the hardware
    class of each range of ranks and its time factor; ranges may not overlap."""
    what = f"--hw-classes {text!r}"
    out: list[HwClassRange] = []
    for item in (s.strip() for s in text.split(",")):
        m = re.fullmatch(r"([A-Za-z0-9._-]+):(\d+)-(\d+):([0-9.eE+-]+)", item)
        if not m:
            raise SynthError(f"{what}: {item!r} is not NAME:FIRST-LAST:SPEED")
        first, last = int(m.group(2)), int(m.group(3))
        if first > last or last >= world:
            raise SynthError(f"{what}: ranks {first}-{last} are not a range of the {world} ranks")
        speed = _num(m.group(4), what, "SPEED", float, 0.0)
        if speed <= 0:
            raise SynthError(f"{what}: SPEED must be > 0, got {m.group(4)}")
        out.append(HwClassRange(m.group(1), first, last, speed))
    out.sort(key=lambda c: c.first)
    for a, b in zip(out, out[1:], strict=False):
        if b.first <= a.last:
            raise SynthError(f"{what}: {a.name} and {b.name} overlap")
    return tuple(out)


def parse_mesh(text: str) -> dict[str, int]:
    """``dp=64,pp=8,tp=8`` (cp optional) as ``{"dp":64,"pp":8,"tp":8,"cp":1}``."""
    mesh = dict.fromkeys(AXES, 1)
    seen: set[str] = set()
    if not text or not text.strip():
        raise SynthError("--mesh is empty (expected e.g. dp=2,pp=2,tp=2)")
    for item in text.split(","):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or key not in AXES:
            raise SynthError(
                f"--mesh {text!r}: {item.strip()!r} is not AXIS=N with AXIS in dp,pp,tp,cp"
            )
        if key in seen:
            raise SynthError(f"--mesh {text!r}: {key} given twice")
        seen.add(key)
        if not value.isdigit() or int(value) < 1:
            raise SynthError(f"--mesh {text!r}: {key}={value!r} must be a positive integer")
        mesh[key] = int(value)
    world = mesh["dp"] * mesh["pp"] * mesh["tp"] * mesh["cp"]
    if world > 131072:
        raise SynthError(f"--mesh {text!r}: {world} ranks is more than the simulator's 131072")
    return mesh


TRAIN_ONLY = (
    "slow_ckpt",
    "slow_offload",
)  # faults of the trainer's own machinery, which synth does not model


def parse_injections(specs: Sequence[str], world_size: int) -> tuple[Fault, ...]:
    """The ``--inject`` specs as faults, checked against ``world_size``; a fault of the trainer's
    own machinery (:data:`TRAIN_ONLY`) is refused."""
    try:
        faults = tuple(parse_faults(specs, world_size))
    except FaultSpecError as e:
        raise SynthError(f"--inject {e}") from None
    for f in faults:
        if f.kind in TRAIN_ONLY:
            raise SynthError(
                f"--inject {f.kind}: a real run's fault (megascope train), not simulated"
            )
    return faults


def _pairs(text: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in text.split(","):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or not key or not value:
            raise SynthError(f"{what} {text!r}: {item.strip()!r} is not key=value")
        out[key] = value
    return out


def _num(text: str, what: str, key: str, cast: type, minimum: float) -> float:
    try:
        value = cast(text)
    except ValueError:
        raise SynthError(f"{what}: {key}={text!r} is not a number") from None
    if not value >= minimum:
        raise SynthError(f"{what}: {key} must be >= {minimum:g}, got {text}")
    return value


def parse_imbalance(text: str, pp: int) -> tuple[int, float]:
    """``stage=S,factor=F``: every compute span of pipeline stage S takes F times as long."""
    kv = _pairs(text, "--imbalance")
    if set(kv) != {"stage", "factor"}:
        raise SynthError(f"--imbalance {text!r}: expected stage=S,factor=F")
    stage = int(_num(kv["stage"], f"--imbalance {text!r}", "stage", int, 0))
    if stage >= pp:
        raise SynthError(f"--imbalance {text!r}: stage {stage} is outside the {pp} stages")
    return stage, _num(kv["factor"], f"--imbalance {text!r}", "factor", float, 1.0)


def parse_throttle(text: str, world_size: int) -> tuple[int, float, int]:
    """``rank=R,factor=F[,step=S]``: from step S the GPU of rank R clocks F times lower."""
    kv = _pairs(text, "--throttle")
    if not {"rank", "factor"} <= set(kv) <= {"rank", "factor", "step"}:
        raise SynthError(f"--throttle {text!r}: expected rank=R,factor=F[,step=S]")
    what = f"--throttle {text!r}"
    rank = int(_num(kv["rank"], what, "rank", int, 0))
    if rank >= world_size:
        raise SynthError(f"{what}: rank {rank} is outside the world of {world_size} ranks")
    step = int(_num(kv.get("step", "0"), what, "step", int, 0))
    return rank, _num(kv["factor"], what, "factor", float, 1.0), step


def validate(cfg: SynthConfig) -> None:
    """Reject configurations the model cannot run, with one line."""
    if cfg.steps < 1:
        raise SynthError(f"--steps must be >= 1, got {cfg.steps}")
    if cfg.microbatches < 1:
        raise SynthError(f"--microbatches must be >= 1, got {cfg.microbatches}")
    if not 0.0 <= cfg.noise <= 1.0:
        raise SynthError(f"--noise must be within 0..1, got {cfg.noise}")
    if cfg.detail not in DETAILS:
        raise SynthError(f"--detail must be one of {', '.join(DETAILS)}, got {cfg.detail!r}")
    if cfg.extras.regression < 1.0:
        raise SynthError(f"--regression must be >= 1, got {cfg.extras.regression}")
    if not 0.0 <= cfg.extras.work_imbalance <= 1.0:
        raise SynthError(f"--work-imbalance must be within 0..1, got {cfg.extras.work_imbalance}")
    if cfg.vpp < 1:
        raise SynthError(f"--vpp must be >= 1, got {cfg.vpp}")
    _validate_experts(cfg)
    if cfg.vpp > 1:
        pp, m = cfg.mesh["pp"], cfg.microbatches
        if pp < 2:
            raise SynthError(f"--vpp {cfg.vpp} needs a pipeline (pp >= 2), got pp={pp}")
        if m % pp:
            raise SynthError(
                f"--vpp {cfg.vpp}: the interleaved schedule needs microbatches a multiple of "
                f"pp={pp}, got {m}"
            )
        if cfg.model.layers_per_stage % cfg.vpp:
            raise SynthError(
                f"--vpp {cfg.vpp}: layers per stage ({cfg.model.layers_per_stage}) must split "
                "evenly into the model chunks"
            )


def _validate_experts(cfg: SynthConfig) -> None:
    """The mixture of experts' shape, and the faults that need one."""
    dp, e, ep = cfg.mesh["dp"], cfg.experts, cfg.ep
    if e < 0:
        raise SynthError(f"--experts must be >= 0, got {e}")
    if ep < 1:
        raise SynthError(f"--ep must be >= 1, got {ep}")
    if e == 0 and ep > 1:
        raise SynthError(f"--ep {ep} needs --experts (a dense model has no experts to shard)")
    if e and dp % ep:
        raise SynthError(f"--ep {ep} must divide dp={dp} (expert groups are carved from dp)")
    if e and e % ep:
        raise SynthError(f"--ep {ep} must divide --experts {e}")
    for f in cfg.faults:
        if f.kind == "hot_expert" and not e:
            raise SynthError(f"--inject {f.spec}: needs --experts (a dense model has no router)")
        if f.kind == "hot_expert" and f.expert >= e:
            raise SynthError(f"--inject {f.spec}: expert {f.expert} is outside the {e} experts")
