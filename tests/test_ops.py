"""Torch ops and the dispatcher on CPU: registration, fake shapes, opcheck, torch.compile."""

from __future__ import annotations

import pytest
import torch

import tvm_rmsquant
from tvm_rmsquant import ops, reference
from tvm_rmsquant.dispatch import select
from tvm_rmsquant.spec import VariantSpec

from models import Block, TextConfig, VLConfig, VLModel

K = 256


def _inputs(rows=6, dtype=torch.bfloat16):
    return torch.randn(rows, K).to(dtype) * 3, torch.rand(K).to(dtype) + 0.5, torch.randn(rows, K).to(dtype)


@pytest.mark.parametrize("variant", ["bf16_k256_g128_row_fp32", "bf16_k256_g128_col_ue8m0", "bf16_kdyn_g64_col_ue8m0_packed", "bf16_k256_g128_row_fp32_ub"])
def test_op_matches_reference_and_fake_matches_real(variant):
    spec = VariantSpec.parse(variant)
    x, w, _ = _inputs(rows=5)
    ub = torch.tensor([2.0]) if spec.scale_ub else None
    q, scales = ops.rms_norm_group_quant(x, w, 1e-6, variant, ub)
    want_q, want_scales, _ = reference.rms_norm_group_quant(x, w, 1e-6, spec.with_hidden(K), scale_ub=ub)
    assert torch.equal(scales, want_scales) and scales.stride() == want_scales.stride()
    assert (q.view(torch.uint8) != want_q.view(torch.uint8)).sum() <= 1
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fake_q, fake_scales = ops.rms_norm_group_quant(torch.empty(5, K, dtype=torch.bfloat16), torch.empty(K, dtype=torch.bfloat16), 1e-6, variant, torch.empty(1) if ub is not None else None)
    assert fake_q.shape == q.shape and fake_q.dtype == q.dtype
    assert fake_scales.shape == scales.shape and fake_scales.stride() == scales.stride() and fake_scales.dtype == scales.dtype


def test_fused_add_updates_the_residual_in_place():
    x, w, r = _inputs()
    expected = (x.float() + r.float()).bfloat16()
    before = r.data_ptr()
    ops.fused_add_rms_norm_group_quant(x, r, w, 1e-6, "bf16_k256_g128_res_col_fp32")
    assert r.data_ptr() == before and torch.equal(r, expected)


@pytest.mark.parametrize("rows, padded", [(5, 8), (5, 5), (1, 1), (8, 8)])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_vllm_out_variant_writes_its_outputs(rows, padded, ue8m0):
    """vLLM's drop-in, called as vLLM calls it (by keyword): result, scale and the residual
    (updated in place) all against the reference, with TMA-padded (1, round_up(M, 4)) and
    vLLM's unpadded (1, M) column-major scales."""
    x, w, r = _inputs(rows=rows)
    residual_before = r.clone()
    result = torch.full((rows, K), float("nan")).to(torch.float8_e4m3fn)
    scale = torch.empty(K // 128, padded)[:, :rows].t().fill_(float("nan"))
    ops.rms_norm_per_block_quant(
        result=result, input=x, weight=w, scale=scale, epsilon=1e-6, scale_ub=None, residual=r, group_size=128,
        is_scale_transposed=True, scale_ue8m0=ue8m0,
    )
    spec = VariantSpec("bf16", K, 128, True, "col", "ue8m0" if ue8m0 else "fp32")
    want_q, want_scales, want_residual = reference.rms_norm_group_quant(x, w, 1e-6, spec, residual_before)
    assert scale.stride() == (1, padded)
    assert torch.equal(scale, want_scales) and torch.equal(result.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(r, want_residual) and not torch.equal(r, residual_before)


def test_vllm_out_variant_has_vllms_arguments():
    """vLLM 0.33's schema of _C.rms_norm_per_block_quant (the string its library registers),
    argument by argument, then one trailing defaulted argument of our own."""
    vllm = torch._C.parse_schema(
        "rms_norm_per_block_quant(Tensor! result, Tensor input, Tensor weight, Tensor! scale, float epsilon, "
        "Tensor? scale_ub, Tensor!? residual, int group_size, bool is_scale_transposed) -> ()"
    )
    ours = ops.rms_norm_per_block_quant.default._schema
    def described(argument):
        return argument.name, str(argument.type), argument.alias_info is not None and argument.alias_info.is_write
    assert [described(a) for a in ours.arguments[: len(vllm.arguments)]] == [described(a) for a in vllm.arguments]
    assert [(a.name, a.default_value) for a in ours.arguments[len(vllm.arguments):]] == [("scale_ue8m0", False)]


def test_vllm_out_variant_refuses_scales_it_cannot_write():
    x, w, r = _inputs(rows=5)
    result = torch.empty(5, K, dtype=torch.float8_e4m3fn)
    cases = [
        (torch.empty(5, 2), True, r"column-major strides \(1, ld\) with ld >= M=5, such as \(1, 5\) or \(1, 8\)"),
        (torch.empty(2, 4).t(), True, r"scale must be \(5, 2\)"),
        (torch.empty(2, 5).t(), False, r"row-major strides \(2, 1\)"),
        (torch.empty(2, 5, dtype=torch.float64).t(), True, "scale must be"),
    ]
    for scale, transposed, message in cases:
        with pytest.raises(ValueError, match=message):
            ops.rms_norm_per_block_quant(result, x, w, scale, 1e-6, None, None, 128, transposed)


@pytest.mark.parametrize(
    "op, args",
    [
        (ops.rms_norm_group_quant, lambda x, w, r: (x, w, 1e-6, "bf16_k256_g128_col_fp32")),
        (ops.fused_add_rms_norm_group_quant, lambda x, w, r: (x, r, w, 1e-6, "bf16_k256_g128_res_row_fp32")),
        (ops.add_rms_norm_group_quant, lambda x, w, r: (x, r, w, 1e-6, "bf16_k256_g128_res_col_ue8m0")),
        (ops.rms_norm_per_block_quant, lambda x, w, r: (torch.empty(6, K, dtype=torch.float8_e4m3fn), x, w, torch.empty(6, 2), 1e-6, None, r, 128, False)),
    ],
)
def test_opcheck(op, args):
    if op is ops.rms_norm_per_block_quant:
        # torch's schema checker compares a mutated tensor with allclose, which fp8 lacks;
        # the mutation annotations it would verify are checked directly below instead.
        writes = {arg.name for arg in op.default._schema.arguments if arg.alias_info is not None and arg.alias_info.is_write}
        assert writes == {"result", "scale", "residual"}
        torch.library.opcheck(op, args(*_inputs()), test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    else:
        torch.library.opcheck(op, args(*_inputs()))


def test_api_accepts_nd_and_strided_rows():
    x = torch.randn(2, 3, 2 * K).bfloat16()[..., :K]
    assert x.stride(-1) == 1 and not x.is_contiguous()
    q, scales = tvm_rmsquant.rms_norm_group_quant(x, torch.ones(K).bfloat16())
    want_q, want_scales, _ = reference.rms_norm_group_quant(x.reshape(6, K), torch.ones(K).bfloat16(), 1e-6, VariantSpec("bf16", K))
    assert q.shape == (2, 3, K) and torch.equal(scales, want_scales)


def test_select_explains_its_choice_and_refuses_1d_weights():
    kernel = select(K, torch.bfloat16, consumer="deepgemm_sm100", device="cpu")
    assert kernel.variant == "bf16_k256_g128_col_ue8m0_packed" and kernel.why[-1].taken
    with pytest.raises(ValueError, match=r"consumer_weight must be the consuming linear layer's 2-D weight \[N, K\], got shape \(256,\)"):
        select(K, torch.bfloat16, consumer="deepgemm_sm90", device="cpu", consumer_weight=torch.ones(K))
    narrow = select(K, torch.bfloat16, consumer="deepgemm_sm90", device="cpu", consumer_weight=torch.ones(100, K))
    assert narrow.spec.layout == "row" and "N % 64 == 0" in narrow.why[0].reason
    with pytest.raises(ValueError, match="consumer='nvfp4'"):
        select(K, torch.bfloat16, consumer="nvfp4", device="cpu")


def test_cuda_select_without_a_bundle_falls_back_to_the_reference_with_reasons(tmp_path, caplog, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the no-CUDA refusal, to the bundle's
    kernel = select(K, torch.bfloat16, device="cuda", bundle=tmp_path)
    assert kernel.variant is None and kernel.why[-1].name == "torch_reference" and "no bundle" in kernel.why[0].reason
    assert "using the torch reference" in caplog.text


class _GraphRecorder:
    def __init__(self):
        self.graphs = []

    def __call__(self, graph_module, example_inputs):
        self.graphs.append(graph_module)
        return graph_module.forward


def _count_ops(graphs, name):
    return sum(str(node.target).startswith(f"tvm_rmsquant.{name}") for graph in graphs for node in graph.graph.nodes)


@pytest.mark.parametrize("model_kind", ["llama", "vl"])
def test_compile_fullgraph_traces_our_op_without_graph_breaks(model_kind):
    torch.manual_seed(0)
    if model_kind == "llama":
        model = Block(TextConfig())
        inputs = (torch.randn(4, K).bfloat16(), torch.randn(4, K).bfloat16())
    else:
        model = VLModel(VLConfig())
        inputs = (torch.randn(4, 64).bfloat16(), torch.randn(4, K).bfloat16())
    eager = model(inputs[0], inputs[1].clone())
    recorder = _GraphRecorder()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recorder, fullgraph=True)
    got = compiled(inputs[0], inputs[1].clone())
    assert len(recorder.graphs) == 1
    assert _count_ops(recorder.graphs, "fused_add_rms_norm_group_quant") == 1
    torch.testing.assert_close(got, eager)


def test_compile_with_inductor_and_reduce_overhead_mode():
    torch.manual_seed(0)
    model = Block(TextConfig())
    x, r = torch.randn(4, K).bfloat16(), torch.randn(4, K).bfloat16()
    eager = model(x, r.clone())
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    torch.testing.assert_close(compiled(x, r.clone()), eager)


def test_without_the_tvm_compiler_the_cpu_op_runs_the_reference(monkeypatch):
    """The runtime needs no TVM: on CPU the op then computes the torch reference, residual included."""
    from tvm_rmsquant import cpu

    monkeypatch.setattr(cpu, "available", lambda: False)
    monkeypatch.setattr(cpu, "function", lambda spec: pytest.fail("the llvm build must not be used"))
    monkeypatch.setattr(ops, "_KERNELS", {})
    variant = "bf16_k256_g128_res_col_ue8m0_packed"
    x, w, r = _inputs(rows=4)
    got_r = r.clone()
    q, scales = ops.fused_add_rms_norm_group_quant(x, got_r, w, 1e-6, variant)
    want_q, want_scales, want_r = reference.rms_norm_group_quant(x, w, 1e-6, VariantSpec.parse(variant), r)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_scales)
    assert torch.equal(got_r, want_r) and scales.stride() == want_scales.stride()
