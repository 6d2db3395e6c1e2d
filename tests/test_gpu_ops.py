"""GPU: the ops with the bundle's kernels under opcheck, CUDA graphs, side streams and torch.compile."""

from __future__ import annotations

import pytest
import torch

from tvm_rmsquant import ops, reference
from tvm_rmsquant.checks import compare, random_inputs
from tvm_rmsquant.dispatch import select
from tvm_rmsquant.spec import VariantSpec

from models import Block, TextConfig

pytestmark = pytest.mark.gpu
K = 4096
SPEC = VariantSpec("bf16", K, 128, True, "col", "ue8m0")


def _check(spec, x, w, r_before, got):
    want = reference.rms_norm_group_quant(x.cpu(), w.cpu(), 1e-6, spec, r_before.cpu())
    agreement = compare(spec, got, want, x.shape[1])
    assert agreement.passed, agreement.describe()


def test_cuda_calls_of_the_allocating_ops_run_their_cpp_implementation(gpu_bundle):
    """One dispatcher entry per eager call: torch_ops.cpp's kernels, not the Python fallback."""
    kernel = select(K, torch.bfloat16, residual=True, scale_layout="col", scale_format="ue8m0", bundle=gpu_bundle.root)
    assert kernel.kernel is None and "through the C++ torch op" in kernel.why[-1].reason, kernel.why
    for op in ("rms_norm_group_quant", "fused_add_rms_norm_group_quant", "add_rms_norm_group_quant"):
        table = torch._C._dispatch_dump(f"tvm_rmsquant::{op}")
        cuda = next(line for line in table.splitlines() if line.startswith("CUDA"))
        assert "torch_ops.cpp" in cuda, table
    inputs = random_inputs(SPEC, 70, K, seed=6, device="cuda")
    residual = inputs["residual"].clone()
    q, scales, residual_out = ops.add_rms_norm_group_quant(inputs["x"], residual, inputs["weight"], 1e-6, SPEC.name)
    assert torch.equal(residual, inputs["residual"]), "the functional form must leave its residual input alone"
    _check(SPEC, inputs["x"], inputs["weight"], inputs["residual"], (q, scales, residual_out))


def test_opcheck_on_cuda(gpu_bundle):
    ops.use_bundle(gpu_bundle)
    inputs = random_inputs(SPEC, 33, K, seed=1, device="cuda")
    torch.library.opcheck(ops.fused_add_rms_norm_group_quant, (inputs["x"], inputs["residual"], inputs["weight"], 1e-6, SPEC.name))
    plain = VariantSpec("bf16", K, 128, layout="col")
    torch.library.opcheck(ops.rms_norm_group_quant, (inputs["x"], inputs["weight"], 1e-6, plain.name))
    torch.library.opcheck(ops.add_rms_norm_group_quant, (inputs["x"], inputs["residual"], inputs["weight"], 1e-6, SPEC.name))


def test_graph_replay_with_new_inputs_gives_fresh_correct_outputs(gpu_bundle):
    kernel = select(K, torch.bfloat16, residual=True, scale_layout="col", scale_format="ue8m0", bundle=gpu_bundle.root)
    assert kernel.variant == SPEC.name
    static = random_inputs(SPEC, 64, K, seed=2, device="cuda")
    x, w, r = static["x"], static["weight"], static["residual"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel(x, w, residual=r.clone())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, scales = kernel(x, w, residual=r)
    for seed in (3, 4):
        fresh = random_inputs(SPEC, 64, K, seed=seed, device="cuda")
        x.copy_(fresh["x"])
        r.copy_(fresh["residual"])
        graph.replay()
        torch.cuda.synchronize()
        _check(SPEC, fresh["x"], w, fresh["residual"], (q, scales, r))


def test_side_stream_produce_run_consume_without_synchronization(gpu_bundle):
    kernel = select(K, torch.bfloat16, residual=True, scale_layout="col", scale_format="ue8m0", bundle=gpu_bundle.root)
    inputs = random_inputs(SPEC, 2048, K, seed=5, device="cpu")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # Produce on the side stream (a big copy, then elementwise work), run, consume.
        x = inputs["x"].to("cuda", non_blocking=False).float().mul_(1.0).to(torch.bfloat16)
        r = inputs["residual"].to("cuda").float().mul_(1.0).to(torch.bfloat16)
        w = inputs["weight"].to("cuda")
        q, scales = kernel(x, w, residual=r)
        consumed = (q.float() * 2).sum()
        outputs = (q.clone(), scales.clone(), r.clone())
    stream.synchronize()
    assert torch.isfinite(consumed)
    _check(SPEC, inputs["x"], inputs["weight"], inputs["residual"], outputs)


@pytest.mark.parametrize("layout, fmt", [("row", "fp32"), ("col", "fp32"), ("col", "ue8m0"), ("col", "ue8m0_packed")])
@pytest.mark.parametrize("residual", [False, True])
def test_bound_kernels_give_the_reference_layout_and_values_at_every_m(gpu_bundle, layout, fmt, residual):
    """select()'s kernel: the reference's shapes, strides and dtypes and right values, at M on
    both sides of the tuned M <= 64 kernels (picked in C++) and of a TMA row pad."""
    kernel = select(K, torch.bfloat16, residual=residual, scale_layout=layout, scale_format=fmt, bundle=gpu_bundle.root)
    assert kernel.variant == kernel.spec.name, kernel.why
    for rows in (0, 1, 3, 64, 65, 300):
        inputs = random_inputs(kernel.spec, rows, K, seed=rows, device="cuda")
        x, w, r = inputs["x"], inputs["weight"], inputs["residual"]
        want = reference.rms_norm_group_quant(x.cpu(), w.cpu(), 1e-6, kernel.spec, None if r is None else r.cpu())
        q, scales = kernel(x, w, residual=r)
        torch.cuda.synchronize()
        empty = reference.empty_scales(kernel.spec, rows, K, "cuda")
        assert (scales.shape, scales.stride(), scales.dtype) == (empty.shape, empty.stride(), empty.dtype), rows
        assert (q.shape, q.stride(), q.dtype) == (x.shape, x.stride(), torch.float8_e4m3fn), rows
        agreement = compare(kernel.spec, (q, scales, r), want, K)
        assert agreement.passed, (rows, agreement.describe())


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_block_on_cuda_matches_eager(gpu_bundle, mode):
    torch.manual_seed(0)
    model = Block(TextConfig(hidden_size=1024, intermediate_size=2048), device="cuda").cuda()
    assert model.quant.variant is not None, model.quant.why
    x, r = torch.randn(8, 1024, device="cuda").bfloat16(), torch.randn(8, 1024, device="cuda").bfloat16()
    eager = model(x, r.clone())
    torch._dynamo.reset()
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    for _ in range(3):
        got = compiled(x, r.clone())
    torch.testing.assert_close(got, eager)
