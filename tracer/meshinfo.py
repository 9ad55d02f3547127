"""The mesh and the process groups of a script, learnt from the calls that make them.

A script that calls ``tracer.attach`` without a mesh (or runs under ``tracer.run``) still builds
one: a ``DeviceMesh`` (torchtitan, FSDP2 + tensor parallel), a DDP model on the default group,
groups of its own from ``new_group`` (Megatron names them with ``group_desc``). At attach,
:class:`GroupWatch` wraps the functions that make them, so that the run directory says what the
run was:

* every ``new_group``/``split_group`` call is made on every rank, with the ranks of every group,
  so rank 0 learns every group's members, named after its ``group_desc`` (a DeviceMesh dimension
  ``mesh_tp`` is ``tp``; a flattened ``mesh_dp_shard_cp`` is ``dp_shard_cp``); groups without a
  description keep torch's numbered name (``group3``), unique in the run;
* the first named DeviceMesh that spans the world gives ``run.json``'s ``mesh`` and every rank's
  coordinates: ``pp``, ``tp`` and ``cp`` are the dimensions of those names, ``dp`` all the others
  together (``dp_replicate`` x ``dp_shard``, in the mesh's order). A dimension that is the whole
  world is the default group, which then takes that dimension's name;
* a DDP model on the default group names it ``dp``.

Rank 0 rewrites ``run.json`` (``mesh``, ``groups``, ``coords``) at the next flush when something
changed, only for a run the tracer started itself (a launcher's run.json is its own).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from tracer.rundir import AXES

if TYPE_CHECKING:
    from tracer.core import Tracer
    from tracer.parts import RecorderPart

log = logging.getLogger(__name__)


def group_name(desc: str) -> str | None:
    """The name of a group with description ``desc`` (None: no useful description)."""
    if not desc or desc == "undefined":
        return None
    if desc == "default_pg":
        return None
    if desc.startswith("mesh_") and desc != "mesh_default":
        return desc[len("mesh_") :]
    return desc


def mesh_axes(dim_names: tuple[str, ...], shape: tuple[int, ...]) -> dict[str, int]:
    """``{"dp", "pp", "tp", "cp"}`` sizes of a named world mesh (``dp``: the other dims)."""
    sizes = dict.fromkeys(AXES, 1)
    for name, n in zip(dim_names, shape, strict=True):
        sizes[name if name in ("pp", "tp", "cp") else "dp"] *= int(n)
    return sizes


def mesh_coords(dim_names: tuple[str, ...], index: tuple[int, ...], shape: tuple[int, ...]):
    """A rank's ``{"dp", "pp", "tp", "cp"}`` from its index in a named world mesh."""
    coords = dict.fromkeys(AXES, 0)
    for name, i, n in zip(dim_names, index, shape, strict=True):
        axis = name if name in ("pp", "tp", "cp") else "dp"
        coords[axis] = coords[axis] * int(n) + int(i) if axis == "dp" else int(i)
    return coords


class GroupWatch:
    """Wraps the group- and mesh-making functions for one attached tracer."""

    def __init__(self, tr: Tracer, recorder: RecorderPart) -> None:
        self.tr = tr
        self.recorder = recorder
        self.groups: list[dict[str, Any]] = []
        self._keys: set[tuple[str, tuple[int, ...]]] = set()
        self.mesh: dict[str, int] | None = None
        self.all_coords: list[list[int]] | None = None
        self._dirty = False
        self._lock = threading.Lock()
        self._patched: list[tuple[Any, str, Any, Any]] = []

    # -- installing ---------------------------------------------------------------------------
    def install(self, world_name: str) -> None:
        """Record the world group as ``world_name`` and wrap ``new_group``, ``split_group``,
        ``DeviceMesh.__init__`` and DDP's ``__init__`` (those this torch has)."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.add(world_name, range(self.tr.world))
        modules = [dist, c10d]
        try:
            import torch.distributed.device_mesh as dm

            modules.append(dm)
            mesh_cls = getattr(dm, "DeviceMesh", None)
            if isinstance(mesh_cls, type):
                self._patch(mesh_cls, "__init__", self._mesh_init)
        except ImportError:
            pass
        for name, make in (("new_group", self._new_group), ("split_group", self._split_group)):
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            wrapper = make(fn)
            for module in modules:
                if getattr(module, name, None) is fn:
                    self._patched.append((module, name, fn, wrapper))
                    setattr(module, name, wrapper)
        try:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self._patch(DDP, "__init__", self._ddp_init)
        except ImportError:
            pass

    def _patch(self, owner: Any, name: str, make: Any) -> None:
        fn = getattr(owner, name)
        wrapper = make(fn)
        self._patched.append((owner, name, fn, wrapper))
        setattr(owner, name, wrapper)

    def uninstall(self) -> None:
        """Put back the functions :meth:`install` replaced, where its wrapper is still in place."""
        for owner, name, fn, wrapper in self._patched:
            if getattr(owner, name, None) is wrapper:
                setattr(owner, name, fn)
        self._patched = []

    # -- what was learnt ----------------------------------------------------------------------
    def add(self, name: str, ranks: Any) -> None:
        """Record group ``name`` of ``ranks``, once; a new one marks run.json for rewriting."""
        key = (name, tuple(int(r) for r in ranks))
        with self._lock:
            if key in self._keys:
                return
            self._keys.add(key)
            self.groups.append({"name": name, "ranks": list(key[1])})
            self._dirty = True

    def _safely(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # learning names must never break making groups
            log.info("megascope: group or mesh not recorded: %s", exc)

    def _new_group(self, fn: Any) -> Any:
        import torch.distributed.distributed_c10d as c10d

        def new_group(*args: Any, **kwargs: Any) -> Any:
            count = getattr(c10d._world, "group_count", None)
            pg = fn(*args, **kwargs)
            self._safely(self._learn_new_group, args, kwargs, pg, count)
            return pg

        new_group.__wrapped__ = fn  # type: ignore[attr-defined]
        return new_group

    def _learn_new_group(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], pg: Any, count: Any
    ) -> None:
        import torch.distributed.distributed_c10d as c10d

        ranks = kwargs.get("ranks", args[0] if args else None)
        ranks = list(range(self.tr.world)) if ranks is None else sorted(int(r) for r in ranks)
        name = group_name(str(kwargs.get("group_desc") or ""))
        if name is None:
            if isinstance(pg, c10d.ProcessGroup):
                name = f"group{c10d._world.pg_names.get(pg, '?')}"
            elif count is not None and not kwargs.get("use_local_synchronization"):
                name = f"group{count}"  # torch numbers groups alike on every rank
            else:
                return
        self.add(name, ranks)

    def _split_group(self, fn: Any) -> Any:
        def split_group(*args: Any, **kwargs: Any) -> Any:
            pg = fn(*args, **kwargs)
            self._safely(self._learn_split, args, kwargs)
            return pg

        split_group.__wrapped__ = fn  # type: ignore[attr-defined]
        return split_group

    def _learn_split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = group_name(str(kwargs.get("group_desc") or ""))
        split = kwargs.get("split_ranks", args[1] if len(args) > 1 else None)
        if name is None or not split:
            return
        for ranks in split:
            self.add(name, sorted(int(r) for r in ranks))

    def _mesh_init(self, fn: Any) -> Any:
        def __init__(mesh: Any, *args: Any, **kwargs: Any) -> None:
            fn(mesh, *args, **kwargs)
            self._safely(self._learn_mesh, mesh)

        __init__.__wrapped__ = fn  # type: ignore[attr-defined]
        return __init__

    def _learn_mesh(self, mesh: Any) -> None:
        import torch.distributed.distributed_c10d as c10d

        names = tuple(mesh.mesh_dim_names or ())
        tensor = mesh.mesh
        if self.mesh is not None or not names or int(tensor.numel()) != self.tr.world:
            return
        shape = tuple(int(n) for n in tensor.shape)
        coords: list[list[int]] = [[0, 0, 0, 0] for _ in range(self.tr.world)]
        flat = tensor.flatten().tolist()
        for pos, rank in enumerate(flat):
            index, rest = [], pos
            for n in reversed(shape):
                index.append(rest % n)
                rest //= n
            c = mesh_coords(names, tuple(reversed(index)), shape)
            coords[int(rank)] = [c[a] for a in AXES]
        with self._lock:
            self.mesh = mesh_axes(names, shape)
            self.all_coords = coords
            self._dirty = True
        tr = self.tr
        tr.mesh = dict(self.mesh)
        tr.coords = dict(zip(AXES, coords[tr.rank], strict=True))
        default = c10d._get_default_group()
        for dim, name in enumerate(names):
            if shape[dim] == tr.world:  # this dimension is the default group
                self.recorder.name_group(default, name)
                self.add(name, range(tr.world))
        tr.buffers["topology"].add(tr.topology_row())

    def _ddp_init(self, fn: Any) -> Any:
        def __init__(ddp: Any, *args: Any, **kwargs: Any) -> None:
            self._safely(self._learn_ddp, args, kwargs)
            fn(ddp, *args, **kwargs)

        __init__.__wrapped__ = fn  # type: ignore[attr-defined]
        return __init__

    def _learn_ddp(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import torch.distributed.distributed_c10d as c10d

        pg = kwargs.get("process_group")
        default = c10d._get_default_group()
        if (pg is None or pg is default) and self.recorder.named(default) is None:
            self.recorder.name_group(default, "dp")
            self.add("dp", range(self.tr.world))

    # -- run.json -----------------------------------------------------------------------------
    def write_meta(self) -> None:
        """Rank 0, when something changed: mesh, groups and coordinates into run.json."""
        tr = self.tr
        if not (self._dirty and tr.owns_run_json and tr.writing):
            return
        with self._lock:
            self._dirty = False
            changes: dict[str, Any] = {"groups": [dict(g) for g in self.groups]}
            if self.mesh is not None:
                changes["mesh"] = dict(self.mesh)
                changes["coords"] = [list(c) for c in self.all_coords or []]
        tr.update_run_json(**changes)
