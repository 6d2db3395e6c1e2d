"""The vLLM plugin, inside vLLM 0.33.0's real compile stack, on the CPU.

vLLM's Python code is installed by the README's test command (tests/requirements-vllm.txt,
``--no-deps``). Its ``_C`` library cannot load without CUDA, so the ``_C`` op schemas that
its passes look up are registered here from the strings its library registers (its
published interface). Two of them run here, so they get CPU kernels:
``per_token_group_fp8_quant`` computes this package's reference quant (so the unfused eager
model is our CPU path), and ``rms_norm_per_block_quant`` the reference with fp32 scales,
as vLLM's kernel writes them whatever the consumer wants (vLLM issue #50773).

Each test compiles a model made of vLLM's own ``RMSNorm`` and ``QuantFP8`` layers with
vLLM's ``@support_torch_compile``, which drives Dynamo with a symbolic token count through
``VllmBackend`` and its ``PostGradPassManager``; our pass is named in
``CompilationConfig.inductor_passes`` as a user names it. Two seams stand in for the GPU:
``QuantFP8`` takes its CUDA path (``forward_cuda``, which calls ``_C.per_token_group_fp8_quant``
as on a GPU), and the pass manager is given vLLM's norm+quant fusion pass, which it imports
only on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import NO_TOOLCHAIN_ENV
from tvm_rmsquant import reference
from tvm_rmsquant.spec import VariantSpec

HIDDEN, GROUP = 256, 128
#: M % 4 != 0 (vLLM's unpadded (1, M) scales), a single token, and a multiple of 4, from one compile.
ROWS = (5, 1, 3, 17, 8)

#: vLLM 0.33.0's ``_C`` schemas its passes touch (``strings _C_stable_libtorch.abi3.so``).
VLLM_C_SCHEMAS = (
    "per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, float eps, float fp8_min, "
    "float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, bool dummy_is_tma_aligned) -> ()",
    "rms_norm_per_block_quant(Tensor! result, Tensor input, Tensor weight, Tensor! scale, float epsilon, Tensor? scale_ub, "
    "Tensor!? residual, int group_size, bool is_scale_transposed) -> ()",
    "rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()",
    "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()",
    "rms_norm_static_fp8_quant(Tensor! result, Tensor input, Tensor weight, Tensor scale, float epsilon) -> ()",
    "fused_add_rms_norm_static_fp8_quant(Tensor! result, Tensor input, Tensor! residual, Tensor weight, Tensor scale, float epsilon) -> ()",
    "rms_norm_dynamic_per_token_quant(Tensor! result, Tensor input, Tensor weight, Tensor! scale, float epsilon, Tensor? scale_ub, "
    "Tensor!? residual) -> ()",
    "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, Tensor cos_sin_cache, bool is_neox, "
    "int rope_dim_offset=0, bool inverse=False) -> ()",
    "silu_and_mul(Tensor! result, Tensor input) -> ()",
    "silu_and_mul_quant(Tensor! result, Tensor input, Tensor scale) -> ()",
    "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, int[]? group_shape=None) -> ()",
    "dynamic_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale) -> ()",
    "dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale, Tensor? scale_ub) -> ()",
    "fused_qk_norm_rope(Tensor! qkv, int num_heads_q, int num_heads_k, int num_heads_v, int head_dim, float eps, Tensor q_weight, "
    "Tensor k_weight, Tensor cos_sin_cache, bool is_neox, Tensor position_ids, int forced_token_heads_per_warp=-1) -> ()",
)


def _spec(x, group_size, col, ue8m0, residual=False) -> VariantSpec:
    return VariantSpec(reference.DTYPE_NAMES[x.dtype], x.shape[-1], group_size, residual, "col" if col else "row", "ue8m0" if ue8m0 else "fp32")


def _group_quant_cpu(input, output_q, output_s, group_size, eps, fp8_min, fp8_max, scale_ue8m0, dummy_is_scale_transposed, dummy_is_tma_aligned):
    q, scales = reference.group_quant(input.float(), _spec(input, group_size, dummy_is_scale_transposed, scale_ue8m0))
    output_q.copy_(q)
    output_s.copy_(scales)


def _vllm_fused_cpu(result, input, weight, scale, epsilon, scale_ub, residual, group_size, is_scale_transposed):
    spec = _spec(input, group_size, is_scale_transposed, False, residual is not None)
    q, scales, updated = reference.rms_norm_group_quant(input, weight, epsilon, spec, residual)
    result.copy_(q)
    scale.copy_(scales)
    if residual is not None:
        residual.copy_(updated)


@pytest.fixture(scope="module")
def vllm_stack():
    """vLLM's modules, imported as on a CPU-only vLLM install, with the ``_C`` schemas registered."""
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        if os.environ.get(NO_TOOLCHAIN_ENV) == "1":
            pytest.skip(f"{NO_TOOLCHAIN_ENV}=1 and vLLM is not installed")
        pytest.fail(f"vLLM is not installed ({error}); the README's test command installs tests/requirements-vllm.txt", pytrace=False)
    if torch.cuda.is_available():
        pytest.skip("this tier stands in for CUDA with CPU kernels; on a GPU it would shadow vLLM's _C library")
    library = torch.library.Library("_C", "FRAGMENT")
    for schema in VLLM_C_SCHEMAS:
        if not hasattr(torch.ops._C, schema.split("(")[0]):
            library.define(schema)
    library.impl("per_token_group_fp8_quant", _group_quant_cpu, "CPU")
    library.impl("rms_norm_per_block_quant", _vllm_fused_cpu, "CPU")
    for name in ("per_token_group_fp8_quant", "rms_norm_per_block_quant"):
        torch.library.register_fake(f"_C::{name}", lambda *args, **kwargs: None, lib=library)

    import vllm.compilation.passes.pass_manager as pass_manager
    from vllm.compilation.passes.fusion.rms_quant_fusion import RMSNormQuantFusionPass
    from vllm.model_executor.kernels.linear.scaled_mm import deep_gemm  # registers vllm::fp8_gemm_nt_op

    # pass_manager imports the fusion pass only on CUDA or XPU (a NameError on CPU otherwise).
    pass_manager.RMSNormQuantFusionPass = RMSNormQuantFusionPass
    yield deep_gemm
    library._destroy()


def _config(vllm_fusion: bool, ours: bool):
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig
    from vllm.config.compilation import PassConfig

    compilation = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        compile_sizes=[],
        custom_ops=["+rms_norm", "+quant_fp8"],
        pass_config=PassConfig(fuse_norm_quant=vllm_fusion, fuse_act_quant=False),
        inductor_passes={"post_grad_custom_post_pass": "tvm_rmsquant.vllm_post_pass"} if ours else {},
    )
    config = VllmConfig(compilation_config=compilation)
    # CpuPlatform turns VLLM_COMPILE into a plain Dynamo trace; the GPU path is what is tested.
    config.compilation_config.mode = CompilationMode.VLLM_COMPILE
    return config


def _model_class(deep_gemm):
    from vllm.compilation.decorators import support_torch_compile
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    @support_torch_compile(dynamic_arg_dims={"x": 0, "residual": 0})
    class TwoSites(torch.nn.Module):
        """An input norm (no residual) and a post-attention norm (residual), each feeding a
        quant; with ``gemm``, each quant's output feeds DeepGEMM's linear op."""

        def __init__(self, *, vllm_config, prefix="", col=True, tma=False, ue8m0=False, gemm_e8m0=None):
            super().__init__()
            torch.manual_seed(0)
            self.norms = torch.nn.ModuleList([RMSNorm(HIDDEN, eps=1e-6) for _ in range(2)])
            for norm in self.norms:
                norm.weight.data = (1 + 0.1 * torch.randn(HIDDEN)).bfloat16()
            self.quant = QuantFP8(False, GroupShape(1, GROUP), column_major_scales=col, tma_aligned_scales=tma, use_ue8m0=ue8m0)
            self.quant._forward_method = self.quant.forward_cuda  # as on a GPU: vLLM's _C group quant
            self.gemm_e8m0 = gemm_e8m0
            self.weight = (torch.randn(HIDDEN, HIDDEN) * 0.1).to(torch.float8_e4m3fn)
            self.weight_scale = torch.rand(HIDDEN // GROUP, HIDDEN // GROUP) + 0.5

        def forward(self, x: torch.Tensor, residual: torch.Tensor):
            outputs = []
            for y in (self.norms[0](x), self.norms[1](x * 0.5, residual)):
                if isinstance(y, tuple):
                    y, residual = y
                q, scales = self.quant(y)
                outputs += [q, scales]
                if self.gemm_e8m0 is not None:
                    out = torch.empty(q.shape[0], HIDDEN, dtype=torch.bfloat16)
                    torch.ops.vllm.fp8_gemm_nt_op(q, scales, self.weight, self.weight_scale, out, self.gemm_e8m0)
                    outputs.append(out)
            return (*outputs, residual)

    return TwoSites


def _deepgemm_cpu(a, b, out, is_deep_gemm_e8m0_used=False):
    """DeepGEMM's block-scaled GEMM in torch. With E8M0 on, DeepGEMM reads each activation
    scale as a power of two; one that is not would be read wrong, so it is refused here."""
    (q, scales), (weight, weight_scale) = a, b
    if is_deep_gemm_e8m0_used:
        mantissa = scales.contiguous().view(torch.int32) & 0x7FFFFF
        if (mantissa != 0).any():
            raise AssertionError("DeepGEMM with E8M0 got activation scales that are not powers of two")
    x = q.float() * scales.repeat_interleave(GROUP, dim=1)
    w = weight.float() * weight_scale.repeat_interleave(GROUP, dim=0).repeat_interleave(GROUP, dim=1)
    out.copy_(x @ w.t())


def _run(vllm_stack, tmp_path, monkeypatch, vllm_fusion, ours=True, **layer):
    """Compile once, run at every M of ROWS; return (compiled outputs, eager outputs) per M and the pass's reports."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    import tvm_rmsquant.vllm as plugin

    # A cached compile skips every pass.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    real_platform = fp8_utils.current_platform

    class CudaAlike:
        """vLLM's platform, except that fp8_utils calls its ``_C`` group quant, as on CUDA."""

        def __getattr__(self, name):
            return getattr(real_platform, name)

        def is_cuda_alike(self):
            return True

    monkeypatch.setattr(fp8_utils, "current_platform", CudaAlike())
    monkeypatch.setattr(vllm_stack, "fp8_gemm_nt", _deepgemm_cpu)
    plugin.REPORTS.clear()
    config = _config(vllm_fusion, ours)
    results = []
    with set_current_vllm_config(config):
        model = _model_class(vllm_stack)(vllm_config=config, **layer)
        for rows in ROWS:
            torch.manual_seed(rows)
            x = torch.randn(rows, HIDDEN).bfloat16()
            residual = torch.randn(rows, HIDDEN).bfloat16()
            model.do_not_compile = True
            eager = model(x, residual.clone())
            model.do_not_compile = False
            with set_forward_context(None, config):
                compiled = model(x, residual.clone())
            results.append((rows, compiled, eager))
    return results, list(plugin.REPORTS)


def _assert_identical(results):
    for rows, compiled, eager in results:
        for got, want in zip(compiled, eager):
            assert got.shape == want.shape and got.stride() == want.stride(), (rows, got.stride(), want.stride())
            if got.dtype == torch.float8_e4m3fn:
                got, want = got.view(torch.uint8), want.view(torch.uint8)
            assert torch.equal(got, want), f"M={rows}: compiled differs from the unfused eager model"


@pytest.mark.parametrize("vllm_fusion", [False, True], ids=["unfused", "vllm_fused"])
@pytest.mark.parametrize("col, tma", [(True, False), (True, True), (False, False)], ids=["col", "col_tma", "row"])
def test_every_site_runs_on_our_op_and_matches_unfused_eager(vllm_stack, tmp_path, monkeypatch, vllm_fusion, col, tma):
    """Both sites, from vLLM's fused op or from the unfused pair, become our op with the
    variant of vLLM's layout, in one compile that serves every M; results are bit-identical
    to the unfused eager model, scales in vLLM's own strides ((1, M) unpadded at M % 4 != 0)."""
    results, reports = _run(vllm_stack, tmp_path, monkeypatch, vllm_fusion, col=col, tma=tma)
    layout = "col" if col else "row"
    source = ["_C::rms_norm_per_block_quant"] * 2 if vllm_fusion else [
        "vllm_ir::rms_norm + _C::per_token_group_fp8_quant", "vllm_ir::fused_add_rms_norm + _C::per_token_group_fp8_quant"]
    assert len(reports) == 1, "one compile serves every M"
    assert reports[0].kept == []
    assert sorted(reports[0].rewritten) == sorted(zip(source, [f"bf16_k256_g128_{layout}_fp32", f"bf16_k256_g128_res_{layout}_fp32"]))
    _assert_identical(results)
    unpadded = [scales.stride() for rows, (q, scales, *rest), _ in results if col and not tma and rows % 4]
    assert all(stride == (1, rows) for stride, rows in zip(unpadded, [r for r in ROWS if r % 4]))


def test_ue8m0_asked_by_the_quant_gives_powers_of_two(vllm_stack, tmp_path, monkeypatch):
    """vLLM's fusion off: the quant's own scale_ue8m0 picks our UE8M0 variant."""
    results, reports = _run(vllm_stack, tmp_path, monkeypatch, vllm_fusion=False, ue8m0=True)
    assert sorted(variant for _, variant in reports[0].rewritten) == ["bf16_k256_g128_col_ue8m0", "bf16_k256_g128_res_col_ue8m0"]
    _assert_identical(results)
    for _, (_, scales, _, scales_res, _), _ in results:
        for s in (scales, scales_res):
            assert (s.contiguous().view(torch.int32) & 0x7FFFFF == 0).all()


def test_deepgemm_e8m0_consumer_gets_powers_of_two_from_vllms_fused_op(vllm_stack, tmp_path, monkeypatch):
    """The vLLM bug, fixed from outside: vLLM's fusion replaces a UE8M0 quant feeding
    DeepGEMM (E8M0 on) with its fused kernel, which writes fp32 scales. Without our pass the
    GEMM gets scales that are not powers of two; with it, the site becomes our UE8M0 variant,
    chosen from the consuming GEMM's own flag, and the GEMM output equals the unfused eager one."""
    with pytest.raises(Exception, match="not powers of two"):
        _run(vllm_stack, tmp_path / "vllm_only", monkeypatch, vllm_fusion=True, ours=False, ue8m0=True, gemm_e8m0=True)
    results, reports = _run(vllm_stack, tmp_path / "ours", monkeypatch, vllm_fusion=True, ue8m0=True, gemm_e8m0=True)
    assert sorted(reports[0].rewritten) == [("_C::rms_norm_per_block_quant", "bf16_k256_g128_col_ue8m0"),
                                            ("_C::rms_norm_per_block_quant", "bf16_k256_g128_res_col_ue8m0")]
    _assert_identical(results)


def test_a_norm_output_used_elsewhere_keeps_vllms_nodes_and_says_why(vllm_stack, tmp_path, monkeypatch):
    from tvm_rmsquant import vllm as plugin

    graph = torch.fx.Graph()
    x, weight = graph.placeholder("x"), graph.placeholder("weight")
    for node, value in ((x, torch.empty(4, HIDDEN, dtype=torch.bfloat16)), (weight, torch.empty(HIDDEN, dtype=torch.bfloat16))):
        node.meta["val"] = value
    norm = graph.call_function(torch.ops.vllm_ir.rms_norm.default, (x, weight, 1e-6, None))
    q = graph.call_function(torch.ops.aten.empty.memory_format, ([4, HIDDEN],), {"dtype": torch.float8_e4m3fn})
    s = graph.call_function(torch.ops.aten.empty.memory_format, ([4, HIDDEN // GROUP],), {"dtype": torch.float32})
    quant = graph.call_function(torch.ops.higher_order.auto_functionalized, (torch.ops._C.per_token_group_fp8_quant.default,), dict(
        input=norm, output_q=q, output_s=s, group_size=GROUP, eps=1e-10, fp8_min=-448.0, fp8_max=448.0, scale_ue8m0=False,
        dummy_is_scale_transposed=False, dummy_is_tma_aligned=False))
    graph.output((quant, norm))
    report = plugin.post_pass(graph)
    assert report.rewritten == [] and report.kept == [f"{quant.name}: the normalized activations are also used elsewhere"]
    assert quant in graph.nodes


def test_the_plugin_is_found_by_vllms_loader_and_the_pass_by_its_config(vllm_stack, caplog):
    """The entry point in pyproject, as vLLM's loader finds it, and the pass name as
    CompilationConfig resolves it."""
    from vllm.compilation.passes.inductor_pass import CallableInductorPass
    from vllm.plugins import load_plugins_by_group

    import tvm_rmsquant

    plugins = load_plugins_by_group("vllm.general_plugins")
    assert "tvm_rmsquant" in plugins
    with caplog.at_level("INFO", logger="vllm.tvm_rmsquant"):
        plugins["tvm_rmsquant"]()
    assert "tvm_rmsquant.vllm_post_pass" in caplog.text
    resolved = _config(vllm_fusion=False, ours=True).compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
    assert isinstance(resolved, CallableInductorPass) and resolved.callable is tvm_rmsquant.vllm_post_pass
