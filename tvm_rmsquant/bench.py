"""GPU benchmark: our kernels against the peers a user would pick instead.

Every provider's output is checked against the reference (tvm_rmsquant.checks) before
it is timed, with the timing kit tuning uses too (``tvm_rmsquant.timing``): CUDA-graph
replays, inputs rotated past the L2, and the floor of the bytes the op must move (x, r, w
read once; q, scales, r written once) over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Dict, List, Optional

import torch

from . import reference
from .checks import compare, random_inputs
from .serving import choose
from .spec import VariantSpec
from .timing import copy_ceiling, cpu_oracle, input_copies, kernel_call, op_bytes, point_inputs, time_call


@dataclasses.dataclass
class Point:
    provider: str
    spec: str
    rows: int
    hidden: int
    microseconds: float
    gigabytes_per_second: float
    ceiling_fraction: float
    agreement: str
    #: The bundle variant that ran (ours only): the grid's static-K spec, or the dynamic-K
    #: kernel where the bundle has no static one for that K, as in a model.
    kernel: str = ""


class OursProvider:
    """The kernel a model gets for the point (``serving.choose``: static K, else dynamic K)."""

    name = "ours"

    def __init__(self, bundle):
        self.bundle = bundle

    def variant(self, spec: VariantSpec) -> Optional[VariantSpec]:
        return choose(spec, self.bundle)[0]

    def supports(self, spec: VariantSpec) -> bool:
        return self.variant(spec) is not None

    def prepare(self, spec: VariantSpec, inputs: Dict, eps: float):
        variant = self.variant(spec)
        return kernel_call(self.bundle.function(variant.name), variant, inputs, eps)


class ReferenceProvider:
    """Unfused eager torch: the reference itself."""

    name = "torch_eager"

    def supports(self, spec: VariantSpec) -> bool:
        return True

    def prepare(self, spec: VariantSpec, inputs: Dict, eps: float):
        outputs = []

        def call():
            outputs[:] = reference.rms_norm_group_quant(inputs["x"], inputs["weight"], eps, spec, inputs["residual"], inputs["scale_ub"])

        call()
        return call, tuple(outputs)


def measure(provider, spec: VariantSpec, rows: int, hidden: int, ceiling: float, eps: float = 1e-6) -> Optional[Point]:
    """Check ``provider`` on fresh random inputs, then time it. None if it is unsupported."""
    if not provider.supports(spec):
        return None
    kernel = provider.variant(spec).name if isinstance(provider, OursProvider) else ""
    inputs = point_inputs(spec, rows, hidden)
    try:
        call, outputs = provider.prepare(spec, inputs, eps)
        call()
        torch.cuda.synchronize()
    except Exception as error:  # a peer that cannot run this shape is reported, not fatal
        return Point(provider.name, spec.name, rows, hidden, float("nan"), float("nan"), float("nan"), f"ERROR: {type(error).__name__}: {str(error)[:200]}", kernel)
    moved = op_bytes(spec, rows, hidden)
    verdict = _verdict(provider, spec, outputs, inputs, eps, cpu_oracle(spec, rows, hidden, eps))
    if verdict.startswith("WRONG") and not getattr(provider, "timed_when_wrong", False):
        # A wrong provider is reported, never timed.
        return Point(provider.name, spec.name, rows, hidden, float("nan"), float("nan"), float("nan"), verdict, kernel)
    copies = input_copies(moved)
    input_sets = [inputs] + [point_inputs(spec, rows, hidden, copy) for copy in range(1, copies)]
    try:
        makers = [provider.prepare(spec, one, eps)[0] for one in input_sets]
        microseconds = time_call(lambda i: makers[i], copies, rows)
    except Exception as error:  # e.g. a peer that cannot be captured in a CUDA graph
        return Point(provider.name, spec.name, rows, hidden, float("nan"), float("nan"), float("nan"), f"ERROR: timing: {type(error).__name__}: {str(error)[:200]}", kernel)
    rate = moved / (microseconds * 1e-6) / 1e9
    return Point(provider.name, spec.name, rows, hidden, microseconds, rate, rate / ceiling, verdict, kernel)


def _verdict(provider, spec: VariantSpec, outputs, inputs: Dict, eps: float, oracle) -> str:
    """The provider's outputs judged against the reference's ``oracle``: the contract's bar, or
    the provider's own ``judge`` where its numerics differ; "WRONG: ..." when they fail."""
    if hasattr(provider, "judge"):
        return provider.judge(spec, outputs, inputs, eps, oracle)
    agreement = compare(spec, outputs, oracle, inputs["x"].shape[1])
    return agreement.describe() if agreement.passed else "WRONG: " + agreement.describe()


def write_results(points: List[Point], ceiling: float, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[field.name for field in dataclasses.fields(Point)])
        writer.writeheader()
        for point in points:
            writer.writerow(dataclasses.asdict(point))
    (out / "bench.json").write_text(json.dumps({"copy_ceiling_gbps": ceiling, "points": [dataclasses.asdict(p) for p in points]}, indent=1))


class CompiledReferenceProvider:
    """torch.compile of the reference, compiled fresh per shape (dynamic=False, fullgraph=True).

    ``emulate_precision_casts`` asks Inductor to keep the contract's bf16 round trips, as a
    careful user would; torch 2.11 on CUDA folds them anyway (docs/perf.md), so its codes
    differ from the reference. It is still the peer the speed bar names: it is timed, and
    its point keeps the ``WRONG`` verdict next to the time (tables print "wrong codes").
    """

    name = "torch_compile"
    timed_when_wrong = True

    def supports(self, spec: VariantSpec) -> bool:
        return True

    def prepare(self, spec: VariantSpec, inputs: Dict, eps: float):
        key = (spec, tuple(inputs["x"].shape))
        if getattr(self, "_key", None) != key:
            torch._dynamo.reset()
            self._compiled = torch.compile(
                reference.rms_norm_group_quant, dynamic=False, fullgraph=True, options={"emulate_precision_casts": True}
            )
            self._key = key
        compiled, outputs = self._compiled, []

        def call():
            outputs[:] = compiled(inputs["x"], inputs["weight"], eps, spec, inputs["residual"], inputs["scale_ub"])

        call()
        return call, tuple(outputs)


class TritonProvider:
    """The fused Triton kernel a user would write instead (tvm_rmsquant.triton_peer)."""

    name = "triton"

    def supports(self, spec: VariantSpec) -> bool:
        return not spec.scale.packed and not spec.scale_ub

    def prepare(self, spec: VariantSpec, inputs: Dict, eps: float):
        from .triton_peer import rms_norm_group_quant_triton

        x = inputs["x"]
        rows, hidden = x.shape
        q = torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device=x.device)
        scales = reference.empty_scales(spec, rows, hidden, x.device)
        residual_out = torch.empty_like(x) if spec.residual else None

        def call():
            rms_norm_group_quant_triton(spec, x, inputs["weight"], eps, q, scales, inputs["residual"], residual_out)

        return call, (q, scales, residual_out)


class FlashInferProvider:
    """FlashInfer 0.7.2.post1's ``fused_add_rmsnorm_fp8_block_quant``, the kernel a user would
    pick instead (built by ``scripts/build_flashinfer_peer.py``; the library from
    $TVM_RMSQUANT_FLASHINFER_PEER, else ``artifacts/flashinfer_peer/flashinfer_peer.so``).

    It does one job of ours: residual, G = 128, column-major TMA-padded fp32 scales, 16-bit
    input. Its numerics differ from the contract (one bf16 rounding, an approximate rsqrt, an
    absmax floor of 1e-4, a reciprocal multiply), so it is judged by ``judge``: its dequantized
    output against an fp64 reference, next to the contract's own error, and its residual. It
    also writes a bf16 normed copy of the row, which its GB/s (on our op's bytes) does not count:
    the verdict says how many bytes that is. PDL is on, as FlashInfer's default on sm_90+.
    """

    name = "flashinfer"
    #: The dequantized error may be at most this multiple of the contract's own.
    ERROR_RATIO = 1.5

    def __init__(self, library: Optional[str] = None, pdl: bool = True):
        import os

        import tvm_ffi

        path = Path(library or os.environ.get("TVM_RMSQUANT_FLASHINFER_PEER") or "artifacts/flashinfer_peer/flashinfer_peer.so")
        if not path.is_file():
            raise ValueError(f"the flashinfer provider needs {path}: build it with python3 scripts/build_flashinfer_peer.py "
                             f"(or point $TVM_RMSQUANT_FLASHINFER_PEER at it)")
        self.function = tvm_ffi.load_module(str(path))["flashinfer_fused_add_rmsnorm_fp8_block_quant"]
        self.pdl = pdl

    def supports(self, spec: VariantSpec) -> bool:
        return (spec.residual and spec.layout == "col" and spec.format == "fp32" and spec.group == 128 and spec.dtype in ("bf16", "fp16")
                and not spec.scale_ub and spec.norm and spec.weight_dtype is None)

    def prepare(self, spec: VariantSpec, inputs: Dict, eps: float):
        x, weight = inputs["x"], inputs["weight"]
        rows, hidden = x.shape
        q = torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device=x.device)
        block_scale = torch.empty(hidden // 128, -(-rows // 4) * 4, dtype=torch.float32, device=x.device)
        normed = torch.empty_like(x)
        residual = inputs["residual"].clone()  # updated in place, call after call, as in a model
        # [K/128, round_up(M, 4)] row-major is our col layout transposed: [M, K/128], strides (1, round_up(M, 4)).
        return (lambda: self.function(q, block_scale, normed, x, residual, weight, eps, self.pdl)), (q, block_scale.t()[:rows], residual)

    def judge(self, spec: VariantSpec, outputs, inputs: Dict, eps: float, oracle) -> str:
        return dequantized_verdict(spec, outputs, inputs, eps, oracle, self.ERROR_RATIO, extra_bytes=inputs["x"].numel() * spec.itemsize)


def dequantized_verdict(spec: VariantSpec, outputs, inputs: Dict, eps: float, oracle, ratio: float, extra_bytes: int = 0) -> str:
    """A peer with other numerics judged by what its codes mean: "WRONG: ..." unless its
    dequantized output's error against an fp64 reference is within ``ratio`` of the contract's
    own (``oracle``, the reference outputs) and its residual is x + r rounded to the dtype, bit for bit."""
    q, scales, residual = (None if tensor is None else tensor.cpu() for tensor in outputs)
    x, w = inputs["x"].cpu().double(), inputs["weight"].cpu().double()
    h = x if residual is None else x + inputs["residual"].cpu().double()
    y = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w
    rows, hidden = y.shape

    def error(codes, per_group):
        dequantized = codes.double().view(rows, -1, spec.group) * per_group.double().unsqueeze(-1)
        return float((dequantized.view(rows, hidden) - y).norm() / y.norm())

    theirs = error(q.float(), reference.scales_fp32(scales, spec, hidden, rows))
    ours = error(oracle[0].float(), reference.scales_fp32(oracle[1], spec, hidden, rows))
    residual_ok = residual is None or torch.equal(residual, (inputs["x"].cpu().float() + inputs["residual"].cpu().float()).to(residual.dtype))
    verdict = f"dequantized error {theirs:.4g} (the contract's {ours:.4g})"
    verdict += "" if residual is None else f", residual {'identical' if residual_ok else 'DIFFERS'}"
    verdict += f", +{extra_bytes / 1e6:.3g} MB written besides" if extra_bytes else ""
    passed = math.isfinite(theirs) and theirs <= ratio * ours and residual_ok
    return verdict if passed else "WRONG: " + verdict


PROVIDERS = {
    "ours": OursProvider,
    "torch_eager": lambda bundle: ReferenceProvider(),
    "torch_compile": lambda bundle: CompiledReferenceProvider(),
    "triton": lambda bundle: TritonProvider(),
    "flashinfer": lambda bundle: FlashInferProvider(),
}


def providers_by_name(names, bundle):
    unknown = [name for name in names if name not in PROVIDERS]
    if unknown:
        raise ValueError(f"providers {unknown} are unknown; known: {sorted(PROVIDERS)}")
    return [PROVIDERS[name](bundle) for name in names]


def markdown_table(points: List[Point], ceiling: float) -> str:
    """One row per (spec, M): each provider's median us and % of the copy ceiling."""
    providers = list(dict.fromkeys(point.provider for point in points))
    rows: Dict = {}
    for point in points:
        rows.setdefault((point.spec, point.rows), {})[point.provider] = point
    lines = [f"Copy ceiling (read+write, measured in this run): {ceiling:.0f} GB/s", "",
             "| variant | M | " + " | ".join(f"{p} us (% ceil)" for p in providers) + " |",
             "|---|---:|" + "---:|" * len(providers)]
    for (spec, m), by_provider in rows.items():
        cells = []
        for provider in providers:
            point = by_provider.get(provider)
            if point is None:
                cells.append("n/a")
            elif math.isnan(point.microseconds):
                cells.append(point.agreement.split(":")[0])
            else:
                wrong = ", wrong codes" if point.agreement.startswith("WRONG") else ""
                cells.append(f"{point.microseconds:.2f} ({100 * point.ceiling_fraction:.0f}%{wrong})")
        lines.append(f"| {spec} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(points: List[Point], ceiling: float, path: Path) -> None:
    """Achieved GB/s against M, one panel per (K, variant family), one line per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = list(dict.fromkeys(point.spec for point in points))
    columns = 4
    figure, axes = plt.subplots(-(-len(specs) // columns), columns, figsize=(5 * columns, 3.2 * -(-len(specs) // columns)), squeeze=False)
    for axis, spec in zip(axes.flat, specs):
        for provider in dict.fromkeys(point.provider for point in points):
            mine = [p for p in points if p.spec == spec and p.provider == provider and p.gigabytes_per_second == p.gigabytes_per_second]
            axis.plot([p.rows for p in mine], [p.gigabytes_per_second for p in mine], marker="o", markersize=3, label=provider)
        axis.axhline(ceiling, color="k", linestyle="--", linewidth=0.8, label="copy ceiling")
        axis.set_xscale("log", base=2)
        axis.set_title(spec, fontsize=8)
        axis.set_xlabel("M")
        axis.set_ylabel("GB/s")
    for axis in list(axes.flat)[len(specs):]:
        axis.axis("off")
    axes.flat[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def host_overhead(bundle, calls: int = 2000, rounds: int = 7) -> Dict[str, float]:
    """Eager per-call host time (us) of our op's entry points against torch.add on the same tensors.

    M = 1, so the GPU finishes each call before the host issues the next: the loop is
    host-bound and its time per call is the host overhead. Rounds alternate between the
    candidates, so that clock drift hits all of them alike; each figure is a median.
    """
    import time

    from . import ops
    from .dispatch import select

    spec = VariantSpec("bf16", 4096, 128, True, "col", "fp32")
    kernel = select(4096, torch.bfloat16, residual=True, consumer="deepgemm_sm90", bundle=bundle.root)
    inputs = random_inputs(spec, 1, 4096, seed=0, device="cuda")
    x, w, r = inputs["x"], inputs["weight"], inputs["residual"]
    entry = bundle.function(spec.name)
    python_path = ops.Kernel(spec, entry, checks_natively=True)
    want = reference.rms_norm_group_quant(x.cpu(), w.cpu(), 1e-6, spec, r.cpu())
    for name, path in (("BoundKernel", kernel), ("ops.Kernel", python_path)):
        residual = r.clone()
        q, scales = path(x, w, 1e-6, residual=residual)
        agreement = compare(spec, (q, scales, residual), want, 4096)
        if not agreement.passed:
            raise RuntimeError(f"host_overhead: {name} is wrong, not timed: {agreement.describe()}")
    candidates = {
        f"BoundKernel (select; {'C++' if kernel.kernel is None else 'Python'} op path)": lambda: kernel(x, w, 1e-6, residual=r),
        "torch.ops fused_add_rms_norm_group_quant": lambda: torch.ops.tvm_rmsquant.fused_add_rms_norm_group_quant(x, r, w, 1e-6, spec.name),
        "Python path: ops.Kernel (2 torch.empty + tvm-ffi)": lambda: python_path(x, w, 1e-6, residual=r),
        "torch.ops rms_norm_per_block_quant (out=, Python)": lambda: torch.ops.tvm_rmsquant.rms_norm_per_block_quant(q, x, w, scales, 1e-6, None, r, 128, True),
        "tvm-ffi entry point (outputs given)": lambda: entry(x, r, w, 1e-6, q, scales, r),
        "torch.add": lambda: torch.add(x, r),
        # What the Python path spends its time on, for the record:
        "part: torch.empty_like (q)": lambda: torch.empty_like(x, dtype=torch.float8_e4m3fn),
        "part: torch.empty_strided (col scales)": lambda: torch.empty_strided((1, 32), (1, 4), device=x.device),
    }
    samples: Dict[str, List[float]] = {name: [] for name in candidates}
    for name, call in candidates.items():
        for _ in range(200):
            call()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, call in candidates.items():
            start = time.perf_counter()
            for _ in range(calls):
                call()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in samples.items()}


#: Providers too slow to run at every M (torch.compile compiles afresh per shape).
SLOW_PROVIDERS = ("torch_eager", "torch_compile")


#: The grid's default group size: G = 128, the group of block-FP8 checkpoints (DeepSeek-V3,
#: Qwen3 FP8); ``--group 32`` benchmarks the MX and Blackwell DeepGEMM layouts.
GRID_GROUP = 128


def grid_spec(dtype: str, hidden: Optional[int], residual: bool, layout: str, fmt: str, weight_dtype: Optional[str],
              group: int = GRID_GROUP) -> VariantSpec:
    """The spec of one grid point; the CLI checks ``--formats`` with it before any GPU work."""
    return VariantSpec(dtype, hidden, group, residual, layout, fmt, weight_dtype=weight_dtype)


def grid_specs(dtype: str, hidden_sizes, formats, group: int = GRID_GROUP) -> List[VariantSpec]:
    """The grid's specs in the order they run: per K, without then with a residual, per format."""
    return [grid_spec(dtype, hidden, residual, layout, fmt, weight_dtype, group)
            for hidden in hidden_sizes for residual in (False, True) for layout, fmt, weight_dtype in formats]


def missing_kernels(bundle, specs) -> List[str]:
    """The grid specs no kernel of ``bundle`` runs, neither static nor dynamic K (a model would
    run the torch reference there): ``ours`` cannot be timed at them."""
    ours = OursProvider(bundle)
    return [spec.name for spec in specs if not ours.supports(spec)]


def run_benchmark(bundle, dtype, hidden_sizes, rows_list, formats, providers, out: Path, slow_rows=None,
                  group: int = GRID_GROUP) -> List[Point]:
    """Every point of the grid for each of ``providers`` (``providers_by_name``); ``formats``
    are (layout, format, weight_dtype) triples, weight_dtype None or "fp32"."""
    ceiling = copy_ceiling()
    print(f"copy ceiling (read+write): {ceiling:.0f} GB/s", flush=True)
    points = []
    for spec in grid_specs(dtype, hidden_sizes, formats, group):
        for rows in rows_list:
            for provider in providers:
                if slow_rows is not None and provider.name in SLOW_PROVIDERS and rows not in slow_rows:
                    continue
                point = measure(provider, spec, rows, spec.hidden, ceiling)
                if point is not None:
                    points.append(point)
                    wrong = "  " + point.agreement if point.agreement.startswith(("WRONG", "ERROR")) else ""
                    ran = f"  ({point.kernel})" if point.kernel not in ("", spec.name) else ""
                    print(f"{point.provider:13s} {spec.name:34s} M={rows:6d} {point.microseconds:9.2f} us {point.gigabytes_per_second:7.0f} GB/s {100 * point.ceiling_fraction:5.1f}%{wrong}{ran}", flush=True)
    write_results(points, ceiling, out)
    (out / "bench.md").write_text(markdown_table(points, ceiling))
    plot(points, ceiling, out / "bench.png")
    return points


#: Pairs per CUDA graph in ``gemm_pairs``: what a model's layers chain.
PAIRS = 20


def pair_spec(hidden: int) -> VariantSpec:
    """The op of ``gemm_pairs`` at K = ``hidden``: FlashInfer's job (residual, col fp32, G = 128)."""
    return VariantSpec("bf16", hidden, 128, True, "col", "fp32")


def gemm_pairs(bundle, providers, hidden_sizes, rows_list, eps: float = 1e-6) -> List[Dict]:
    """Microseconds per (bf16 GEMM [M, K] x [K, K] -> the op on its output) pair, from CUDA-graph
    replays of ``PAIRS`` pairs: where PDL lets the op launch while the GEMM ends. The op is
    ``pair_spec``'s; each provider is checked on the GEMM's real output before it is timed, and
    a wrong one is reported, not timed."""
    rows_out = []
    for hidden in hidden_sizes:
        spec = pair_spec(hidden)
        for rows in rows_list:
            generator = torch.Generator(device="cuda").manual_seed(rows + hidden)
            a = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
            w = (torch.randn(hidden, hidden, device="cuda", generator=generator) / math.sqrt(hidden)).bfloat16()
            for provider in providers:
                if not provider.supports(spec):
                    continue
                inputs = point_inputs(spec, rows, hidden)
                inputs["x"] = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")  # the GEMM writes it
                residual_before = inputs["residual"].clone()
                call, outputs = provider.prepare(spec, inputs, eps)

                def pair(call=call, out=inputs["x"]):
                    torch.matmul(a, w, out=out)
                    call()

                pair()
                torch.cuda.synchronize()
                oracle = reference.rms_norm_group_quant(inputs["x"].cpu(), inputs["weight"].cpu(), eps, spec, residual_before.cpu())
                verdict = _verdict(provider, spec, outputs, dict(inputs, residual=residual_before), eps, oracle)
                microseconds = float("nan") if verdict.startswith("WRONG") else time_call(lambda _: pair, 1, rows, per_graph=PAIRS)
                rows_out.append({"provider": provider.name, "spec": spec.name, "rows": rows, "us_per_pair": microseconds, "agreement": verdict})
                print(f"pair {provider.name:11s} {spec.name:34s} M={rows:6d} {microseconds:9.2f} us/pair" + ("  " + verdict if verdict.startswith("WRONG") else ""), flush=True)
    return rows_out
