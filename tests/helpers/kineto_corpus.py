"""A corpus of small PyTorch profiler (Kineto) traces in the shapes users really have.

Each :class:`Shape` is a folder of trace files named as the tool that wrote them names them
(``tensorboard_trace_handler``'s ``{worker}.{ms}.pt.trace.json.gz``, ``{model}__{job}``, a
ROCm version in the name, ``rankN``, no number at all) and built like the traces of that tool:
``distributedInfo`` present or absent and written before or after the events, integer
microseconds (older PyTorch) or nanosecond floats relative to ``baseTimeNanoseconds`` (recent
PyTorch), several profiler steps, several streams with overlapping kernels, NCCL kernels under
host annotations that end before the kernel runs, memcpys and memsets, device work launched
before the profiler started (no launch record), CUDA synchronization records, GPU-side copies
of the ``ProfilerStep#N`` annotations, and ROCm/HIP and MTIA events.

The events follow what Kineto writes (``cat``, ``args.stream``, ``args.correlation`` linking a
device event to its runtime launch); the workload is random but seeded, so every shape is the
same on every run. :func:`write_corpus` writes them all under a folder.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

# Kernel names by platform (as the profilers print them).
CUDA_COMPUTE = [
    "volta_sgemm_128x64_nn",
    "ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_stages_64x3_tn",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t"
    "<float, at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::"
    "{lambda(float, float)#1}>, unsigned int, float, 4> >(at::native::ReduceOp<float>)",
    "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>(Params)",
]
HIP_COMPUTE = [
    "Cijk_Ailk_Bljk_SB_MT64x64x16_SN_1LDSB0_APM1_ABV0",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast>(int)",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int)",
]
MTIA_COMPUTE = ["aten::mm", "aten::add", "fused_silu_mul", "aten::layer_norm"]
NCCL = {
    "all_reduce": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "all_gather": "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "reduce_scatter": "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
}
RCCL = "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)"


@dataclass(frozen=True)
class Platform:
    name: str
    compute: tuple[str, ...]
    launch: str  # the runtime call that launches a kernel
    runtime_cat: str
    device_cat: str
    memcpy: tuple[str, str] | None  # (runtime call, device event name)
    memset: tuple[str, str] | None
    nccl: bool = True


CUDA = Platform("cuda", tuple(CUDA_COMPUTE), "cudaLaunchKernel", "cuda_runtime", "kernel",
                ("cudaMemcpyAsync", "Memcpy HtoD (Pageable -> Device)"),
                ("cudaMemsetAsync", "Memset (Device)"))  # fmt: skip
HIP = Platform("hip", tuple(HIP_COMPUTE), "hipLaunchKernel", "cuda_runtime", "kernel",
               ("hipMemcpyWithStream", "Memcpy DtoD (Device -> Device)"),
               ("hipMemsetAsync", "hipMemsetAsync"))  # fmt: skip
MTIA = Platform("mtia", tuple(MTIA_COMPUTE), "runFunction - job_prep_and_submit_for_execution",
                "mtia_runtime", "mtia_ccp_events", None,
                ("runFunction - job_prep_and_submit_for_execution", "dma_memset"), nccl=False)  # fmt: skip


@dataclass
class Workload:
    """What one rank's trace holds (see the module docstring)."""

    seed: int
    platform: Platform = CUDA
    steps: int = 3
    first_step: int = 10
    launches_per_step: int = 60
    ns: bool = False  # nanosecond float timestamps relative to baseTimeNanoseconds
    sub_us: bool = False  # some device events shorter than a microsecond
    pre_window: int = 0  # device events whose launch is not in the trace
    gpu_step_annotations: bool = True
    syncs: bool = False  # CUDA synchronization records
    lag_us: int = 400  # how far the device runs behind the host
    after_last_step: int = 4  # launches after the last step ends (the profiler stopping)


def _ts(value: float, ns: bool) -> float | int:
    """A time as Kineto writes it: integer microseconds, or microseconds with 3 decimals."""
    return round(value, 3) if ns else int(round(value))


def events_of(w: Workload) -> list[dict[str, Any]]:
    """The trace events of one rank."""
    rng = random.Random(w.seed)
    ns = w.ns
    p = w.platform
    pid, tid = 4242, 4242
    t0 = 0.0 if ns else 1_700_000_000_000_000.0
    ev: list[dict[str, Any]] = []
    corr = 1000
    streams = {"compute": 7, "side": 13, "comm": 20}
    free = dict.fromkeys(streams.values(), t0)
    # a first metadata event (Kineto writes process names before the work)
    ev.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
               "ts": _ts(t0, ns), "args": {"name": "python"}})  # fmt: skip

    def dur_of(kind: str) -> float:
        if w.sub_us and rng.random() < 0.25:
            return rng.uniform(0.2, 0.95)
        if kind == "comm":
            return rng.uniform(30, 400)
        if kind == "memory":
            return rng.uniform(1, 20)
        return rng.uniform(2, 150) + (rng.random() if ns else 0)

    def device(name: str, cat: str, stream: int, start: float, dur: float, c: int) -> float:
        args = {"device": 0, "context": 1, "stream": stream, "correlation": c}
        if cat in ("gpu_memcpy", "gpu_memset"):
            args["bytes"] = 4096
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream,
                   "ts": _ts(start, ns), "dur": _ts(dur, ns) if ns else max(1, int(round(dur))),
                   "args": args})  # fmt: skip
        return start + dur

    # Device work launched before the profiler started: in the trace's first milliseconds.
    t = t0 + 50
    for i in range(w.pre_window):
        kind = ("compute", "memory", "memory")[i % 3]
        cat = p.device_cat if kind == "compute" else ("gpu_memcpy" if i % 2 else "gpu_memset")
        name = rng.choice(p.compute) if kind == "compute" else (
            p.memcpy[1] if (p.memcpy and cat == "gpu_memcpy") else (p.memset[1] if p.memset else "Memset (Device)"))  # fmt: skip
        stream = streams["compute"] if kind == "compute" else streams["side"]
        start = max(t, free[stream]) + rng.uniform(0, 3)
        free[stream] = device(name, cat, stream, start, dur_of(kind), 10 + i)
        t += rng.uniform(1, 8)

    host = t0 + 3000.0
    step_spans = []
    for s in range(w.steps):
        step = w.first_step + s
        s_start = host
        first_dev, last_dev = None, None
        for _ in range(w.launches_per_step):
            host += rng.uniform(2, 25)
            roll = rng.random()
            corr += 1
            if p.nccl and roll < 0.12:
                op = rng.choice(list(NCCL))
                name = RCCL if p.name == "hip" else NCCL[op]
                # the host annotation ends right after the launch, long before the kernel runs
                ev.append({"ph": "X", "cat": "user_annotation", "name": f"nccl:{op}", "pid": pid,
                           "tid": tid, "ts": _ts(host, ns), "dur": _ts(12.0, ns),
                           "args": {"Input Dims": [[4096]], "Input type": ["float"]}})  # fmt: skip
                launch, cat, stream, kind = p.launch, p.device_cat, streams["comm"], "comm"
                host += 2
            elif p.memcpy and roll < 0.20:
                launch, name = p.memcpy
                cat, stream, kind = "gpu_memcpy", streams["side"], "memory"
            elif p.memset and roll < 0.25:
                launch, name = p.memset
                cat, stream, kind = "gpu_memset", streams["side"], "memory"
            else:
                launch, name, cat, kind = p.launch, rng.choice(p.compute), p.device_cat, "compute"
                stream = streams["compute"] if rng.random() < 0.8 else streams["side"]
            ev.append({"ph": "X", "cat": p.runtime_cat, "name": launch, "pid": pid, "tid": tid,
                       "ts": _ts(host, ns), "dur": _ts(rng.uniform(3, 9), ns),
                       "args": {"cbid": 211, "correlation": corr}})  # fmt: skip
            start = max(host + w.lag_us * rng.uniform(0.5, 1.5), free[stream] + rng.uniform(0, 4))
            if rng.random() < 0.05:  # the device waits for the host now and then
                start += rng.uniform(50, 600)
            end = device(name, cat, stream, start, dur_of(kind), corr)
            free[stream] = end
            first_dev = start if first_dev is None else min(first_dev, start)
            last_dev = end if last_dev is None else max(last_dev, end)
        if w.syncs:
            corr += 1
            host += 5
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize",
                       "pid": pid, "tid": tid, "ts": _ts(host, ns), "dur": _ts(40.0, ns),
                       "args": {"cbid": 131, "correlation": corr}})  # fmt: skip
            ev.append({"ph": "X", "cat": "cuda_sync", "name": "Stream Sync", "pid": 0,
                       "tid": streams["compute"], "ts": _ts(host + 1, ns), "dur": _ts(38.0, ns),
                       "args": {"cuda_sync_kind": "Stream Sync", "stream": streams["compute"],
                                "correlation": corr, "device": 0, "context": 1}})  # fmt: skip
            corr += 1
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize",
                       "pid": pid, "tid": tid, "ts": _ts(host + 45, ns), "dur": _ts(20.0, ns),
                       "args": {"cbid": 133, "correlation": corr}})  # fmt: skip
            ev.append({"ph": "X", "cat": "cuda_sync", "name": "Event Sync", "pid": 0,
                       "tid": streams["compute"], "ts": _ts(host + 46, ns), "dur": _ts(18.0, ns),
                       "args": {"cuda_sync_kind": "Event Sync", "stream": 4294967295,
                                "correlation": corr, "device": 0, "context": 1}})  # fmt: skip
            host += 70
        host += rng.uniform(5, 30)
        step_spans.append((step, s_start, host, first_dev, last_dev))
    for _ in range(w.after_last_step):  # launches after the last step ended
        host += rng.uniform(3, 10)
        corr += 1
        ev.append({"ph": "X", "cat": p.runtime_cat, "name": p.launch, "pid": pid, "tid": tid,
                   "ts": _ts(host, ns), "dur": _ts(4.0, ns), "args": {"correlation": corr}})  # fmt: skip
        start = max(host + w.lag_us, free[streams["compute"]])
        free[streams["compute"]] = device(rng.choice(p.compute), p.device_cat,
                                          streams["compute"], start, dur_of("compute"), corr)  # fmt: skip
    for step, s0, s1, d0, d1 in step_spans:
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": pid,
                   "tid": tid, "ts": _ts(s0, ns), "dur": _ts(s1 - s0, ns), "args": {}})  # fmt: skip
        if w.gpu_step_annotations and d0 is not None:
            ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{step}",
                       "pid": 0, "tid": streams["compute"], "ts": _ts(d0 - 0.001, ns),
                       "dur": _ts(d1 - d0 + 0.002, ns), "args": {"External id": step}})  # fmt: skip
    # a few host ops, as every trace has
    for i in range(0, len(step_spans) * 5):
        s0 = step_spans[i % len(step_spans)][1] + 1 + i
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": pid, "tid": tid,
                   "ts": _ts(s0, ns), "dur": _ts(1.5, ns), "args": {"External id": i}})  # fmt: skip
    rest = ev[1:]
    rng.shuffle(rest)  # traces are not sorted by time
    return ev[:1] + rest


def trace_of(w: Workload, *, dist: dict[str, Any] | None = None, meta_after: bool = False) -> dict:
    """A whole trace document: metadata (``distributedInfo`` when ``dist``) before the events,
    or after them when ``meta_after`` (some writers do)."""
    meta: dict[str, Any] = {"schemaVersion": 1, "deviceProperties": []}
    if dist is not None:
        meta["distributedInfo"] = dist
    if w.ns:
        meta["baseTimeNanoseconds"] = 1_700_000_000_123_456_789
    events = {"traceEvents": events_of(w)}
    return {**events, **meta} if meta_after else {**meta, **events}


@dataclass
class Shape:
    """A folder of traces, how megascope must number it, and what to compare with HTA."""

    name: str
    files: dict[str, dict]  # file name -> trace document
    ranks: dict[str, int]  # file name -> the rank megascope gives it
    world: int
    why: str = ""
    exact: bool = True  # megascope's breakdown equals HTA's to the microsecond
    options: dict[str, Any] = field(default_factory=dict)


def _dist(rank: int, world: int) -> dict[str, Any]:
    return {"backend": "nccl", "rank": rank, "world_size": world, "pg_count": 1}


def shapes() -> list[Shape]:
    """Every shape of the corpus (the module docstring)."""
    out = []
    w = Workload(seed=1, ns=True, sub_us=True, pre_window=40)
    out.append(Shape("tensorboard_handler", {"gpu-node-7_31337.1732291200123.pt.trace.json.gz":
                     trace_of(w)}, {"gpu-node-7_31337.1732291200123.pt.trace.json.gz": 0}, 1,
                     "tensorboard_trace_handler name, no distributedInfo, ns floats, "
                     "pre-window device events", exact=False))  # fmt: skip
    files = {f"trainer-{r}_{4100 + r}.1732291200{456 + r}.pt.trace.json.gz":
             trace_of(Workload(seed=10 + r, ns=True, lag_us=200 + 150 * r), dist=_dist(r, 4))
             for r in range(2)}  # fmt: skip
    out.append(Shape("tensorboard_handler_ddp", files,
                     {n: r for r, n in enumerate(files)}, 4,
                     "tensorboard_trace_handler names, distributedInfo of 2 of 4 ranks"))  # fmt: skip
    out.append(Shape("job_id", {"resnet50__1000123.json.gz": trace_of(Workload(seed=2))},
                     {"resnet50__1000123.json.gz": 0}, 1,
                     "{model}__{job id} name, integer microseconds"))  # fmt: skip
    out.append(Shape("no_number", {"trace.json": trace_of(Workload(seed=3, steps=1, pre_window=30))},
                     {"trace.json": 0}, 1,
                     "no number in the name, one profiler step, pre-window events kept"))  # fmt: skip
    name = "mi250_minitoy_train_ROCm6_2_kineto.json.gz"
    out.append(Shape("rocm", {name: trace_of(Workload(seed=4, platform=HIP, ns=True))},
                     {name: 0}, 1, "ROCm version in the name, HIP events"))  # fmt: skip
    out.append(Shape("mtia", {"mtia_rank_0.json.gz": trace_of(Workload(seed=5, platform=MTIA))},
                     {"mtia_rank_0.json.gz": 0}, 1, "MTIA device events"))  # fmt: skip
    files = {f"host_{c}.pt.trace.json": trace_of(Workload(seed=20 + r), dist=_dist(r, 3),
                                                 meta_after=True)
             for c, r in (("a", 2), ("b", 0), ("c", 1))}  # fmt: skip
    out.append(Shape("dist_info_after_events", files,
                     {"host_a.pt.trace.json": 2, "host_b.pt.trace.json": 0,
                      "host_c.pt.trace.json": 1}, 3,
                     "distributedInfo written after the events, names without ranks"))  # fmt: skip
    files = {n: trace_of(Workload(seed=30 + r, steps=2)) for r, n in
             ((0, "rank0.json"), (1, "trace_rank_1.json"), (2, "worker-rank-2.json.gz"))}  # fmt: skip
    out.append(Shape("rank_tokens", files, {"rank0.json": 0, "trace_rank_1.json": 1,
                                            "worker-rank-2.json.gz": 2}, 3,
                     "rank3 / rank_3 / rank-3 in the names, no distributedInfo"))  # fmt: skip
    files = {n: trace_of(Workload(seed=40 + i, ns=True)) for i, n in
             enumerate(("node-b.json.gz", "node-a.json.gz"))}  # fmt: skip
    out.append(Shape("unranked_pair", files, {"node-a.json.gz": 0, "node-b.json.gz": 1}, 2,
                     "two traces, no rank anywhere: numbered in name order"))  # fmt: skip
    w = Workload(seed=6, ns=True, sub_us=True, steps=4, syncs=True, pre_window=60, lag_us=900)
    out.append(Shape("multi_stream_steps", {"rank0.pt.trace.json.gz": trace_of(w, dist=_dist(0, 1))},
                     {"rank0.pt.trace.json.gz": 0}, 1,
                     "4 steps, 3 streams overlapping, NCCL under annotations that end first, "
                     "memcpy/memset, syncs, GPU step annotations, sub-us events", exact=False))  # fmt: skip
    w = Workload(seed=6, ns=True, sub_us=True, steps=4, syncs=True, pre_window=60, lag_us=900)
    out.append(Shape("multi_stream_steps_exact_ns",
                     {"rank0.pt.trace.json.gz": trace_of(w, dist=_dist(0, 1))},
                     {"rank0.pt.trace.json.gz": 0}, 1,
                     "the same trace imported with exact nanoseconds, against HTA without rounding",
                     options={"exact_ns": True}))  # fmt: skip
    w = Workload(seed=7, steps=3, gpu_step_annotations=False, pre_window=25)
    out.append(Shape("us_no_gpu_annotations", {"rank_0.json": trace_of(w, dist=_dist(0, 8))},
                     {"rank_0.json": 0}, 8,
                     "integer microseconds, no GPU step copies, 1 of 8 ranks"))  # fmt: skip
    return out


def write_shape(shape: Shape, folder: str) -> str:
    """Write a shape's files into ``folder`` (made); returns it."""
    os.makedirs(folder, exist_ok=True)
    for name, doc in shape.files.items():
        path = os.path.join(folder, name)
        if name.endswith(".gz"):
            with gzip.open(path, "wt", encoding="utf-8") as f:
                json.dump(doc, f)
        else:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(doc, f)
    return folder


def write_corpus(root: str) -> dict[str, tuple[Shape, str]]:
    """Every shape under ``root/<name>``: ``{name: (shape, folder)}``."""
    return {s.name: (s, write_shape(s, os.path.join(root, s.name))) for s in shapes()}
