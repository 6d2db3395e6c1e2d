"""Lowering: (spec, rule, knobs) -> scheduled TIR -> one CUDA C++ translation unit.

Plain functions, one step each. The CUDA target is sm_90 with the ``cuda_host`` host,
so ``export_cuda_host`` yields device kernels plus tvm-ffi host wrappers that nvcc
turns into a library needing only libtvm_ffi and libcudart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, Tuple

import tvm

from tvm_rmsquant import expr, launch
from tvm_rmsquant.schedules import rule_by_name
from tvm_rmsquant.spec import VariantSpec

#: The C++ helper behind every variant's public entry point (takes [M, K] tensors).
ROW_VIEWS = Path(__file__).with_name("row_views.cuh")

#: StorageRewrite reuses the all-reduce result buffer in place when the rms block
#: reads it, letting every thread rewrite a shared value with no barrier (a race).
PASS_CONFIG = {"tirx.disable_storage_rewrite": True}


def cuda_target():
    return tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "cuda_host"})


def schedule(spec: VariantSpec, rule_name: str, knobs: Dict[str, int]):
    """The scheduled PrimFunc of one variant, exported under ``grouped_symbol``."""
    rule = rule_by_name(rule_name)
    sch = rule.apply(expr.prim_func(spec), spec, knobs)
    return sch.mod["main"].with_attr("global_symbol", launch.grouped_symbol(spec))


#: DLPack (type code, bits) of each input dtype.
_DLPACK_DTYPES = {"bf16": ("kDLBfloat", 16), "fp16": ("kDLFloat", 16), "fp32": ("kDLFloat", 32)}


def entry_point(spec: VariantSpec) -> str:
    """C++ for ``spec.name``: [M, K] rows and a [K] weight, checked, then viewed by groups in place."""
    params = launch.parameters(spec)
    names = ", ".join(f'"{name}"' for name, _ in params)
    kinds = ", ".join(str(kind) for _, kind in params)
    input_dtype = ", ".join("true" if name in launch.INPUT_DTYPE_ARGS else "false" for name, _ in params)
    code, bits = _DLPACK_DTYPES[spec.dtype]
    hidden = -1 if spec.hidden is None else spec.hidden
    multiple = spec.group * (4 if spec.format == "ue8m0_packed" else 1)
    symbol = spec.name
    return f"""
static const char* const {symbol}_names[] = {{{names}}};
static const int {symbol}_kinds[] = {{{kinds}}};
static const bool {symbol}_input_dtype[] = {{{input_dtype}}};
static const tvm_rmsquant::Contract {symbol}_contract = {{
    "{symbol}", {len(params)}, {symbol}_names, {symbol}_kinds, {symbol}_input_dtype,
    DLDataType{{{code}, {bits}, 1}}, {spec.group}, {hidden}, {multiple}}};
extern "C" TVM_DLL int32_t __tvm_ffi_{symbol}(void* self, void* args, int32_t num_args, void* result) {{
  return tvm_rmsquant::call_with_group_views(__tvm_ffi_{launch.grouped_symbol(spec)}, {symbol}_contract, args, num_args, result);
}}
"""


def cuda_source(variants: Iterable[Tuple[VariantSpec, str, Dict[str, int]]]) -> str:
    """One translation unit: every given variant's kernel, host wrapper and entry point."""
    variants = list(variants)
    funcs = {launch.grouped_symbol(spec): schedule(spec, rule_name, knobs) for spec, rule_name, knobs in variants}
    with tvm.transform.PassContext(config=PASS_CONFIG):
        built = tvm.compile(tvm.IRModule(funcs), target=cuda_target())
    parts = [tvm.backend.cuda.export_cuda_host(built.mod), ROW_VIEWS.read_text()]
    parts += [entry_point(spec) for spec, _, _ in variants]
    return "\n".join(parts)


def cpu_function(spec: VariantSpec):
    """The unscheduled tensor expression built for TVM's llvm target (CPU reference kernel)."""
    return tvm.compile(expr.prim_func(spec, portable_casts=True), target="llvm")["main"]
