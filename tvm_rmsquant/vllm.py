"""vLLM plugin: a post-grad pass that runs vLLM's RMSNorm -> FP8 group-quant sites on our op.

vLLM (0.33) loads it by name, as a top-level attribute of this package (the only form its
``CompilationConfig.inductor_passes`` resolves)::

    vllm serve MODEL --compilation-config \\
        '{"inductor_passes": {"post_grad_custom_post_pass": "tvm_rmsquant.vllm_post_pass"}}'

It runs after vLLM's own fusion passes, on the functionalized post-grad graph, and
rewrites two forms of one site:

- vLLM's fused ``_C.rms_norm_per_block_quant`` (its ``fuse_norm_quant`` pass on), whose
  arguments our out-variant takes by the same names;
- the unfused pair ``vllm_ir.rms_norm`` / ``vllm_ir.fused_add_rms_norm`` ->
  ``_C.per_token_group_fp8_quant`` (vLLM's fusion off, its default with Inductor).

Each rewritten node writes the buffers vLLM allocated (q, and scales in the layout vLLM
chose, TMA-padded or not), so the consuming GEMM reads what it read before. The scale
format is what that GEMM reads: UE8M0 where the quant asked for ``scale_ue8m0`` or where
the scales feed DeepGEMM with its E8M0 flag on (``vllm.fp8_gemm_nt_op``'s last argument).
vLLM 0.33's fused kernel has no UE8M0 mode and drops that request (vLLM issue #50773):
this pass restores it. The numerics become this package's contract (README), whose
scale floor is 1/(448·512) where vLLM's group quant floors the absmax at 1e-10.

The variant of each site is chosen by ``select()`` when Inductor runs the pass, once per
compiled graph at model init, never while Dynamo traces; a site no kernel serves keeps
vLLM's nodes, and the log says why.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Dict, List, Optional, Tuple

import torch
from torch import fx

from . import ops
from .dispatch import select
from .reference import DTYPE_NAMES

#: A child of vLLM's logger, so that its handler prints our lines in vLLM's log.
logger = logging.getLogger("vllm.tvm_rmsquant")

#: Our op, its mutated arguments in schema order: auto_functionalized's outputs 1, 2, 3.
OUR_OP = ops.rms_norm_per_block_quant.default
RESULT, SCALE, RESIDUAL = 1, 2, 3
#: vLLM's ops, by their registered names (looked up in the graph, never imported).
VLLM_FUSED = "_C::rms_norm_per_block_quant"
VLLM_QUANT = "_C::per_token_group_fp8_quant"
VLLM_NORM = "vllm_ir::rms_norm"
VLLM_ADD_NORM = "vllm_ir::fused_add_rms_norm"
#: DeepGEMM's linear op and its argument that says it reads the activation scales as UE8M0.
DEEPGEMM_GEMM, DEEPGEMM_E8M0 = "vllm::fp8_gemm_nt_op", "use_deep_gemm_e8m0"


def register() -> None:
    """The ``vllm.general_plugins`` entry point, run in every vLLM process at start-up.

    Importing this package registers ``torch.ops.tvm_rmsquant``, which a graph compiled
    with the pass calls, also where vLLM loads that graph from its compile cache and the
    pass never runs.
    """
    logger.info(
        "tvm_rmsquant %s loaded; its norm+quant pass runs where --compilation-config names "
        "'tvm_rmsquant.vllm_post_pass' in inductor_passes",
        __import__("tvm_rmsquant").__version__,
    )


def _op_name(node: fx.Node) -> Optional[str]:
    target = node.target
    if node.op != "call_function":
        return None
    if target is torch.ops.higher_order.auto_functionalized:
        target = node.args[0]
    name = getattr(target, "name", None)
    return name() if callable(name) else None


def _getitems(node: fx.Node) -> Dict[int, List[fx.Node]]:
    found: Dict[int, List[fx.Node]] = {}
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem:
            found.setdefault(user.args[1], []).append(user)
    return found


def _arguments(node: fx.Node) -> dict:
    """A call's arguments by schema name, for a direct call or an auto_functionalized one."""
    if node.target is torch.ops.higher_order.auto_functionalized:
        return dict(node.kwargs)
    names = [argument.name for argument in node.target._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def _feeds_deepgemm_e8m0(scale_outputs: List[fx.Node]) -> bool:
    """Whether these scales are read by DeepGEMM with its E8M0 flag on."""
    return any(
        _op_name(user) == DEEPGEMM_GEMM and _arguments(user).get(DEEPGEMM_E8M0) is True
        for scale in scale_outputs
        for user in scale.users
    )


@dataclasses.dataclass
class Site:
    """One norm -> quant site of the graph, in our op's arguments."""

    quant: fx.Node  # the auto_functionalized node that writes q and the scales
    kwargs: dict  # our op's arguments, by name
    norm: Optional[fx.Node] = None  # the unfused norm node, removed with the quant
    residual_out: List[fx.Node] = dataclasses.field(default_factory=list)  # its updated-residual outputs
    refusal: Optional[str] = None

    @property
    def layout(self) -> Tuple[str, str]:
        return ("col" if self.kwargs["is_scale_transposed"] else "row"), ("ue8m0" if self.kwargs["scale_ue8m0"] else "fp32")


def _fused_site(node: fx.Node) -> Site:
    kwargs = {name: node.kwargs[name] for name in ("result", "input", "weight", "scale", "epsilon", "scale_ub", "residual", "group_size", "is_scale_transposed")}
    kwargs["scale_ue8m0"] = _feeds_deepgemm_e8m0(_getitems(node).get(SCALE, []))
    return Site(node, kwargs)


def _unfused_site(node: fx.Node) -> Optional[Site]:
    """The quant node's site, when its input is a vLLM RMSNorm used by nothing else."""
    source = node.kwargs["input"]
    if not isinstance(source, fx.Node):
        return None
    norm, residual, residual_out = source, None, []
    if source.target is operator.getitem and source.args[1] == 0 and _op_name(source.args[0]) == VLLM_ADD_NORM:
        norm = source.args[0]
        x, residual, weight, epsilon, *rest = norm.args
        residual_out = _getitems(norm).get(1, [])
    elif _op_name(source) == VLLM_NORM:
        x, weight, epsilon, *rest = source.args
    else:
        return None
    kwargs = dict(
        result=node.kwargs["output_q"], input=x, weight=weight, scale=node.kwargs["output_s"], epsilon=epsilon,
        scale_ub=None, residual=residual, group_size=node.kwargs["group_size"],
        is_scale_transposed=node.kwargs["dummy_is_scale_transposed"],
        scale_ue8m0=bool(node.kwargs["scale_ue8m0"]) or _feeds_deepgemm_e8m0(_getitems(node).get(SCALE, [])),
    )
    site = Site(node, kwargs, norm=norm, residual_out=residual_out)
    if len(source.users) != 1:
        site.refusal = "the normalized activations are also used elsewhere"
    elif (rest and rest[0] is not None) or norm.kwargs.get("variance_size") is not None:
        site.refusal = "RMSNorm over part of the hidden size (variance_size)"
    elif (node.kwargs["fp8_min"], node.kwargs["fp8_max"]) != (-448.0, 448.0):
        site.refusal = f"fp8 range {node.kwargs['fp8_min']}..{node.kwargs['fp8_max']}, not float8_e4m3fn's ±448"
    return site


def _val(value):
    return value.meta["val"] if isinstance(value, fx.Node) else value


def _choose(site: Site):
    """``select()`` for the site's shapes and layout; None with the reason when nothing serves it."""
    kwargs = site.kwargs
    x, weight = _val(kwargs["input"]), _val(kwargs["weight"])
    if weight is None:
        return None, "RMSNorm without a weight"
    if x.dtype not in DTYPE_NAMES or weight.dtype != x.dtype:
        return None, f"input {x.dtype} with a {weight.dtype} norm weight; the kernels take one dtype"
    layout, fmt = site.layout
    try:
        kernel = select(
            int(x.shape[-1]), x.dtype, kwargs["group_size"], residual=kwargs["residual"] is not None, scale_layout=layout,
            scale_format=fmt, device=x.device, scale_ub=kwargs["scale_ub"] is not None,
        )
    except (TypeError, ValueError) as error:
        return None, str(error)
    if kernel.variant is None:
        return None, "; ".join(candidate.reason for candidate in kernel.why)
    return kernel, None


def _rewrite(graph: fx.Graph, site: Site) -> None:
    """One auto_functionalized call of our op in place of the site's nodes, writing vLLM's buffers."""
    with graph.inserting_before(site.quant):
        node = graph.call_function(torch.ops.higher_order.auto_functionalized, (OUR_OP,), site.kwargs)
    values = {name: _val(value) for name, value in site.kwargs.items()}
    residual = values["residual"]
    node.meta["val"] = (None, values["result"], values["scale"]) + ((torch.empty_like(residual),) if residual is not None else ())
    if "eager_input_vals" in site.quant.meta:
        node.meta["eager_input_vals"] = ((OUR_OP,), values)
    # vLLM's fused op and its quant number their outputs as ours do (1: q, 2: scales, 3: residual).
    outputs = {index: list(users) for index, users in _getitems(site.quant).items()}
    outputs.setdefault(RESIDUAL, []).extend(site.residual_out)
    for index, old in outputs.items():
        if not old:
            continue
        with graph.inserting_after(node):
            new = graph.call_function(operator.getitem, (node, index))
        new.meta["val"] = node.meta["val"][index]
        for item in old:
            item.replace_all_uses_with(new)
            graph.erase_node(item)
    graph.erase_node(site.quant)
    if site.norm is not None:
        for item in [user for user in site.norm.users if user.target is operator.getitem]:
            if not item.users:
                graph.erase_node(item)
        if not site.norm.users:
            graph.erase_node(site.norm)


def find_sites(graph: fx.Graph) -> List[Site]:
    sites = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.higher_order.auto_functionalized:
            continue
        name = _op_name(node)
        if name == VLLM_FUSED:
            sites.append(_fused_site(node))
        elif name == VLLM_QUANT:
            site = _unfused_site(node)
            if site is not None:
                sites.append(site)
    return sites


@dataclasses.dataclass
class Report:
    """What one run of the pass did: each site as (vLLM op it replaced, our variant), and
    each site it kept with the reason."""

    rewritten: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    kept: List[str] = dataclasses.field(default_factory=list)


#: The report of each graph the pass ran on, in order (read by tests and by a user's debugging).
REPORTS: List[Report] = []


def post_pass(graph: fx.Graph) -> Report:
    """Rewrite every site some kernel serves; log and return what was done."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    report = Report()
    for site in find_sites(graph):
        kernel, refusal = (None, site.refusal) if site.refusal else _choose(site)
        if kernel is None:
            report.kept.append(f"{site.quant.name}: {refusal}")
            continue
        replaced = _op_name(site.quant) if site.norm is None else f"{_op_name(site.norm)} + {VLLM_QUANT}"
        _rewrite(graph, site)
        report.rewritten.append((replaced, kernel.variant))
    if report.rewritten:
        # The updated residual may be read before the quant's position: restore a valid order.
        stable_topological_sort(graph)
    graph.lint()
    REPORTS.append(report)
    if report.rewritten or report.kept:
        logger.info(
            "tvm_rmsquant: %d of %d RMSNorm+FP8 group-quant sites run on tvm_rmsquant (%s)%s",
            len(report.rewritten), len(report.rewritten) + len(report.kept), ", ".join(sorted({variant for _, variant in report.rewritten})) or "none",
            "".join(f"; kept vLLM's {line}" for line in report.kept),
        )
    return report
