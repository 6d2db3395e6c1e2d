"""The timing kit that the benchmark and tuning share: what to time and how.

Medians of CUDA-event measurements of CUDA-graph replays of many calls, so that launch
gaps and host time do not count; inputs rotate among enough copies to exceed the L2
cache of every target a bundle can hold; the floor is the bytes the op must move over
the device-to-device copy bandwidth measured in the same run. The reference outputs of
a point are computed once, on the CPU, for every caller.
"""

from __future__ import annotations

import functools
import statistics
from typing import Callable, Dict, Optional

import torch

from . import launch, reference
from .checks import random_inputs
from .spec import VariantSpec, scale_geometry
from .target import TARGETS

#: The largest L2 of the targets a bundle can hold: rotated copies exceed it on each of them.
L2_BYTES = max(target.l2_bytes for target in TARGETS.values())
#: Calls per timed graph: GRAPH_CALLS up to M = GRAPH_ROWS, fewer (at least
#: MIN_GRAPH_CALLS) for larger M so that one replay stays near a few milliseconds.
GRAPH_ROWS = 256
GRAPH_CALLS = 100
MIN_GRAPH_CALLS = 10


def op_bytes(spec: VariantSpec, rows: int, hidden: int) -> int:
    """The fewest bytes the op moves: inputs read once, outputs written once."""
    item = spec.itemsize
    shape, _, _, _ = scale_geometry(spec, rows, hidden)
    scale_bytes = shape[0] * shape[1] * spec.scale.element_bytes
    moved = rows * hidden * item + hidden * item + rows * hidden + scale_bytes
    if spec.residual:
        moved += 2 * rows * hidden * item
    return moved


def events_median(run: Callable[[], None], repeats: int) -> float:
    """Median milliseconds of ``run`` over ``repeats`` event-timed calls."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_ceiling(gigabytes: float = 4.0) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    elements = int(gigabytes * 1e9 / 2 / 4)
    source = torch.randn(elements, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    milliseconds = events_median(lambda: target.copy_(source), 20)
    return 2 * source.numel() * 4 / (milliseconds * 1e-3) / 1e9


def time_call(make_call: Callable[[int], Callable[[], None]], copies: int, rows: int, per_graph: Optional[int] = None) -> float:
    """Microseconds per call; ``make_call(i)`` runs on input copy i.

    Every M runs as CUDA-graph replays of back-to-back calls: events around one eager call
    would also count the host's launch time, which the GPU waits out after the start event.
    ``per_graph`` calls to a graph where given, else as many as suit M (``GRAPH_CALLS``).
    """
    calls = [make_call(i) for i in range(copies)]
    for call in calls:
        call()
    torch.cuda.synchronize()
    per_graph = per_graph or max(MIN_GRAPH_CALLS, GRAPH_CALLS * GRAPH_ROWS // max(rows, GRAPH_ROWS))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
        with torch.cuda.graph(graph, stream=stream):
            for index in range(per_graph):
                calls[index % copies]()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return events_median(graph.replay, 20) * 1e3 / per_graph


def kernel_call(function, spec: VariantSpec, inputs: Dict, eps: float):
    """(call, outputs) for one kernel function on ``inputs``: ``call()`` writes ``outputs`` =
    (q, scales, residual_out), allocated here once."""
    x = inputs["x"]
    rows, hidden = x.shape
    q = torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    scales = reference.empty_scales(spec, rows, hidden, x.device)
    residual_out = torch.empty_like(x) if spec.residual else None
    args = launch.kernel_args(spec, x, inputs["weight"], eps, q, scales, inputs["residual"], residual_out, inputs["scale_ub"])
    return (lambda: function(*args)), (q, scales, residual_out)


def point_inputs(spec: VariantSpec, rows: int, hidden: int, copy: int = 0) -> Dict:
    """Input copy ``copy`` of one benchmark point, seeded so that every caller gets the same."""
    return random_inputs(spec, rows, hidden, seed=rows * 7 + hidden + copy, device="cuda")


def input_copies(moved: int) -> int:
    """Input copies to rotate among so that together they exceed the L2 cache (1 to 8)."""
    return max(1, min(8, -(-3 * L2_BYTES // max(moved, 1))))


@functools.lru_cache(maxsize=1)
def cpu_oracle(spec: VariantSpec, rows: int, hidden: int, eps: float):
    """The reference outputs for ``point_inputs(spec, rows, hidden)``, computed on the CPU
    (eager torch on the GPU itself misses the bar there), once per point for all callers."""
    cpu = {key: (value.cpu() if value is not None else None) for key, value in point_inputs(spec, rows, hidden).items()}
    return reference.rms_norm_group_quant(cpu["x"], cpu["weight"], eps, spec, cpu["residual"], cpu["scale_ub"])
