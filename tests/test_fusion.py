"""The fusion pass: reference RMSNorm -> group quant in a compiled model becomes our fused op."""

from __future__ import annotations

from typing import Optional, Tuple
from unittest import mock

import pytest
import torch

from tvm_rmsquant import fusion, reference, select
from tvm_rmsquant.spec import VariantSpec

from models import LlamaConfig, LlamaVLConfig, NormQuant, TinyLlama, TinyLlamaVL

#: Each model's norm -> quant sites: layer 0's input norm (no residual) and three residual ones.
EXPECTED_FUSED = 4
#: Inductor otherwise skips the contract's intermediate bf16 roundings in the unfused model.
OPTIONS = {"emulate_precision_casts": True}


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
        return TinyLlama(LlamaConfig(), device), (torch.randint(0, 512, (16,), device=device),)
    return TinyLlamaVL(LlamaVLConfig(), device), (torch.randn(4, 192, device=device).bfloat16(), torch.randint(0, 512, (12,), device=device))


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
        compiled = fusion.compile(model, fullgraph=True, options=OPTIONS)
        logits, codes = compiled(*inputs)
        torch._dynamo.reset()
        with mock.patch.object(NormQuant, "forward", _opaque_site):
            want_logits, want_codes = torch.compile(model, fullgraph=True, options=OPTIONS)(*inputs)
    assert compiled.fusion_pass.graphs == [EXPECTED_FUSED]
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
