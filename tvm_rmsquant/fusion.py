"""A torch.compile pass that rewrites RMSNorm -> per-token-group FP8 quant into the fused op.

A model written with the plain torch reference ops (``reference.rms_norm`` then
``reference.group_quant``, the contract's own spelling) compiles, unfused, into separate
Inductor kernels that read each row several times. This pass is an Inductor joint-graph
pre-pass: it matches that pair in the functionalized aten graph and replaces it with one
``tvm_rmsquant`` op. It runs before Inductor's own simplifications, which may fold the
contract's bf16 round trips away (torch 2.11 does on CUDA), so it sees the ops as written.

Which variant replaces a match is never decided here: each pattern comes from a kernel
that ``tvm_rmsquant.select`` chose at model init (``FusionPass(kernels)``, or
``kernels_of(model)``), one pattern per chosen layout/format/residual, and a match is
rewritten only into the variant chosen for that spec. Layers whose init-time choice was
the torch reference stay unfused.

    model = MyModel(...)                      # layers call select() in __init__
    compiled = fusion.compile(model, fullgraph=True)
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

from . import launch, ops, reference
from .dispatch import BoundKernel
from .spec import VariantSpec

#: The ops this pass writes, for counting them in a graph.
FUSED_OPS = (ops.rms_norm_group_quant.default, ops.add_rms_norm_group_quant.default)
#: Rows of the example inputs the patterns are traced with; the match is re-checked at real shapes.
_TRACE_ROWS = 8
#: This module's source, part of Inductor's cache key for the pass.
_SOURCE = Path(__file__).read_bytes()


def kernels_of(model: torch.nn.Module) -> List[BoundKernel]:
    """Every ``BoundKernel`` held as an attribute by ``model`` or its submodules."""
    found = []
    for module in model.modules():
        found += [value for value in vars(module).values() if isinstance(value, BoundKernel)]
    return found


def count_fused(graph: torch.fx.Graph) -> int:
    return sum(node.op == "call_function" and node.target in FUSED_OPS for node in graph.nodes)


def _trace(fn, args, **kwargs):
    """``fwd_only`` of the functionalized pattern: the form of the joint graph the pass sees."""
    return fwd_only(torch.func.functionalize(fn), args, **kwargs)


def _register(patterns, spec: VariantSpec, variant: str, device_type: str) -> None:
    """One replacement: the reference norm + quant of ``spec`` on ``device_type`` -> the fused op ``variant``."""
    dtype = reference.TORCH_DTYPES[spec.dtype]
    weight = torch.empty(spec.hidden, dtype=dtype, device=device_type)

    def matches_spec(match) -> bool:
        x = match.kwargs["x"].meta["val"]
        return x.dim() == 2 and x.shape[1] == spec.hidden and x.dtype == dtype

    # The kernel's inputs, in launch order (x, [residual], weight, [scale_ub], eps): the
    # pattern matcher binds a match's inputs by parameter name.
    names = [name for name, _ in launch.parameters(spec)]
    names = names[: names.index("eps") + 1]

    def search(*args):
        named = dict(zip(names, args))
        y, residual_out = reference.rms_norm(named["x"], named["weight"], named["eps"], named.get("residual"))
        q, scales = reference.group_quant(y, spec, named.get("scale_ub"))
        return (q, scales) if residual_out is None else (q, scales, residual_out)

    def replace(*args):
        named = dict(zip(names, args))
        x, weight, eps, scale_ub = named["x"], named["weight"], named["eps"], named.get("scale_ub")
        if not spec.residual:
            return ops.rms_norm_group_quant(x, weight, eps, variant, scale_ub)
        return ops.add_rms_norm_group_quant(x, named["residual"], weight, eps, variant, scale_ub)

    signature = inspect.Signature([inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names])
    search.__signature__ = replace.__signature__ = signature
    # Distinct tensors: tracing would merge one tensor passed as both x and residual.
    rows = [torch.empty(_TRACE_ROWS, spec.hidden, dtype=dtype, device=device_type) for _ in range(1 + spec.residual)]
    example = rows + [weight] + ([torch.empty(1, device=device_type)] if spec.scale_ub else [])
    register_replacement(search, replace, example, _trace, patterns, extra_check=matches_spec, scalar_workaround={"eps": 1e-6})


class FusionPass(CustomGraphPass):
    """Inductor joint-graph pre-pass holding one replacement per init-time kernel choice.

    ``graphs`` records, per graph the pass ran on, how many fused ops it holds afterwards.
    """

    def __init__(self, kernels: Iterable[BoundKernel]):
        self.variants: Dict[Tuple[VariantSpec, str], str] = {}
        for bound in kernels:
            if bound.variant is None:
                continue  # the layer's init-time choice was the torch reference
            chosen = self.variants.setdefault((bound.spec, bound.device_type), bound.variant)
            if chosen != bound.variant:
                raise ValueError(f"two kernels were chosen for {bound.spec.name}: {chosen} and {bound.variant}; select() once per spec and bundle")
        self.patterns = PatternMatcherPass(pass_name="tvm_rmsquant_fusion")
        for (spec, device_type), variant in self.variants.items():
            _register(self.patterns, spec, variant, device_type)
        self.graphs: List[int] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.patterns.apply(graph)
        graph.eliminate_dead_code()
        self.graphs.append(count_fused(graph))

    def uuid(self) -> bytes:
        """Inductor's cache key: this module's source and the chosen variants."""
        digest = hashlib.sha256(_SOURCE)
        digest.update(repr(sorted((spec.name, device_type, variant) for (spec, device_type), variant in self.variants.items())).encode())
        return digest.digest()


def compile(model: torch.nn.Module, kernels: Optional[Iterable[BoundKernel]] = None, options: Optional[dict] = None, **compile_kwargs):
    """``torch.compile`` with the fusion pass for ``kernels`` (default: ``kernels_of(model)``).

    Returns the compiled module; its pass is ``compiled.fusion_pass``.
    """
    fusion_pass = FusionPass(kernels_of(model) if kernels is None else kernels)
    options = dict(options or {})
    if options.get("joint_custom_pre_pass") is not None:
        raise ValueError("options['joint_custom_pre_pass'] is already set; compose the passes into one and pass kernels=")
    options["joint_custom_pre_pass"] = fusion_pass
    compiled = torch.compile(model, options=options, **compile_kwargs)
    compiled.fusion_pass = fusion_pass
    return compiled
