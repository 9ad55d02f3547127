"""The mesh of an attached script, read from what its process groups carried.

A script traced with ``torchrun -m tracer.run`` tells the tracer its mesh only through a named
DeviceMesh that spans the world (tracer.meshinfo: run.json's ``mesh`` and ``coords``, the best
evidence, used as they are). Without one, run.json says ``dp = world``: a pipeline written with
``torch.distributed.pipelining`` over ``new_group`` calls of its own, or over an unnamed
DeviceMesh, would read as pure data parallel, and its stages be compared as peers. Here the
layout is read from the ``collectives`` rows instead (:func:`infer`, on the tables of
``analyzer/sql/mesh/``):

* **pipeline stages**: the pairs of ranks that send and receive to each other. Each connected
  set of them is one pipeline, which must be a chain (a stage talks to the one before and the
  one after), all of one length ``pp``. A chain is ordered by what flows first: a microbatch's
  activations go forward before its gradients come back, so on most steps a stage's first
  send to the next comes before the next's first send back (a tie keeps the lower rank first);
* **tensor parallelism**: the groups whose reductions (all_reduce, reduce_scatter) run inside
  the forward, at least :data:`TP_SHARE` of them, all of one size and each inside one stage.
  FSDP's all-gathers in the forward are not reductions, and its reduce-scatters run in the
  backward: FSDP reads as data parallel;
* **replicas**: the rest, ``dp = world / (pp * tp)``; the groups that reduce outside the
  forward (gradients) corroborate it and are named.

A rank's coordinates: ``pp`` its place in its chain, ``tp`` its place in its tensor group (by
rank), ``dp`` the index of its pipeline (or of its tensor group within its stage) by lowest rank.

Where the groups do not tell, :func:`infer` says why in one line instead of guessing: send/recv
pairs that are not chains of one length (a ring: an interleaved schedule, or context
parallelism's ring), ranks outside every pipeline, tensor groups of mixed sizes or across
stages, or no send/recv and no reduction at all. The run then keeps ``dp = world`` for its
peers, and the report says that the layout was not told.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from analyzer.duck import EXACT_MAX_RANKS, sql_text
from analyzer.runview import RunView
from tracer.rundir import AXES

REDUCTIONS = frozenset({"all_reduce", "reduce_scatter"})
P2P = frozenset({"send", "recv"})
TP_SHARE = 0.2  # of a group's reductions inside the forward, where the group is tensor parallel
STEPS = 4  # the steps read, from the first: enough to see every group at work, and cheap


@dataclass(frozen=True)
class Traffic:
    """The calls of one rank on one channel: a group's collectives of one op (``peer`` -1), or
    its sends or receives with one peer; ``n_forward`` of them inside a forward span."""

    rank: int
    group: str
    peer: int
    op: str
    n: int
    n_forward: int = 0


@dataclass(frozen=True)
class FirstSend:
    """When ``rank`` first sent to ``peer`` in ``step``."""

    rank: int
    peer: int
    step: int
    first_ns: int


@dataclass(frozen=True)
class Layout:
    """What the process groups tell: ``mesh`` and every rank's ``[dp, pp, tp, cp]``, or, where
    they do not tell (``told`` False), why, in ``why``. ``evidence`` says what was read."""

    told: bool
    mesh: dict[str, int] = field(default_factory=dict)
    coords: list[list[int]] = field(default_factory=list)
    evidence: str = ""
    why: str = ""

    def text(self) -> str:
        """``dp=2 x pp=2`` (the axes over 1; ``dp=1`` for one rank)."""
        return " x ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "dp=1"


def _unknown(why: str) -> Layout:
    return Layout(told=False, why=why)


def _ranks(ranks: Iterable[int], limit: int = 6) -> str:
    r = sorted(ranks)
    return ", ".join(map(str, r[:limit])) + (f" (+{len(r) - limit})" if len(r) > limit else "")


def pipelines(world: int, traffic: list[Traffic], first: list[FirstSend]) -> list[list[int]] | str:
    """The pipelines (each its ranks in stage order) that send/recv pairs make; ``[]`` when no
    rank sends or receives; a one-line reason when they are not chains of one length."""
    adj: dict[int, set[int]] = defaultdict(set)
    for t in traffic:
        if t.op in P2P and t.peer >= 0 and t.peer != t.rank and t.n > 0:
            adj[t.rank].add(t.peer)
            adj[t.peer].add(t.rank)
    if not adj:
        return []
    outside = sorted(set(range(world)) - set(adj))
    if outside:
        return (
            f"ranks {_ranks(adj)} send and receive, ranks {_ranks(outside)} do not: "
            "no pipeline covers every rank"
        )
    chains: list[list[int]] = []
    seen: set[int] = set()
    for start in sorted(adj):
        if start in seen:
            continue
        comp, todo = set(), [start]
        while todo:
            r = todo.pop()
            if r not in comp:
                comp.add(r)
                todo.extend(adj[r] - comp)
        seen |= comp
        ends = sorted(r for r in comp if len(adj[r]) == 1)
        edges = sum(len(adj[r]) for r in comp) // 2
        if len(ends) != 2 or edges != len(comp) - 1 or any(len(adj[r]) > 2 for r in comp):
            shape = "a ring" if all(len(adj[r]) == 2 for r in comp) else "not a chain"
            return (
                f"the send/recv pairs among ranks {_ranks(comp)} form {shape} (an interleaved "
                "pipeline, or context parallelism's ring): no stage order"
            )
        chain, prev = [ends[0]], -1
        while len(chain) < len(comp):
            nxt = next(p for p in adj[chain[-1]] if p != prev)
            prev = chain[-1]
            chain.append(nxt)
        chains.append(_oriented(chain, first))
    sizes = sorted({len(c) for c in chains})
    if len(sizes) > 1:
        return f"pipelines of different lengths ({', '.join(map(str, sizes))} ranks)"
    return sorted(chains, key=min)


def _oriented(chain: list[int], first: list[FirstSend]) -> list[int]:
    """``chain`` with its first stage first: per step and link, the side that sent first sends
    forward; the majority of those votes wins (a tie keeps the lower rank's end first)."""
    when: dict[tuple[int, int, int], int] = {(f.rank, f.peer, f.step): f.first_ns for f in first}
    votes = 0
    for a, b in zip(chain, chain[1:], strict=False):
        steps = {s for (r, p, s) in when if (r, p) in ((a, b), (b, a))}
        for s in steps:
            ab, ba = when.get((a, b, s)), when.get((b, a, s))
            if ab is not None and ba is not None and ab != ba:
                votes += 1 if ab < ba else -1
    if votes < 0 or (votes == 0 and chain[-1] < chain[0]):
        return chain[::-1]
    return chain


def _group_members(traffic: list[Traffic], groups: list[dict[str, Any]]) -> dict[tuple, list[int]]:
    """Each collective channel (group name, its members) used, from run.json's groups where
    they list the rank's group, else from the ranks that used the name."""
    listed: dict[str, list[list[int]]] = defaultdict(list)
    for g in groups:
        if isinstance(g, dict) and g.get("ranks"):
            listed[str(g["name"])].append(sorted(int(r) for r in g["ranks"]))
    users: dict[str, set[int]] = defaultdict(set)
    for t in traffic:
        if t.peer < 0:
            users[t.group].add(t.rank)
    out: dict[tuple, list[int]] = {}
    for name, ranks in users.items():
        for r in ranks:
            members = next((m for m in listed.get(name, []) if r in m), None)
            members = members or sorted(ranks)
            out[(name, tuple(members))] = members
    return out


def _reducing(
    traffic: list[Traffic], groups: list[dict[str, Any]]
) -> tuple[list[list[int]], set[str]]:
    """The groups that reduce inside the forward (tensor parallel, each its members) and the
    names of those that reduce outside it (gradients)."""
    red: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for t in traffic:
        if t.peer < 0 and t.op in REDUCTIONS:
            red[(t.group, t.rank)][0] += t.n
            red[(t.group, t.rank)][1] += t.n_forward
    tp_groups: list[list[int]] = []
    grad_names: set[str] = set()
    for (name, _), ranks in _group_members(traffic, groups).items():
        counts = [red.get((name, r), [0, 0]) for r in ranks]
        n, inside = sum(c[0] for c in counts), sum(c[1] for c in counts)
        if n == 0 or len(ranks) < 2:
            continue
        if inside >= TP_SHARE * n:
            tp_groups.append(ranks)
        else:
            grad_names.add(name)
    return tp_groups, grad_names


def _tp_size(world: int, tp_groups: list[list[int]], stage: dict[int, int]) -> int | str:
    """The tp size the tensor groups make (1 without any), or why they make none."""
    if not tp_groups:
        return 1
    sizes = sorted({len(g) for g in tp_groups})
    across = [g for g in tp_groups if len({stage[r] for r in g}) > 1]
    covered = sorted({r for g in tp_groups for r in g})
    if len(sizes) > 1:
        return f"groups reduce inside the forward at sizes {sizes}: no one tp size"
    if across:
        return (
            f"a group that reduces inside the forward spans pipeline stages "
            f"(ranks {_ranks(across[0])}): not tensor parallel"
        )
    if covered != list(range(world)):
        return f"groups reduce inside the forward on ranks {_ranks(covered)} only: no tp axis"
    return sizes[0]


def _coords(
    world: int, chains: list[list[int]], tp_groups: list[list[int]], tp: int
) -> list[list[int]]:
    """Every rank's ``[dp, pp, tp, cp]`` (the module docstring)."""
    coords = [[r, 0, 0, 0] for r in range(world)]
    for i, chain in enumerate(chains):
        for s, r in enumerate(chain):
            coords[r][:2] = [i, s]
    if tp > 1:
        stages = max(len(chains[0]), 1) if chains else 1
        for s in range(stages):
            mine = sorted((g for g in tp_groups if coords[g[0]][1] == s), key=min)
            for d, g in enumerate(mine):
                for t_i, r in enumerate(sorted(g)):
                    coords[r][0], coords[r][2] = d, t_i
    return coords


def infer(
    world: int, traffic: list[Traffic], first: list[FirstSend], groups: list[dict[str, Any]]
) -> Layout:
    """The layout the tables tell (see the module docstring), or why they do not."""
    if world < 2:
        return Layout(told=True, mesh=dict.fromkeys(AXES, 1), coords=[[0, 0, 0, 0]] * world)
    chains = pipelines(world, traffic, first)
    if isinstance(chains, str):
        return _unknown(chains)
    stage = dict.fromkeys(range(world), 0)
    for chain in chains:
        stage.update({r: s for s, r in enumerate(chain)})
    pp = len(chains[0]) if chains else 1
    tp_groups, grad_names = _reducing(traffic, groups)
    tp = _tp_size(world, tp_groups, stage)
    if isinstance(tp, str):
        return _unknown(tp)
    if not chains and tp == 1 and not grad_names:
        return _unknown(
            "its process groups carry no send/recv and no reduction: the layout is not told"
        )
    told = []
    if chains:
        shown = "; ".join(" > ".join(map(str, c)) for c in chains[:4])
        told.append(f"pipeline stages from send/recv ({shown})")
    if tp > 1:
        told.append(f"tp from {len(tp_groups)} groups reducing inside the forward")
    if grad_names:
        told.append(f"replicas reduce on {', '.join(sorted(grad_names)[:4])}")
    mesh = {"dp": world // (pp * tp), "pp": pp, "tp": tp, "cp": 1}
    coords = _coords(world, chains, tp_groups, tp)
    return Layout(told=True, mesh=mesh, coords=coords, evidence="; ".join(told))


def attached(meta: dict[str, Any]) -> bool:
    """Whether run.json is an attached script's whose mesh the tracer did not learn: written by
    the tracer (its settings, no model, not imported), ``dp = world`` and no coordinates."""
    world = int(meta.get("world_size") or 0)
    mesh = meta.get("mesh") or {}
    plain = int(mesh.get("dp", 1) or 1) == world and all(
        int(mesh.get(k, 1) or 1) == 1 for k in ("pp", "tp", "cp")
    )
    return (
        bool(meta.get("tracer"))
        and not meta.get("model")
        and not meta.get("import")
        and not meta.get("coords")
        and plain
        and 2 <= world <= EXACT_MAX_RANKS
    )


def read(run: RunView) -> Layout:
    """The layout of ``run``'s tables (:func:`infer` over ``analyzer/sql/mesh/``), read from
    :data:`STEPS` steps from its first (every step runs the same program)."""
    lo = run.execute("select min(step) as lo from digest_collectives where step >= 0")["lo"][0]
    lo = 0 if lo is None or lo != lo else int(lo)
    window = {"lo": lo, "hi": lo + STEPS - 1}
    traffic = [
        Traffic(int(r.rank), str(r.group), int(r.peer), str(r.op), int(r.n), int(r.n_forward))
        for r in run.execute(sql_text("mesh/traffic"), window).itertuples(index=False)
    ]
    first = [
        FirstSend(int(r.rank), int(r.peer), int(r.step), int(r.first_ns))
        for r in run.execute(sql_text("mesh/first_sends"), window).itertuples(index=False)
    ]
    return infer(run.world_size, traffic, first, list(run.meta.get("groups") or []))


def apply(run: RunView) -> Layout | None:
    """For an :func:`attached` run, read its layout and put it in ``run.meta`` (in memory:
    ``mesh`` and ``coords`` where told, and ``layout``, what :func:`note` reports); None
    for any other run."""
    if not attached(run.meta):
        return None
    layout = read(run)
    if layout.told:
        run.meta["mesh"] = dict(layout.mesh)
        run.meta["coords"] = [list(c) for c in layout.coords]
    run.meta["layout"] = {
        "source": "process groups",
        "told": layout.told,
        "mesh": layout.text() if layout.told else None,
        "evidence": layout.evidence,
        "why": layout.why,
    }
    return layout


def note(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The report's note on a layout read from the process groups: where they did not tell,
    or where they told more than data parallelism (None otherwise)."""
    layout = meta.get("layout")
    if not isinstance(layout, dict) or layout.get("source") != "process groups":
        return None
    if not layout.get("told"):
        message = f"layout unknown, ranks compared as data-parallel peers: {layout.get('why')}"
    elif layout.get("mesh", "").startswith("dp=") and " x " not in layout.get("mesh", ""):
        return None
    else:
        message = f"layout {layout['mesh']} read from the process groups: {layout['evidence']}"
    return {"kind": "layout", "ranks": [], "message": message, "evidence": dict(layout)}
