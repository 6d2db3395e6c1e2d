"""Lowering: (spec, rule, knobs) -> scheduled TIR -> one CUDA C++ translation unit.

Plain functions, one step each. The CUDA target is sm_90 with the ``cuda_host`` host,
so ``export_cuda_host`` yields device kernels plus tvm-ffi host wrappers that nvcc
turns into a library needing only libtvm_ffi and libcudart.
"""

from __future__ import annotations

from typing import Dict, Iterable, Tuple

import tvm

from tvm_rmsquant import expr
from tvm_rmsquant.schedules import rule_by_name
from tvm_rmsquant.spec import VariantSpec

#: StorageRewrite reuses the all-reduce result buffer in place when the rms block
#: reads it, letting every thread rewrite a shared value with no barrier (a race).
PASS_CONFIG = {"tirx.disable_storage_rewrite": True}


def cuda_target():
    return tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "cuda_host"})


def schedule(spec: VariantSpec, rule_name: str, knobs: Dict[str, int]):
    """The scheduled PrimFunc of one variant, exported under the variant's name."""
    rule = rule_by_name(rule_name)
    sch = rule.apply(expr.prim_func(spec), spec, knobs)
    return sch.mod["main"].with_attr("global_symbol", spec.name)


def cuda_source(variants: Iterable[Tuple[VariantSpec, str, Dict[str, int]]]) -> str:
    """One translation unit holding every given variant's kernel and host wrapper."""
    funcs = {spec.name: schedule(spec, rule_name, knobs) for spec, rule_name, knobs in variants}
    with tvm.transform.PassContext(config=PASS_CONFIG):
        built = tvm.compile(tvm.IRModule(funcs), target=cuda_target())
    return tvm.backend.cuda.export_cuda_host(built.mod)


def cpu_function(spec: VariantSpec):
    """The unscheduled tensor expression built for TVM's llvm target (CPU reference kernel)."""
    return tvm.compile(expr.prim_func(spec, portable_casts=True), target="llvm")["main"]
