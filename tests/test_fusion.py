"""The fusion pass: reference RMSNorm -> group quant in a compiled model becomes our fused op."""

from __future__ import annotations

import contextlib
from typing import List, Optional, Tuple
from unittest import mock

import pytest
import torch

from tvm_rmsquant import fusion, ops, reference, select
from tvm_rmsquant.spec import VariantSpec

from models import LlamaConfig, LlamaVLConfig, NormQuant, TinyLlama, TinyLlamaVL

#: Each model's norm -> quant sites: layer 0's input norm (no residual) and three residual ones.
EXPECTED_FUSED = 4
#: Inductor otherwise skips the contract's intermediate bf16 roundings in the unfused model.
OPTIONS = {"emulate_precision_casts": True}
#: Token counts of one dynamic compile: 1 (which Dynamo specializes), then M % 4 != 0 and == 0,
#: the col layout's padded scale rows.
TOKENS = (1, 3, 17, 64, 300)


@pytest.fixture(autouse=True)
def _fresh_compiles():
    """The pass records what it fused only when Inductor runs it, not on a cache hit."""
    with torch._inductor.config.patch(force_disable_caches=True):
        yield


@torch.library.custom_op("tvm_rmsquant_test::reference_site", mutates_args=())
def reference_site(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, variant: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One norm -> quant site computed by the reference ops, opaque to Inductor like our fused op.

    On the CPU, the oracle of every GPU check: on the H200 the fused sites differed from
    the reference run on CUDA (see the test below), a difference not yet explained.
    """
    spec = VariantSpec.parse(variant)
    y, updated = reference.rms_norm(x.cpu(), weight.cpu(), eps, None if residual is None else residual.cpu())
    q, scales = reference.group_quant(y, spec)
    laid_out = reference.empty_scales(spec, x.shape[0], x.shape[1], x.device)
    laid_out.copy_(scales)
    return q.to(x.device), laid_out, (updated.to(x.device) if residual is not None else x.clone())


@reference_site.register_fake
def _(x, residual, weight, eps, variant):
    spec = VariantSpec.parse(variant)
    return torch.empty_like(x, dtype=torch.float8_e4m3fn), reference.empty_scales(spec, x.shape[0], x.shape[1], x.device), torch.empty_like(x)


def _opaque_site(self, x, residual=None):
    return reference_site(x, residual, self.weight, self.eps, self.kernel.spec.name)


def _model(kind: str, device):
    torch.manual_seed(0)
    if kind == "llama":
        return TinyLlama(LlamaConfig(), device), _inputs(kind, 16, device)
    return TinyLlamaVL(LlamaVLConfig(), device), _inputs(kind, 12, device)


def _inputs(kind: str, tokens: int, device) -> tuple:
    """The model's inputs with ``tokens`` token ids, last; the VL model's norm sites see its 4 patches' rows too."""
    patches = () if kind == "llama" else (torch.randn(4, LlamaVLConfig().patch_size, device=device).bfloat16(),)
    return (*patches, torch.randint(0, LlamaConfig().vocab_size, (tokens,), device=device))


@contextlib.contextmanager
def _fused_variants():
    """Record, per graph the fusion pass runs on, the sorted variants of its fused ops (their one str argument)."""
    graphs: List[List[str]] = []
    count = fusion.count_fused

    def recording(graph):
        graphs.append(sorted(arg for node in graph.nodes if node.op == "call_function" and node.target in fusion.FUSED_OPS for arg in node.args if isinstance(arg, str)))
        return count(graph)

    with mock.patch.object(fusion, "count_fused", recording):
        yield graphs


def _chosen(model) -> List[str]:
    return sorted(kernel.variant for kernel in fusion.kernels_of(model))


def _assert_codes_match(got, want):
    """fp8 codes equal except rare flips from last-bit fp32 rounding: at most 1 in 1000, each one fp8 step."""
    fractions = [(a.view(torch.uint8) != b.view(torch.uint8)).float().mean().item() for a, b in zip(got, want)]
    assert max(fractions) <= 1e-3, f"fraction of codes that differ, per site: {fractions}"
    for a, b in zip(got, want):
        a8, b8 = a.view(torch.uint8).int(), b.view(torch.uint8).int()
        assert ((a8 - b8)[a8 != b8].abs() <= 1).all(), "a code differs by more than one fp8 step"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", ["llama", "vl"])
def test_every_norm_quant_site_is_fused_in_one_graph_and_matches_the_unfused_model(kind, device):
    """Against the unfused model compiled in one graph, each norm -> quant site run by the
    reference ops inside an opaque op, so that Inductor compiles everything else exactly as
    in the fused model and the comparison isolates the pass.

    Not against eager: Inductor's own kernels drift from eager in later layers (the VL
    model's last site differs in 2.3% of codes on CPU). Not with the sites' reference ops
    open to Inductor: torch 2.11 on CUDA drops the contract's bf16 round trips there (3% of
    codes differ, docs/perf.md). Not with the reference on CUDA: 3.8% (Llama) and 0.13%
    (VL) of one site's codes differed from it on the H200, with the sites eager or opaque.
    """
    model, inputs = _model(kind, device)
    torch._dynamo.reset()
    with torch.no_grad():
        with _fused_variants() as variants:
            compiled = fusion.compile(model, fullgraph=True, options=OPTIONS)
            logits, codes = compiled(*inputs)
        torch._dynamo.reset()
        with mock.patch.object(NormQuant, "forward", _opaque_site):
            want_logits, want_codes = torch.compile(model, fullgraph=True, options=OPTIONS)(*inputs)
    assert compiled.fusion_pass.graphs == [EXPECTED_FUSED]
    # Each site into its own init-time choice: the row pattern once took the res_col site.
    assert variants == [_chosen(model)]
    _assert_codes_match(codes, want_codes)
    torch.testing.assert_close(logits.float(), want_logits.float(), atol=2e-2, rtol=2e-2)


def _fused_by_hand(self, x, residual=None):
    """The site as the pass should rewrite it: the fused op of the layer's init-time variant."""
    if residual is None:
        return (*ops.rms_norm_group_quant(x, self.weight, self.eps, self.kernel.variant), None)
    return ops.add_rms_norm_group_quant(x, residual, self.weight, self.eps, self.kernel.variant)


@pytest.mark.parametrize("mark", [False, True], ids=["dynamic_true", "mark_dynamic"])
@pytest.mark.parametrize("kind", ["llama", "vl"])
def test_one_symbolic_compile_fuses_every_site_at_every_token_count(kind, mark):
    """``dynamic=True``, or ``mark_dynamic`` on the token ids: M = 1 compiles on its own (Dynamo
    specializes size 1), every M >= 2 shares one more compile, and every graph fuses every site
    into its own variant, bit for bit what the model with the fused ops written by hand gives
    compiled the same way.

    Not against the reference sites of the static test: at 300 tokens the kernel's last-bit
    fp32 roundings flip 0.017% of the first site's codes by one step (within the contract),
    and later layers, reading those codes, turn that into 1.2%, 7.6% and 10.7% of the next
    sites' codes; against the fused ops written by hand every site is identical at every M.
    """
    model, _ = _model(kind, "cpu")
    runs = [_inputs(kind, tokens, "cpu") for tokens in TOKENS]
    compile_kwargs = {} if mark else {"dynamic": True}

    def outputs(compiled, after_each=lambda: None):
        results = []
        for inputs in runs:
            if mark:
                torch._dynamo.mark_dynamic(inputs[-1], 0)
            results.append(compiled(*inputs))
            after_each()
        return results

    torch._dynamo.reset()
    with torch.no_grad():
        with _fused_variants() as variants:
            compiled = fusion.compile(model, fullgraph=True, options=OPTIONS, **compile_kwargs)
            compiles: List[int] = []
            got = outputs(compiled, lambda: compiles.append(len(compiled.fusion_pass.graphs)))
        torch._dynamo.reset()
        with mock.patch.object(NormQuant, "forward", _fused_by_hand):
            want = outputs(torch.compile(model, fullgraph=True, options=OPTIONS, **compile_kwargs))
    assert set(compiled.fusion_pass.graphs) == {EXPECTED_FUSED}, compiled.fusion_pass.graphs
    assert variants == [_chosen(model)] * len(variants)
    for tokens, (logits, codes), (want_logits, want_codes) in zip(TOKENS, got, want):
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(codes, want_codes)), f"codes at {tokens} tokens"
        assert torch.equal(logits, want_logits), f"logits at {tokens} tokens"
    assert compiles[0] == 1 and len(set(compiles[1:])) == 1 and compiles[-1] <= 2, f"graphs compiled after each of tokens={TOKENS}: {compiles}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "vl"])
def test_one_dynamic_compile_is_correct_under_cuda_graph_replay_at_three_token_counts(kind):
    """One ``dynamic=True`` compile serves 3 token counts (M % 4 != 0 and == 0), each captured in
    a CUDA graph from static input buffers and replayed on fresh inputs copied into them. Each
    replay matches the model with the fused ops written by hand, compiled on its own and run
    on the fresh inputs, within the static test's bars (the two compiles tune their Triton
    kernels apart); a replay of the capture-time inputs would not.
    """
    model, _ = _model(kind, "cuda")
    torch._dynamo.reset()
    replays = []
    with torch.no_grad():
        compiled = fusion.compile(model, dynamic=True, fullgraph=True, options=OPTIONS)
        for tokens in (3, 17, 64):
            static = _inputs(kind, tokens, "cuda")
            # Warm up (and compile, on the first count) on a side stream, as capture requires.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                compiled(*static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = compiled(*static)
            fresh = _inputs(kind, tokens, "cuda")
            for buffer, value in zip(static, fresh):
                buffer.copy_(value)
            graph.replay()
            # The graph is kept: its outputs live in its memory pool.
            replays.append((graph, fresh, captured))
        torch.cuda.synchronize()
        torch._dynamo.reset()
        with mock.patch.object(NormQuant, "forward", _fused_by_hand):
            by_hand = torch.compile(model, dynamic=True, fullgraph=True, options=OPTIONS)
            wants = [by_hand(*fresh) for _, fresh, _ in replays]
    assert compiled.fusion_pass.graphs == [EXPECTED_FUSED]
    for (_, _, (logits, codes)), (want_logits, want_codes) in zip(replays, wants):
        _assert_codes_match(codes, want_codes)
        torch.testing.assert_close(logits.float(), want_logits.float(), atol=2e-2, rtol=2e-2)


def test_only_init_time_choices_are_fused():
    """A layer whose kernel is not handed to the pass, or a spec the model does not use, fuses nothing."""
    model, inputs = _model("llama", "cpu")
    kernels = fusion.kernels_of(model)
    assert len(kernels) == EXPECTED_FUSED
    plain_only = [kernel for kernel in kernels if not kernel.spec.residual]
    other_group = [select(1024, torch.bfloat16, 64, residual=True, consumer="triton", device="cpu")]
    for chosen, expected in ((plain_only, 1), (other_group, 0)):
        torch._dynamo.reset()
        with torch.no_grad():
            compiled = fusion.compile(model, kernels=chosen, fullgraph=True, options=OPTIONS)
            _, codes = compiled(*inputs)
            _, eager_codes = model(*inputs)
        assert compiled.fusion_pass.graphs == [expected]
        _assert_codes_match(codes, eager_codes)


def test_the_cache_key_names_the_chosen_variants():
    a = fusion.FusionPass([select(1024, torch.bfloat16, consumer="triton", device="cpu")])
    b = fusion.FusionPass([select(1024, torch.bfloat16, consumer="deepgemm_sm90", device="cpu")])
    assert a.uuid() != b.uuid() and a.uuid() == fusion.FusionPass([select(1024, torch.bfloat16, consumer="triton", device="cpu")]).uuid()


def test_compile_refuses_a_second_joint_graph_pass():
    model, _ = _model("llama", "cpu")
    with pytest.raises(ValueError, match="joint_custom_pre_pass"):
        fusion.compile(model, options={"joint_custom_pre_pass": object()})
