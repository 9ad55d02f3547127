"""The scenarios of bench/accuracy.py: one fault at a place and a level on a mesh, simulated
(synth) or, with --real, trained by megascope train; each with the fault spec it injects."""

from __future__ import annotations

import functools
import os
import random
import sys
import tempfile
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from analyzer.synth import SynthConfig, synthesize  # noqa: E402
from tracer.rundir import mesh_groups  # noqa: E402

# fault kind -> finding kind
EXPECTED = {
    "slow_rank": "straggler",
    "slow_link": "slow_link",
    "hang": "hang",
    "crash": "crash",
    "pause": "transient_stall",
    "slow_data": "data_stall",
    "hot_expert": "load_imbalance",
    "seq_skew": "load_imbalance",
}
ALARM_KINDS = ("straggler", "slow_link", "hang", "crash", "load_imbalance")
WORK_KINDS = ("hot_expert", "seq_skew")  # the work given (scenarios of work_scenarios)
WORK_LEVELS = (1.1, 1.25, 2.0)
# mixture-of-experts meshes: (mesh, experts, ep)
MOE_MESHES = (
    ({"dp": 4, "pp": 2, "tp": 1, "cp": 1}, 8, 4),
    ({"dp": 4, "pp": 1, "tp": 2, "cp": 1}, 4, 2),
)
MESHES = ({"dp": 2, "pp": 2, "tp": 2, "cp": 1}, {"dp": 4, "pp": 2, "tp": 2, "cp": 1})


@functools.cache
def healthy_step_ms(mesh_items: tuple[tuple[str, int], ...]) -> float:
    """The median step of a healthy run of this mesh, so that a stall of level L adds
    (L - 1) of a real step (a short simulation, cached per mesh)."""
    with tempfile.TemporaryDirectory(prefix="megascope-accuracy-") as out:
        cfg = SynthConfig(mesh=dict(mesh_items), steps=6, microbatches=4, seed=1)
        return float(synthesize(cfg, out)["summary"]["median_step_ms"])


PRICED = ("slow_rank", "slow_link")  # faults whose findings the what-if prices (SPEC §3)


LEVELS = (1.05, 1.1, 1.25, 2.0)  # severities: x slower (or 1 + the share of a step a stall adds)


@dataclass
class Scenario:
    name: str
    mesh: dict[str, int]
    specs: list[str]
    severity: str  # the level's name ("1.05x" ...) or "healthy"
    steps: int = 24
    seed: int = 0
    real: bool = False
    experts: int = 0
    ep: int = 1


def world(mesh: dict[str, int]) -> int:
    return mesh["dp"] * mesh["pp"] * mesh["tp"] * mesh["cp"]


def random_link(rng: random.Random, mesh: dict[str, int]) -> tuple[int, int]:
    """Two ranks that really talk: neighbours in a tp, dp or pp group."""
    group = rng.choice(mesh_groups(mesh))
    ranks = group["ranks"]
    i = rng.randrange(len(ranks) - 1)
    return (ranks[i], ranks[i + 1]) if group["name"] == "pp" else tuple(rng.sample(ranks, 2))


def level_name(level: float) -> str:
    return f"{level:g}x"


def fault_spec(
    kind: str, level: float, rng: random.Random, mesh: dict[str, int], steps: int
) -> str:
    """One spec of ``kind`` at a random place. ``level`` is the slow-down: the compute or
    transfer factor, or for stalls 1 + the share of a step the stall adds (2.0: a whole step)."""
    r = rng.randrange(world(mesh))
    if kind == "slow_rank":
        return f"slow_rank:rank={r},factor={level:g}"
    if kind == "slow_link":
        a, b = random_link(rng, mesh)
        return f"slow_link:ranks={a}-{b},factor={level * (2 if level >= 2 else 1):g}"
    if kind in ("hang", "crash"):
        return f"{kind}:rank={r},step={rng.randrange(steps // 3, steps - 2)}"
    ms = healthy_step_ms(tuple(sorted(mesh.items()))) * (level - 1.0)
    if kind == "pause":
        return f"pause:rank={r},every={rng.choice([3, 5])},ms={ms:.1f}"
    return f"slow_data:rank={r},ms={ms:.1f}"


def scenarios(quick: bool, seed: int) -> list[Scenario]:
    """Every kind at every level and ``places`` random places, pairs of faults, healthy runs."""
    rng = random.Random(seed)
    out: list[Scenario] = []
    places = 1 if quick else 2
    for kind in EXPECTED:
        if kind in WORK_KINDS:
            continue
        if kind in ("hang", "crash"):
            grid = [2.0] * (places + 1)
        else:
            grid = [lvl for lvl in LEVELS for _ in range(places)]
        for n, level in enumerate(grid):
            mesh = MESHES[n % len(MESHES)]
            spec = fault_spec(kind, level, rng, mesh, 24)
            name = kind if kind in ("hang", "crash") else f"{kind}/{level_name(level)}"
            out.append(Scenario(name, mesh, [spec], level_name(level), seed=rng.randrange(1 << 30)))
    pairs = [("slow_rank", "slow_link"), ("slow_rank", "slow_data"), ("slow_link", "pause")]
    for a, b in pairs[: 2 if quick else 3]:
        mesh = MESHES[1]
        specs = [fault_spec(a, 1.25, rng, mesh, 24), fault_spec(b, 1.25, rng, mesh, 24)]
        out.append(Scenario(f"{a}+{b}", mesh, specs, "1.25x", seed=rng.randrange(1 << 30)))
    for i in range(3 if quick else 6):
        out.append(Scenario("healthy", MESHES[i % 2], [], "healthy", seed=rng.randrange(1 << 30)))
    return out + work_scenarios(quick, seed)


def hot_share(level: float, experts: int, ep: int) -> float | None:
    """The hot_expert share that makes its holders compute ``level`` times as long (module
    docstring): held share H = x / ep of the assignments, of which S to the hot expert and the
    rest spread evenly, (1 - S) (h - 1) / (E - 1) to its h - 1 companions. None: out of reach
    (x above ep: the holders would need more than every assignment)."""
    x = (3.0 * level - 1.0) / 2.0
    held = x / ep
    a = (experts // ep - 1) / (experts - 1)
    share = (held - a) / (1.0 - a)
    return share if 0.0 < share <= 1.0 and held <= 1.0 else None


def work_scenarios(quick: bool, seed: int) -> list[Scenario]:
    """hot_expert and seq_skew at 1.1-2x, a slow rank of an MoE run, healthy MoE runs."""
    rng = random.Random(seed + 13)
    out: list[Scenario] = []
    places = 1 if quick else 2
    for n, level in enumerate(lvl for lvl in WORK_LEVELS for _ in range(places)):
        name = level_name(level)
        moe = [m for m in MOE_MESHES if hot_share(level, m[1], m[2]) is not None]
        mesh, experts, ep = moe[n % len(moe)]
        share = hot_share(level, experts, ep)
        spec = f"hot_expert:expert={rng.randrange(experts)},share={share:.4f}"
        out.append(Scenario(f"hot_expert/{name}", mesh, [spec], name, seed=rng.randrange(1 << 30),
                            experts=experts, ep=ep))  # fmt: skip
        mesh = MESHES[n % len(MESHES)]
        spec = f"seq_skew:rank={rng.randrange(world(mesh))},factor={level:g}"
        out.append(Scenario(f"seq_skew/{name}", mesh, [spec], name, seed=rng.randrange(1 << 30)))
        mesh, experts, ep = MOE_MESHES[n % len(MOE_MESHES)]
        spec = f"slow_rank:rank={rng.randrange(world(mesh))},factor={level:g}"
        out.append(Scenario(f"slow_rank(moe)/{name}", mesh, [spec], name,
                            seed=rng.randrange(1 << 30), experts=experts, ep=ep))  # fmt: skip
    for i in range(2 if quick else 4):
        mesh, experts, ep = MOE_MESHES[i % len(MOE_MESHES)]
        out.append(Scenario("healthy(moe)", mesh, [], "healthy", seed=rng.randrange(1 << 30),
                            experts=experts, ep=ep))  # fmt: skip
    return out


def real_scenarios() -> list[Scenario]:
    mesh = {"dp": 2, "pp": 1, "tp": 2, "cp": 1}
    return [
        Scenario(
            "real slow_rank", mesh, ["slow_rank:rank=1,factor=1.6"], "2x", steps=20, real=True
        ),
        Scenario("real slow_data", mesh, ["slow_data:rank=2,ms=60"], "2x", steps=20, real=True),
        Scenario("real hang", mesh, ["hang:rank=3,step=8"], "2x", steps=20, real=True),
        Scenario("healthy", mesh, [], "healthy", steps=20, real=True),
    ]
