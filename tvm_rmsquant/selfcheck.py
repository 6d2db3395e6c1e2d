"""The CPU self-check: build a variant set for llvm and compare it with the reference."""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from . import cpu, launch, reference
from .checks import compare, random_inputs
from .scale_layout import RECORDS
from .spec import VariantSpec


def self_check_specs(hidden: Sequence[int]):
    """Every (layout, format) record, each dtype, with and without residual, the standalone
    quant, and an fp32 weight with 16-bit activations, at each K (G = 128 where it divides K, else 64, and a K neither divides is refused by
    VariantSpec; a format defined for one group size is checked at that size where it divides K)."""
    kinds = ((False, True, None), (True, True, None), (False, False, None), (True, True, "fp32"))  # (residual, norm, weight)
    for k, dtype, (residual, norm, weight), record in itertools.product(hidden, ("bf16", "fp16", "fp32"), kinds, RECORDS.values()):
        if record.group and k % record.group or weight == dtype:
            continue
        group = record.group or (128 if k % 128 == 0 else 64)
        yield VariantSpec(dtype, k, group, residual, record.layout, record.format, norm=norm, weight_dtype=weight)


def run_cpu_kernel(spec: VariantSpec, inputs, eps: float = 1e-6):
    """(q, scales, residual_out) from the llvm build of ``spec``."""
    x = inputs["x"]
    rows, hidden = x.shape
    q = torch.empty(rows, hidden, dtype=torch.float8_e4m3fn)
    scales = reference.empty_scales(spec, rows, hidden, "cpu")
    residual_out = torch.empty_like(x) if spec.residual else None
    launch.run(cpu.function(spec), spec, x, inputs["weight"], eps, q, scales, inputs["residual"], residual_out, inputs["scale_ub"])
    return q, scales, residual_out


def run_cpu_self_check(hidden: Sequence[int], rows: int = 67) -> bool:
    if not cpu.available():
        print("self-check needs the TVM compiler: pip install -e '.[build]'")
        return False
    passed = True
    for index, spec in enumerate(self_check_specs(hidden)):
        inputs = random_inputs(spec, rows, spec.hidden, seed=index)
        want = reference.rms_norm_group_quant(inputs["x"], inputs["weight"], 1e-6, spec, inputs["residual"], inputs["scale_ub"])
        agreement = compare(spec, run_cpu_kernel(spec, inputs), want, spec.hidden)
        passed &= agreement.passed
        print(f"{'ok  ' if agreement.passed else 'FAIL'} {spec.name:40s} {agreement.describe()}")
    print("self-check passed" if passed else "self-check FAILED")
    return passed
