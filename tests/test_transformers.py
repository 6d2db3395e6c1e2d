"""transformers' own FP8 models on tvm_rmsquant's kernels (``tvm_rmsquant.integrations.transformers``).

Tiny Qwen3 (text) and Qwen2.5-VL (a vision tower with RMSNorm at another hidden size than its
text tower) models are built from configs with random weights, saved to a temporary folder
and reloaded with ``FineGrainedFP8Config``: transformers quantizes the weights itself, in
128 x 128 blocks. Nothing is downloaded.

On the CPU, transformers refuses to quantize without a GPU, so the reload runs with
``torch.cuda.is_available`` and ``get_device_capability`` answering as an H200 would (the
quantization itself is plain torch), and the integration multiplies with its dequantized
GEMM: site discovery, refusals, the fused/unfused/bf16 agreement and torch.compile are
checked here on transformers' classes. Marked ``gpu``: the same models on CUDA, through the
bundle's kernels and torch's cuBLAS ``scaled_mm``.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (tests/requirements-vllm.txt)")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    FineGrainedFP8Config,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tvm_rmsquant.integrations.transformers import FUSED_BLOCKS, BlockFP8Linear, FusedRMSNormQuant, install  # noqa: E402

TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=512)
VISION_HIDDEN = 128
#: Token ids of the tiny VL config (inside its 512-token vocabulary).
IMAGE, VISION_START, VISION_END = 500, 502, 503


def _qwen3():
    return Qwen3ForCausalLM(Qwen3Config(head_dim=64, **TEXT))


def _vl():
    config = Qwen2_5_VLConfig(
        text_config=dict(**TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}),
        vision_config=dict(depth=2, hidden_size=VISION_HIDDEN, intermediate_size=256, num_heads=2, out_hidden_size=TEXT["hidden_size"],
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=501, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        bos_token_id=1, eos_token_id=2,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


BUILDERS = {"qwen3": (_qwen3, AutoModelForCausalLM), "qwen2_5_vl": (_vl, Qwen2_5_VLForConditionalGeneration)}


@contextlib.contextmanager
def _quantizable_here(device: str):
    """transformers quantizes FP8 weights only where it sees a GPU of capability >= 8.9; its
    quantization is plain torch, so on the CPU it is told it has one."""
    if device == "cuda":
        yield
        return
    with mock.patch("torch.cuda.is_available", return_value=True), mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each tiny model, bf16 with random weights, saved once: {kind: folder}."""
    folders = {}
    for kind, (build, _) in BUILDERS.items():
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(kind)
        build().to(torch.bfloat16).save_pretrained(folder)
        folders[kind] = folder
    return folders


def _load(saved, kind, device="cpu", quantized=True, **config):
    loader = BUILDERS[kind][1]
    kwargs = dict(dtype=torch.bfloat16)
    if quantized:
        kwargs["quantization_config"] = FineGrainedFP8Config(**config)
    if device == "cuda":
        kwargs["device_map"] = "cuda"
    with _quantizable_here(device):
        return loader.from_pretrained(saved[kind], **kwargs).eval()


def _image_inputs(device):
    """One 4 x 4-patch image (4 merged tokens) between text tokens."""
    generator = torch.Generator().manual_seed(5)
    pixels = torch.randn(16, 3 * 2 * 14 * 14, generator=generator).bfloat16().to(device)
    ids = torch.tensor([[1, 9, VISION_START] + [IMAGE] * 4 + [VISION_END, 7, 8, 11]], device=device)
    return dict(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 4]], device=device))


def _cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def fp8_step(value: torch.Tensor) -> torch.Tensor:
    """One float8_e4m3fn code step at |value| (3 mantissa bits; its subnormal step below 2^-6)."""
    magnitude = value.float().abs().clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - 3)


def _within_one_fp8_step(fused, unfused):
    return bool(((fused.float() - unfused.float()).abs() <= fp8_step(torch.maximum(fused.float().abs(), unfused.float().abs()))).all())


# -- the fusion table against transformers' own data flow ----------------------------------------


class _Uses(torch.overrides.TorchFunctionMode):
    """Every torch function applied to one of ``watched`` (by identity: each is kept alive in
    ``watched``, so that no later tensor reuses its id), with its weight if a linear."""

    def __init__(self):
        super().__init__()
        self.watched = {}
        self.uses = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for arg in list(args) + list(kwargs.values()):
            if isinstance(arg, torch.Tensor) and id(arg) in self.watched:
                weight = args[1] if func is torch.nn.functional.linear else None
                self.uses.append((self.watched[id(arg)][0], func, weight))
        return func(*args, **kwargs)


DECODERS = {
    "LlamaDecoderLayer": lambda: LlamaForCausalLM(LlamaConfig(**TEXT)),
    "Qwen2DecoderLayer": lambda: Qwen2ForCausalLM(Qwen2Config(**TEXT)),
    "Qwen3DecoderLayer": _qwen3,
}


@pytest.mark.parametrize("block_class", sorted(FUSED_BLOCKS))
def test_each_fused_norm_feeds_its_linears_and_nothing_else(block_class):
    """``FUSED_BLOCKS`` claims each norm's output goes to exactly the listed linears: run the
    block's model and record every torch function applied to each norm's output."""
    model = (DECODERS.get(block_class) or _vl)().to(torch.bfloat16).eval()
    mode = _Uses()
    expected = {}
    hooks = []
    for block_name, block in model.named_modules():
        if type(block).__name__ != block_class:
            continue
        for norm_attr, consumers in FUSED_BLOCKS[block_class]:
            norm_name = f"{block_name}.{norm_attr}"
            expected[norm_name] = {id(block.get_submodule(path).weight) for path in consumers}

            def watch(module, inputs, output, norm_name=norm_name):
                mode.watched[id(output)] = (norm_name, output)

            hooks.append(block.get_submodule(norm_attr).register_forward_hook(watch))
    assert expected, f"no {block_class} in the model"
    inputs = _image_inputs("cpu") if block_class.startswith("Qwen2_5_VL") else dict(input_ids=torch.tensor([[1, 5, 9, 3]]))
    with torch.no_grad(), mode:
        model(**inputs)
    for hook in hooks:
        hook.remove()
    metadata = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__}
    for norm_name, weights in expected.items():
        uses = [(func, weight) for name, func, weight in mode.uses if name == norm_name]
        linear_weights = {id(weight) for func, weight in uses if func is torch.nn.functional.linear}
        others = [getattr(func, "__name__", str(func)) for func, _ in uses if func is not torch.nn.functional.linear and func not in metadata]
        assert linear_weights == weights, f"{norm_name} feeds other linears than the table says"
        assert not others, f"{norm_name}'s output also goes to {others}"


# -- site discovery and the working paths, on the CPU -------------------------------------------


def test_a_text_decoder_is_fused_at_every_norm_that_feeds_linears(saved):
    model = _load(saved, "qwen3")
    originals = {name: (module.weight, module.weight_scale_inv) for name, module in model.named_modules() if type(module).__name__ == "FP8Linear"}
    report = install(model)
    layers = TEXT["num_hidden_layers"]
    assert len(report.sites) == 7 * layers and report.count("fused") == 5 * layers and report.count("standalone") == 2 * layers
    assert report.unfused_norms == []
    assert [why for _, why in install(_load(saved, "qwen3"), fuse=False).unfused_norms] == ["fuse=False"] * 2 * layers
    fused = {site.name.rsplit(".", 2)[-2] + "." + site.name.rsplit(".", 1)[-1] for site in report.sites if site.quant == "fused"}
    assert fused == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"}
    for site in report.sites:
        expected = "bf16_k256_g128_col_dense_fp32" if site.quant == "fused" else f"bf16_k{512 if 'down_proj' in site.name else 256}_g128_nonorm_col_dense_fp32"
        assert site.variant == expected and site.gemm == "dequantized" and "CUDA" in site.why, site
        module = model.get_submodule(site.name)
        assert isinstance(module, BlockFP8Linear)
        assert module.weight is originals[site.name][0] and module.weight_scale_inv is originals[site.name][1]
    assert isinstance(model.model.layers[0].input_layernorm, FusedRMSNormQuant)
    assert type(model.model.norm).__name__ == "Qwen3RMSNorm" and type(model.lm_head) is torch.nn.Linear
    text = str(report)
    assert text.startswith("tvm_rmsquant: 14 FP8 linears: 10 fused into their RMSNorm, 4 standalone quant, 0 unserved")


def _logits(model, **inputs):
    with torch.no_grad():
        return model(**inputs).logits.float()


@pytest.mark.parametrize("kind", ["qwen3", "qwen2_5_vl"])
def test_logits_match_the_unfused_path_and_the_bf16_model(saved, kind):
    fused, unfused = _load(saved, kind), _load(saved, kind)
    install(fused)
    install(unfused, fuse=False)
    bf16 = _load(saved, kind, quantized=False)
    inputs = _image_inputs("cpu") if kind == "qwen2_5_vl" else dict(input_ids=torch.tensor([[1, 17, 33, 5, 250, 9, 2]]))
    got, reference_path, full = _logits(fused, **inputs), _logits(unfused, **inputs), _logits(bf16, **inputs)
    assert _within_one_fp8_step(got, reference_path)
    assert _cosine(got, full) >= 0.99


def test_a_vl_model_gets_its_own_variant_and_layout_per_tower(saved):
    """The seed's case: RMSNorm at 128 in the vision tower and 256 in the text tower, each
    site's variant chosen at init for its own hidden size and its GEMM's layout."""
    model = _load(saved, "qwen2_5_vl")
    report = install(model, consumers={"model.visual": "row"})
    vision = [site for site in report.sites if site.name.startswith("model.visual.")]
    text = [site for site in report.sites if site.name.startswith("model.language_model.")]
    assert {site.variant for site in vision if site.quant == "fused"} == {f"bf16_k{VISION_HIDDEN}_g128_row_fp32"}
    assert {site.variant for site in text if site.quant == "fused"} == {"bf16_k256_g128_col_dense_fp32"}
    assert sum(site.quant == "fused" for site in vision) == 2 * 3 and sum(site.quant == "fused" for site in text) == 2 * 5
    merger = [site for site in vision if ".merger." in site.name]
    assert merger and all(site.quant == "standalone" for site in merger)  # ln_q's output is reshaped first: not fused
    full = _logits(_load(saved, "qwen2_5_vl", quantized=False), **_image_inputs("cpu"))
    assert _cosine(_logits(model, **_image_inputs("cpu")), full) >= 0.99


def test_sites_it_cannot_serve_keep_a_working_path_and_say_why(saved):
    model = _load(saved, "qwen3")
    layers = model.model.layers
    layers[0].post_attention_layernorm.weight.data = layers[0].post_attention_layernorm.weight.data.float()  # Gemma-style fp32
    layers[1].post_attention_layernorm.weight.data = layers[1].post_attention_layernorm.weight.data.half()  # no kernel takes this
    report = install(model)
    assert dict(report.unfused_norms) == {
        "model.layers.1.post_attention_layernorm": "the norm weight is torch.float16 and the activations torch.bfloat16; the kernels "
                                                   "take the activations' dtype or fp32, so its linears take the standalone quant of what it returns"}
    assert type(layers[0].post_attention_layernorm).__name__ == "FusedRMSNormQuant"
    sites = {site.name: site for site in report.sites}
    assert sites["model.layers.0.mlp.gate_proj"].quant == "fused"
    assert sites["model.layers.0.mlp.gate_proj"].variant == "bf16_k256_g128_wf32_col_dense_fp32"  # the mixed-dtype kernel
    assert sites["model.layers.1.mlp.gate_proj"].quant == "standalone"
    assert sites["model.layers.1.mlp.gate_proj"].variant == "bf16_k256_g128_nonorm_col_dense_fp32"  # its fp32 input cast to bf16
    assert type(layers[1].post_attention_layernorm).__name__ == "Qwen3RMSNorm"
    assert torch.isfinite(_logits(model, input_ids=torch.tensor([[1, 2, 3]]))).all()

    # Weight blocks of 64 are not the activation groups of 128 this package quantizes for.
    blocks64 = _load(saved, "qwen3", weight_block_size=(64, 64))
    report = install(blocks64)
    assert report.count("unserved") == len(report.sites) and report.count("fused") == 0
    assert all("block_size=(64, 64)" in site.why for site in report.sites)
    assert all("not FP8 linears" in why or "cannot take a quantized activation" in why for _, why in report.unfused_norms)
    assert _cosine(_logits(blocks64, input_ids=torch.tensor([[1, 2, 3]])), _logits(_load(saved, "qwen3", quantized=False), input_ids=torch.tensor([[1, 2, 3]]))) >= 0.99


def test_fp32_norm_weights_fuse_through_the_mixed_dtype_kernels(saved):
    """Gemma/Qwen-style fp32 norm weights: fused with the _wf32 kernels (vLLM's rule: one rounding
    after the fp32 multiply), where transformers' norm returns the fp32 product and the unfused
    path casts it to bf16 before the quant. The two roundings differ, so the bar is not one fp8
    step but the one fp8 itself meets against bf16 (cosine >= 0.99; measured 0.9986 here). The
    unquantized model cannot run these weights: transformers' nn.Linear refuses the fp32 norm output."""

    def with_fp32_norm_weights():
        model = _load(saved, "qwen3")
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.data = norm.weight.data.float() * 1.001  # not representable in bf16
        return model

    fused, unfused = with_fp32_norm_weights(), with_fp32_norm_weights()
    report = install(fused)
    install(unfused, fuse=False)
    assert report.count("fused") == 5 * TEXT["num_hidden_layers"]
    assert {site.variant for site in report.sites if site.quant == "fused"} == {"bf16_k256_g128_wf32_col_dense_fp32"}
    ids = torch.tensor([[1, 17, 33, 5, 250, 9, 2]])
    assert _cosine(_logits(fused, input_ids=ids), _logits(unfused, input_ids=ids)) >= 0.99


def test_consumers_are_checked_and_a_norm_is_fused_only_for_one_layout(saved):
    with pytest.raises(ValueError, match=r"consumers\['model'\]='cublas_mxfp8' scales groups of 32"):
        install(_load(saved, "qwen3"), consumers={"model": "cublas_mxfp8"})
    with pytest.raises(ValueError, match=r"consumers\['model'\]='nope' is unknown"):
        install(_load(saved, "qwen3"), consumers={"model": "nope"})
    model = _load(saved, "qwen3")
    report = install(model, consumers={"model.layers.0.self_attn.k_proj": "triton"})
    assert ("model.layers.0.input_layernorm", "its linears read different consumers' layouts (cublas_blockwise, triton): "
            "one quantized output cannot serve them") in report.unfused_norms
    assert {site.name: site.variant for site in report.sites}["model.layers.0.self_attn.k_proj"] == "bf16_k256_g128_nonorm_row_fp32"


def _triton():
    """triton, where it is installed (the GPU machine), as a one-element tuple; else ()."""
    try:
        import triton
    except ImportError:
        return ()
    return (triton,)


#: Where torch and the compiler it drives live: Dynamo, Inductor and Triton (its backends'
#: drivers, seen on the H200) query the device for their own use.
_COMPILER_DIRS = tuple(os.path.dirname(module.__file__) + os.sep for module in (torch, *_triton()))
DEVICE_QUERIES = ("is_available", "get_device_capability", "get_device_properties", "current_device", "device_count")


@contextlib.contextmanager
def _no_device_queries():
    """Make torch.cuda's device queries raise for any caller but torch and Triton (the model's
    code, transformers', this package's): traced, the refusal breaks a fullgraph compile."""

    def refusing(name, original):
        def query(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if not caller.startswith(_COMPILER_DIRS):
                raise AssertionError(f"torch.cuda.{name} ran while compiling, called from {caller}")
            return original(*args, **kwargs)

        return query

    with contextlib.ExitStack() as stack:
        for name in DEVICE_QUERIES:
            stack.enter_context(mock.patch(f"torch.cuda.{name}", refusing(name, getattr(torch.cuda, name))))
        yield


def _compiles_with_a_dynamic_token_count(model, device, vocab=400):
    """torch.compile(fullgraph=True, dynamic=True) over 1, 3, 5 and 9 tokens while device
    queries raise; returns the number of graphs Dynamo made."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    with _no_device_queries(), torch.no_grad():
        for tokens in (1, 3, 5, 9):
            ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens)).to(device)
            got, want = compiled(input_ids=ids).logits, model(input_ids=ids).logits
            assert _cosine(got, want) >= 0.999, tokens
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_the_text_model_compiles_fullgraph_with_a_dynamic_token_count_and_no_device_query(saved):
    model = _load(saved, "qwen3")
    install(model)
    assert _compiles_with_a_dynamic_token_count(model, "cpu") <= 2  # one graph for every M >= 2, and M = 1


def test_the_vl_model_compiles_and_runs_while_device_queries_raise(saved):
    """Its text path compiles with fullgraph; the vision tower's own code (window indices from
    .tolist()) breaks graphs in transformers, never in this package's modules."""
    model = _load(saved, "qwen2_5_vl")
    install(model, consumers={"model.visual": "row"})
    assert _compiles_with_a_dynamic_token_count(model, "cpu") <= 2
    torch._dynamo.reset()
    with _no_device_queries(), torch.no_grad():
        explanation = torch._dynamo.explain(model)(**_image_inputs("cpu"))
        frames = [frame.filename for reason in explanation.break_reasons for frame in reason.user_stack]
        assert not [name for name in frames if "tvm_rmsquant" in name], frames
        compiled = torch.compile(model, dynamic=True)
        assert _cosine(compiled(**_image_inputs("cpu")).logits, model(**_image_inputs("cpu")).logits) >= 0.999


@pytest.mark.parametrize("hidden", [256, 512])
@pytest.mark.parametrize("rows", [1, 3, 5, 8])
def test_the_gemm_op_gives_scaled_mm_what_cublas_runs_at_every_m(saved, hidden, rows):
    """cuBLAS runs BlockWise1x128 only at M % 4 == 0 (CUBLAS_STATUS_NOT_SUPPORTED else, on the
    GPU), and torch's ``scaled_mm`` checks its operands in its meta function: what
    ``padded_to_gemm_rows`` makes of our quant's output passes that check at every M, with
    zero codes and scales in the added rows, and the layer's op returns M rows."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.functional import ScalingType, scaled_mm

    from tvm_rmsquant.dispatch import select
    from tvm_rmsquant.integrations.transformers import GEMM_ROW_ALIGN, padded_to_gemm_rows
    from tvm_rmsquant.scale_layout import round_up

    model = _load(saved, "qwen3")
    linear = model.model.layers[0].mlp.down_proj if hidden == 512 else model.model.layers[0].self_attn.o_proj
    quant = select(hidden, torch.bfloat16, 128, consumer="cublas_blockwise", device="cpu", norm=False)
    layer = BlockFP8Linear(linear, quant, "scaled_mm", torch.bfloat16)
    q, scales = quant(torch.randn(rows, hidden).bfloat16())
    padded_q, padded_scales = padded_to_gemm_rows(q, scales)
    gemm_rows = round_up(rows, GEMM_ROW_ALIGN)
    assert padded_q.shape == (gemm_rows, hidden) and padded_scales.stride() == (1, gemm_rows)
    assert torch.equal(padded_q[:rows].view(torch.uint8), q.view(torch.uint8)) and torch.equal(padded_scales[:rows], scales)
    assert not padded_q[rows:].view(torch.uint8).any() and not padded_scales[rows:].any()
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = scaled_mm(padded_q, layer.weight.t(), padded_scales, ScalingType.BlockWise1x128, layer.scale_b,
                        ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
        assert out.shape == (gemm_rows, linear.out_features)
        out = layer(torch.empty(rows, hidden, dtype=torch.bfloat16))
    assert out.shape == (rows, linear.out_features) and out.dtype == torch.bfloat16


# -- on the GPU ---------------------------------------------------------------------------------


@pytest.fixture
def gpu_models(saved, gpu_bundle):
    """{kind: (fused, unfused, bf16)} on CUDA, the fused and unfused through the bundle."""
    models = {}
    for kind in BUILDERS:
        fused, unfused = _load(saved, kind, "cuda"), _load(saved, kind, "cuda")
        reports = install(fused, bundle=gpu_bundle.root), install(unfused, bundle=gpu_bundle.root, fuse=False)
        models[kind] = (fused, unfused, _load(saved, kind, "cuda", quantized=False), reports)
    return models


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3", "qwen2_5_vl"])
def test_gpu_models_run_end_to_end_on_our_kernels_and_scaled_mm(gpu_models, kind):
    fused, unfused, bf16, (report, _) = gpu_models[kind]
    layers = TEXT["num_hidden_layers"]
    vision = 2 * 3 if kind == "qwen2_5_vl" else 0
    assert report.count("fused") == 5 * layers + vision and report.unfused_norms == []
    assert report.count(gemm="scaled_mm") == len(report.sites)
    assert all(site.variant is not None and "kernel from" in site.why for site in report.sites), str(report)
    inputs = _image_inputs("cuda") if kind == "qwen2_5_vl" else dict(input_ids=torch.tensor([[1, 17, 33, 5, 250, 9, 2]], device="cuda"))
    got, reference_path, full = _logits(fused, **inputs), _logits(unfused, **inputs), _logits(bf16, **inputs)
    assert _within_one_fp8_step(got, reference_path), float((got - reference_path).abs().max())
    assert _cosine(got, full) >= 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3", "qwen2_5_vl"])
def test_gpu_greedy_decoding_matches_the_unfused_path_up_to_a_near_tie(gpu_models, kind):
    fused, unfused, _, _ = gpu_models[kind]
    prompt = _image_inputs("cuda") if kind == "qwen2_5_vl" else dict(input_ids=torch.tensor([[1, 17, 33, 5]], device="cuda"))
    settings = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        ours, theirs = fused.generate(**prompt, **settings), unfused.generate(**prompt, **settings)
    tokens, reference_tokens = ours.sequences[0], theirs.sequences[0]
    if torch.equal(tokens, reference_tokens):
        return
    step = int((tokens != reference_tokens).nonzero()[0]) - prompt["input_ids"].shape[1]
    logits, reference_logits = ours.logits[step][0].float(), theirs.logits[step][0].float()
    top2 = reference_logits.topk(2).values
    difference = float((logits - reference_logits).abs().max())
    assert float(top2[0] - top2[1]) < difference, f"diverged at step {step} without a near-tie"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3", "qwen2_5_vl"])
def test_gpu_models_compile_fullgraph_with_a_dynamic_token_count_while_device_queries_raise(gpu_models, kind):
    fused = gpu_models[kind][0]
    assert _compiles_with_a_dynamic_token_count(fused, "cuda") <= 2


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_gpu_odd_m_decode_runs_through_scaled_mm_and_cuda_graphs(gpu_models, rows):
    fused, unfused, _, _ = gpu_models["qwen3"]
    ids = torch.randint(0, 400, (rows, 1), device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows))
    with torch.no_grad():
        eager = fused(input_ids=ids, use_cache=False).logits
        graph = torch.cuda.CUDAGraph()
        static = ids.clone()
        fused(input_ids=static, use_cache=False)  # warm-up outside capture (allocator, lazy loads)
        with torch.cuda.graph(graph):
            captured = fused(input_ids=static, use_cache=False).logits
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert _within_one_fp8_step(eager.float(), _logits(unfused, input_ids=ids, use_cache=False))
    assert math.isfinite(float(eager.float().abs().max()))
