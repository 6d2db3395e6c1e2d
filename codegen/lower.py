"""Lowering: (spec, rule, knobs) -> scheduled TIR -> one CUDA C++ translation unit.

Plain functions, one step each; TVM is imported where a step needs it, so that the build
can key its caches on the entry points without it. The CUDA target is the build's oldest arch (``target``)
with the ``cuda_host`` host, so ``export_cuda_host`` yields device kernels plus tvm-ffi
host wrappers that nvcc turns into a library needing only libtvm_ffi and libcudart, with
SASS for each of the build's archs. One source serves them all.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from tvm_rmsquant import launch
from tvm_rmsquant.schedules import rule_by_name
from tvm_rmsquant.spec import VariantSpec
from tvm_rmsquant.target import Target, scheduling_target

#: The C++ helper behind every variant's public entry point (takes [M, K] tensors).
ROW_VIEWS = Path(__file__).with_name("row_views.cuh")

#: StorageRewrite reuses the all-reduce result buffer in place when the rms block
#: reads it, letting every thread rewrite a shared value with no barrier (a race).
PASS_CONFIG = {"tirx.disable_storage_rewrite": True}


def cuda_target(archs: Sequence[str]):
    """TVM's target for a library built for ``archs``: the one its schedules are made for."""
    import tvm

    return tvm.target.Target({"kind": "cuda", "arch": scheduling_target(archs).tvm_arch}, host={"kind": "cuda_host"})


def _scheduled(spec: VariantSpec, rule_name: str, knobs: Dict[str, int], target: Target):
    """The PrimFunc of ``spec`` as ``rule_name`` schedules it for ``target`` with ``knobs``."""
    return _scheduled_once(spec, rule_name, tuple(sorted(knobs.items())), target)


@functools.lru_cache(maxsize=128)
def _scheduled_once(spec: VariantSpec, rule_name: str, knobs: Tuple[Tuple[str, int], ...], target: Target):
    """``_scheduled``, remembered: a build worker schedules a kernel for its digest, then lowers
    it (``bundle._lower_library``). 128 holds the largest library of the default build (80 kernels)."""
    from tvm_rmsquant import expr

    return rule_by_name(rule_name).apply(expr.prim_func(spec), target, spec, dict(knobs)).mod["main"]


def schedule(spec: VariantSpec, rule_name: str, knobs: Dict[str, int], symbol: str, target: Target):
    """The scheduled PrimFunc of one variant for ``target``, with the rule's occupancy hint,
    exported under ``grouped_symbol(symbol)``."""
    func = with_min_blocks_per_sm(_scheduled(spec, rule_name, knobs, target), rule_by_name(rule_name).min_blocks_per_sm(knobs))
    return func.with_attr("global_symbol", launch.grouped_symbol(symbol))


def kernel_digest(spec: VariantSpec, rule_name: str, knobs: Dict[str, int], target: Target) -> str:
    """The identity of the kernel that (spec, rule, knobs) makes for ``target`` with this code: a hash of its
    scheduled TIR and knobs. A tuning record carries the digest of the kernel it measured,
    so that a change to the tensor expression or to a rule voids it instead of reusing it."""
    payload = _scheduled(spec, rule_name, knobs, target).script() + json.dumps(knobs, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


#: TVM 0.27's CUDA codegen writes ``__launch_bounds__(threads, N)`` for this attribute around a kernel's body.
MIN_BLOCKS_ATTR = "tirx.launch_bounds_min_blocks_per_sm"


def with_min_blocks_per_sm(func, blocks: int):
    """``func`` with ``T.attr(0, MIN_BLOCKS_ATTR, blocks)`` around the body of its blockIdx.x loop
    (0: unchanged): the occupancy hint of CUDA's ``__launch_bounds__``.

    TVM 0.27 reads the attribute only inside the kernel (as a function attribute or a loop
    annotation it is ignored), and a schedule has no primitive that wraps a loop's body in an
    attribute, so the function is printed, the body wrapped, and the text parsed back, as
    ``expr`` declares the tiled scale storage (7 of the default build's 432 kernels take this
    hint, so the round trip's 0.1 s each is not worth a structural rewrite).
    """
    if not blocks:
        return func
    import tvm

    lines = func.script().split("\n")
    heads = [index for index, line in enumerate(lines) if 'thread="blockIdx.x"' in line]
    if len(heads) != 1:
        raise RuntimeError(f"expected one blockIdx.x loop to give min_blocks_per_sm={blocks}, found {len(heads)}")
    head = heads[0]
    indent = len(lines[head]) - len(lines[head].lstrip())
    end = head + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    body = ["    " + line if line.strip() else line for line in lines[head + 1 : end]]
    lines[head + 1 : end] = [" " * (indent + 4) + f'with T.attr(0, "{MIN_BLOCKS_ATTR}", {blocks}):'] + body
    return tvm.script.from_source("\n".join(lines))


#: The PrimFunc attribute with which TVM 0.27's launcher sets CUDA's programmatic-stream-
#: serialization launch attribute (TVM's own spelling).
PDL_LAUNCH_PARAMS = ["tirx.use_programtic_dependent_launch"]
#: What a PDL kernel runs first: wait until the grids it depends on have completed and their
#: writes are visible (x and the residual may be the previous kernel's output), then let its
#: own dependents launch (they wait the same way, so releasing them at once is safe).
GRID_DEPENDENCY = '  asm volatile("griddepcontrol.wait;" ::: "memory");\n  asm volatile("griddepcontrol.launch_dependents;");\n'


def with_grid_dependency(source: str, kernel: str) -> str:
    """Make ``kernel`` start with ``GRID_DEPENDENCY``.

    TVM 0.27 exposes ``griddepcontrol`` to TIRx device code only, not to scheduled TIR (as with
    the min-blocks attribute), so the statement goes in at the top of the generated body.
    """
    pattern = re.compile(rf"(__global__ void __launch_bounds__\([\d, ]+\) {re.escape(kernel)}\([^;{{]*\)\s*{{\n)")
    source, count = pattern.subn(lambda match: match.group(1) + GRID_DEPENDENCY, source)
    if count != 1:
        raise RuntimeError(f"found {count} definitions of {kernel} in the generated source, expected one")
    return source


#: DLPack (type code, bits) of each input dtype.
_DLPACK_DTYPES = {"bf16": ("kDLBfloat", 16), "fp16": ("kDLFloat", 16), "fp32": ("kDLFloat", 32)}


def entry_point(spec: VariantSpec, symbol: str, buckets: Sequence[Tuple[int, str]] = ()) -> str:
    """C++ for ``symbol``: [M, K] rows and a [K] weight, checked, then viewed by groups in
    place; ``buckets`` ((max_rows, symbol), ...) are kernels of the same spec that run
    M <= max_rows instead of ``symbol``'s own."""
    params = launch.parameters(spec)
    names = ", ".join(f'"{name}"' for name, _ in params)
    kinds = ", ".join(str(kind) for _, kind in params)
    input_dtype = ", ".join("true" if name in launch.INPUT_DTYPE_ARGS else "false" for name, _ in params)
    code, bits = _DLPACK_DTYPES[spec.dtype]
    weight_code, weight_bits = _DLPACK_DTYPES[spec.weight_dtype_name]
    hidden = -1 if spec.hidden is None else spec.hidden
    multiple = spec.group * spec.scale.groups_per_word
    kernels = sorted(buckets) + [(-1, symbol)]
    table = ", ".join(f"{{{max_rows}, __tvm_ffi_{launch.grouped_symbol(name)}}}" for max_rows, name in kernels)
    return f"""
static const char* const {symbol}_names[] = {{{names}}};
static const int {symbol}_kinds[] = {{{kinds}}};
static const bool {symbol}_input_dtype[] = {{{input_dtype}}};
static const tvm_rmsquant::Kernel {symbol}_kernels[] = {{{table}}};
static const tvm_rmsquant::Contract {symbol}_contract = {{
    "{symbol}", {len(params)}, {symbol}_names, {symbol}_kinds, {symbol}_input_dtype,
    DLDataType{{{code}, {bits}, 1}}, DLDataType{{{weight_code}, {weight_bits}, 1}}, {spec.group}, {hidden}, {multiple},
    {symbol}_kernels}};
extern "C" TVM_DLL int32_t __tvm_ffi_{symbol}(void* self, void* args, int32_t num_args, void* result) {{
  return tvm_rmsquant::call_with_group_views({symbol}_contract, args, num_args, result);
}}
"""


def entry_points(variants: Sequence[Tuple[VariantSpec, str, Dict[str, int], str, Optional[int]]]) -> str:
    """The C++ of a library's public entry points (no TVM needed): ``row_views.cuh``, then each
    (spec, rule, knobs, symbol, max_rows)'s entry point. A spec's entry point with max_rows None
    also runs its M buckets' kernels."""
    buckets: Dict[VariantSpec, List[Tuple[int, str]]] = {}
    for spec, _, _, symbol, max_rows in variants:
        if max_rows is not None:
            buckets.setdefault(spec, []).append((max_rows, symbol))
    parts = [ROW_VIEWS.read_text()]
    parts += [entry_point(spec, symbol, buckets.get(spec, ()) if max_rows is None else ()) for spec, _, _, symbol, max_rows in variants]
    return "\n".join(parts)


def cuda_source(variants: Iterable[Tuple[VariantSpec, str, Dict[str, int], str, Optional[int]]], archs: Sequence[str],
                pdl: bool = True) -> str:
    """One translation unit for ``archs``: each (spec, rule, knobs, symbol, max_rows)'s kernel and
    host wrapper, then ``entry_points``. ``pdl``: every kernel launches with programmatic
    dependent launch (sm_90+) and starts with ``GRID_DEPENDENCY``."""
    import tvm

    variants = list(variants)
    target = scheduling_target(archs)
    funcs = {launch.grouped_symbol(symbol): schedule(spec, rule, knobs, symbol, target) for spec, rule, knobs, symbol, _ in variants}
    if pdl:
        funcs = {name: func.with_attr("tirx.kernel_launch_params", PDL_LAUNCH_PARAMS) for name, func in funcs.items()}
    with tvm.transform.PassContext(config=PASS_CONFIG):
        built = tvm.compile(tvm.IRModule(funcs), target=cuda_target(archs))
    kernels = tvm.backend.cuda.export_cuda_host(built.mod)
    if pdl:
        for _, _, _, symbol, _ in variants:
            kernels = with_grid_dependency(kernels, f"{launch.grouped_symbol(symbol)}_kernel")
    return "\n".join([kernels, entry_points(variants)])


def cpu_function(spec: VariantSpec):
    """The unscheduled tensor expression built for TVM's llvm target (CPU reference kernel)."""
    import tvm

    from tvm_rmsquant import expr

    return tvm.compile(expr.prim_func(spec, portable_casts=True), target="llvm")["main"]
