"""A torch.compile pass that rewrites RMSNorm -> per-token-group FP8 quant into the fused op.

A model written with the plain torch reference ops (``reference.rms_norm`` then
``reference.group_quant``, the contract's own spelling) compiles, unfused, into separate
Inductor kernels that read each row several times. This pass is an Inductor joint-graph
pre-pass: it matches that pair in the functionalized aten graph and replaces it with one
``tvm_rmsquant`` op. It runs before Inductor's own simplifications, which may fold the
contract's bf16 round trips away (torch 2.11 does on CUDA), so it sees the ops as written.

Which variant replaces a match is never decided here: each pattern comes from a kernel
that ``tvm_rmsquant.select`` chose at model init (``FusionPass(kernels)``, or
``kernels_of(model)``), one replacement per chosen layout/format/residual, and a match is
rewritten only into the variant chosen for that spec. Layers whose init-time choice was
the torch reference stay unfused.

Static and symbolic row counts alike: a replacement's pattern is traced at a static row
count with its shape arguments ignored (plus a second one traced at symbolic rows where
that changes the traced form, as for packed UE8M0), and each match is re-traced at its own
shapes, a symbolic M included, and re-checked, so the replacement bakes in no row count.
``compile(model, dynamic=True)`` and ``torch._dynamo.mark_dynamic(x, 0)`` fuse every site,
as a static compile does; a size-1 token dimension is specialized by Dynamo and compiles
(and fuses) on its own.

    model = MyModel(...)                      # layers call select() in __init__
    compiled = fusion.compile(model, fullgraph=True)
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, gen_pattern, register_replacement
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from . import launch, ops, reference
from .dispatch import BoundKernel
from .spec import VariantSpec

#: The ops this pass writes, for counting them in a graph.
FUSED_OPS = (ops.rms_norm_group_quant.default, ops.add_rms_norm_group_quant.default)
#: Rows of the example inputs the patterns are traced with (the hint of a symbolic trace); a
#: match is re-checked at its own shapes.
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


def _trace(fn, args, own_mode: Optional[FakeTensorMode] = None, **kwargs):
    """``fwd_only`` of the functionalized pattern: the form of the joint graph the pass sees.

    Without ``fwd_only``'s functional passes: the pass runs before Inductor's, so the graph
    still holds the row layout's same-layout ``copy(empty_strided, scales)``, which their
    ``remove_noop_ops`` dropped from the pattern; the row pattern then also matched the
    col sites' unlaid-out scales and rewrote the test Llama's ``res_col`` site into
    ``res_row``, leaving the layout copy behind. Dead code is still removed: the packed
    UE8M0 trace leaves 5 dead nodes, users that the pattern would count.

    A trace of inputs from ``own_mode`` (the pattern's symbolic-row trace, not a match's
    re-check) has each symbolic size replaced by its hint, so that its shape arguments are
    plain ints, which the pattern ignores like those of a static trace. Any other trace has
    one node per use of each size it computes, as ``FusionPass`` gives the graph.
    """
    gm = fwd_only(torch.func.functionalize(fn), args, run_functional_passes=False, **kwargs)
    if own_mode is not None and any(getattr(arg, "fake_mode", None) is own_mode for arg in args):
        for node in gm.graph.nodes:
            if isinstance(node.meta.get("val"), torch.SymInt):
                hint = node.meta["val"].node.hint
                for user in list(node.users):
                    user.args, user.kwargs = torch.fx.node.map_arg((user.args, user.kwargs), lambda arg: hint if arg is node else arg)
    else:
        _one_node_per_use(gm.graph, set())
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _one_node_per_use(graph: torch.fx.Graph, kept: set) -> None:
    """Copy each symbolic size computed in ``graph``, other than the sympy expressions ``kept``, once per use.

    A match is re-checked by re-tracing the pattern at the match's shapes: the symbolic row
    count M of its [M, hidden] inputs is an argument there, but what the pattern computes
    from M (the col layout's padded rows ``round_up(M, 4)``) is a node with the uses of one
    site. The graph holds one such node for every site, so with symbolic M the test Llama's
    2 col sites both failed the re-check, on the user count. With one node per use on both
    sides, the counts agree however a site shares its sizes.
    """
    for node in reversed(list(graph.nodes)):
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(val, torch.SymInt) or val.node.expr in kept:
            continue
        for user in list(node.users)[1:]:
            with graph.inserting_after(node):
                copy = graph.node_copy(node)
            user.replace_input_with(node, copy)


def _row_counts(graph: torch.fx.Graph, hiddens: Set[int]) -> set:
    """The symbolic row counts M of the graph's [M, hidden] tensors: what a re-check binds as an argument, once."""
    rows = set()
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() == 2 and isinstance(val.shape[0], torch.SymInt) and isinstance(val.shape[1], int) and val.shape[1] in hiddens:
            rows.add(val.shape[0].node.expr)
    return rows


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
    others = [weight] + ([torch.empty(1, device=device_type)] if spec.scale_ub else [])
    scalars = {"eps": 1e-6}
    register = functools.partial(register_replacement, search, replace, pass_dicts=patterns, extra_check=matches_spec, scalar_workaround=scalars)
    static = register(rows + others, _trace)
    # A symbolic M can change the traced form, not only its sizes: packed UE8M0's
    # padded[:, :groups] = ... keeps a whole-row slice and slice_scatter, which a static
    # trace elides. Such a spec gets a second pattern, traced at symbolic rows.
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        x = mode.from_tensor(rows[0], symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
        symbolic = [x] + [torch.empty_like(x) for _ in rows[1:]] + [mode.from_tensor(other) for other in others]
        trace = functools.partial(_trace, own_mode=mode)
        if not gen_pattern(search, symbolic, trace, scalars).pattern_eq(static):
            register(symbolic, trace)


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
        _one_node_per_use(graph, _row_counts(graph, {spec.hidden for spec, _ in self.variants}))
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

    Returns the compiled module; its pass is ``compiled.fusion_pass``. Its calls trace with
    Python floats specialized: with ``dynamic=True`` Dynamo otherwise turns each float the
    sites read (the layer's ``eps``, ``spec.FP8_MAX``) into a float64 graph input, which the
    fused op's float ``eps`` cannot take, and no site fused. A float that changes recompiles.
    """
    fusion_pass = FusionPass(kernels_of(model) if kernels is None else kernels)
    options = dict(options or {})
    if options.get("joint_custom_pre_pass") is not None:
        raise ValueError("options['joint_custom_pre_pass'] is already set; compose the passes into one and pass kernels=")
    options["joint_custom_pre_pass"] = fusion_pass
    compiled = torch.compile(model, options=options, **compile_kwargs)
    compiled.forward = torch._dynamo.config.patch(specialize_float=True)(compiled.forward)
    compiled.fusion_pass = fusion_pass
    return compiled
