"""The kernel calling convention, shared by the CUDA bundle and the CPU (llvm) build.

Arguments, in order: x, [residual], weight, [scale_ub], eps, q, scales, [residual_out], with
row tensors [M, K] and weight [K], as torch holds them; the standalone quant (``norm=False``)
takes x, [scale_ub], q, scales. The tensor expression itself
takes rows as [M, K/G, G] and weight as [K/G, G] (see ``tvm_rmsquant.expr``); the
bundle's entry points make those views in C++ (``codegen/row_views.cuh``), and the CPU
build in ``group_views`` below. Neither launches when M = 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

if TYPE_CHECKING:  # the build's lowering workers import this module without torch
    import torch

from .spec import VariantSpec

#: Arguments that must have the variant's dtype: the input dtype, the weight its own where
#: the spec sets ``weight_dtype`` (a mixed-dtype norm).
INPUT_DTYPE_ARGS = ("x", "residual", "weight", "residual_out")
#: How an argument is passed to the tensor expression: as is, viewed by groups, or as a
#: checked eps (a positive finite float).
AS_IS, ROWS, WEIGHT, EPS = 0, 1, 2, 3


def grouped_symbol(symbol: str) -> str:
    """The tensor expression's own entry (grouped views) behind the public entry ``symbol``."""
    return f"{symbol}_grouped"


def parameters(spec: VariantSpec) -> List[Tuple[str, int]]:
    """(name, kind) of each kernel argument, in call order."""
    names = [("x", ROWS)]
    if spec.residual:
        names.append(("residual", ROWS))
    if spec.norm:
        names.append(("weight", WEIGHT))
    if spec.scale_ub:
        names.append(("scale_ub", AS_IS))
    if spec.norm:
        names.append(("eps", EPS))
    names += [("q", ROWS), ("scales", AS_IS)]
    if spec.residual:
        names.append(("residual_out", ROWS))
    return names


def kernel_args(
    spec: VariantSpec,
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: Optional[float],
    q: torch.Tensor,
    scales: torch.Tensor,
    residual: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
    scale_ub: Optional[torch.Tensor] = None,
) -> list:
    named = {"x": x, "residual": residual, "weight": weight, "scale_ub": scale_ub, "eps": None if eps is None else float(eps),
             "q": q, "scales": scales, "residual_out": residual_out}
    return [named[name] for name, _ in parameters(spec)]


def group_views(spec: VariantSpec, args: Sequence) -> list:
    """The arguments as the tensor expression takes them: rows [M, K/G, G], weight [K/G, G]."""
    views = []
    for arg, (_, kind) in zip(args, parameters(spec)):
        if kind == ROWS:
            arg = arg.view(arg.shape[0], -1, spec.group)
        elif kind == WEIGHT:
            arg = arg.view(-1, spec.group)
        views.append(arg)
    return views


def run(function, spec: VariantSpec, x, weight, eps, q, scales, residual=None, residual_out=None, scale_ub=None) -> None:
    """Call one kernel on 2-D, row-contiguous tensors; outputs are written in place."""
    function(*kernel_args(spec, x, weight, eps, q, scales, residual, residual_out, scale_ub))
