"""The kernel calling convention, shared by the CUDA bundle and the CPU (llvm) build.

Kernels take row tensors as [M, K/G, G] views (see ``tvm_rmsquant.expr``), in the order
x, [r], weight, [scale_ub], eps, q, scales, [residual_out]. M = 0 is never launched:
the generated host wrapper would launch an empty grid that writes through NULL.
"""

from __future__ import annotations

from typing import Optional

import torch

from .spec import VariantSpec


def kernel_args(
    spec: VariantSpec,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    q: torch.Tensor,
    scales: torch.Tensor,
    residual: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
    scale_ub: Optional[torch.Tensor] = None,
):
    rows, hidden = x.shape
    groups = hidden // spec.group

    def grouped(tensor):
        return tensor.view(rows, groups, spec.group)

    args = [grouped(x)]
    if spec.residual:
        args.append(grouped(residual))
    args.append(weight.view(groups, spec.group))
    if spec.scale_ub:
        args.append(scale_ub)
    args += [float(eps), grouped(q), scales]
    if spec.residual:
        args.append(grouped(residual_out))
    return args


def run(function, spec: VariantSpec, x, weight, eps, q, scales, residual=None, residual_out=None, scale_ub=None) -> None:
    """Call one kernel on 2-D, row-contiguous tensors; outputs are written in place."""
    if x.shape[0] == 0:
        return
    function(*kernel_args(spec, x, weight, eps, q, scales, residual, residual_out, scale_ub))
