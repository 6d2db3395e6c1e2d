"""transformers' FP8 Qwen3 on tvm_rmsquant's kernels: where users feel the speed (issue 22).

On a GPU, with the bundle in $TVM_RMSQUANT_BUNDLE. A 2-layer Qwen3 at Qwen3-8B's sizes
(hidden 4096, intermediate 12288, 32 heads of 128, 8 KV heads) with random weights is saved
and reloaded with ``FineGrainedFP8Config`` (transformers quantizes it), then run three ways:
fused (``install``), unfused (``install(fuse=False)``: transformers' norm, then the standalone
quant, then the GEMM) and the bf16 model. Correctness first, on random tokens: fused logits
within one fp8 step of the unfused ones, and cosine >= ``MIN_COSINE`` against bf16; nothing is
timed on zeros.

Timed, as medians of CUDA-event-timed CUDA-graph replays (``timing.time_call``) or eager calls:
  * one decoder layer: prefill M = 2048 eager and compiled, decode M = 1 (graph replay);
  * the norm + quant share of that layer: the same layer's norm and quant modules alone;
  * the 2-layer model's forward of one token (no KV cache), FP8 fused against bf16.
Prints one table; writes the numbers as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch

from tvm_rmsquant.integrations.transformers import BlockFP8Linear, install
from tvm_rmsquant.timing import events_median, time_call

SIZES = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             num_hidden_layers=2, vocab_size=32000, max_position_embeddings=4096)

#: The bf16 model's logits against the FP8 one's: a gross check (a wrong scale layout gives ~0).
#: FP8 itself costs this random-weight model more than the tests' tiny ones (0.99 there):
#: 0.979 measured on the H100, 2026-12-06, with fused and unfused logits identical.
MIN_COSINE = 0.95


def _models(folder):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    def load(**kwargs):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda", **kwargs).eval()

    fused, unfused = load(quantization_config=FineGrainedFP8Config()), load(quantization_config=FineGrainedFP8Config())
    report = install(fused)
    install(unfused, fuse=False)
    return fused, unfused, load(), report


def _check(fused, unfused, bf16):
    ids = torch.randint(0, SIZES["vocab_size"], (1, 64), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    with torch.no_grad():
        a, b, c = (model(input_ids=ids).logits.float() for model in (fused, unfused, bf16))
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp(min=2.0**-6))) - 3)
    within = bool(((a - b).abs() <= step).all())
    cosine = float(torch.nn.functional.cosine_similarity(a.flatten(), c.flatten(), dim=0))
    print(f"check: fused vs unfused max |diff| {float((a - b).abs().max()):.4g}, within one fp8 step: {within}; cosine vs bf16 {cosine:.5f}")
    if not within or cosine < MIN_COSINE:
        sys.exit("correctness check failed: nothing timed")


def _layer_inputs(model, rows):
    """The (args, kwargs) transformers passes decoder layer 0 for ``rows`` random tokens."""
    captured = {}

    def grab(module, args, kwargs):
        captured["call"] = (args, kwargs)

    handle = model.model.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    ids = torch.randint(0, SIZES["vocab_size"], (1, rows), device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    handle.remove()
    return captured["call"]


def _graph_ms(run, calls=20):
    """Median ms of one ``run`` from CUDA-graph replays of ``calls`` runs (``timing.time_call``)."""
    with torch.no_grad():
        return time_call(lambda _: run, 1, 0, per_graph=calls) / 1e3


def _eager_ms(run, repeats=30):
    with torch.no_grad():
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        return events_median(run, repeats)


def _norm_quant_modules(layer):
    """The layer's norm and quant work as callables on its own intermediate inputs: the two
    norms (fused: norm + quant in one) and every standalone quant of its linears."""
    parts = []
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        parts.append(norm)
    for module in layer.modules():
        if isinstance(module, BlockFP8Linear) and module.handoff is None:
            parts.append(module)
    return parts


def _share(model, rows):
    """ms of the layer's norm + quant work at ``rows`` tokens, each part timed on a random
    input of its shape under graph replay."""
    layer = model.model.layers[0]
    total = 0.0
    for part in _norm_quant_modules(layer):
        if isinstance(part, BlockFP8Linear):
            x = torch.randn(rows, part.in_features, device="cuda", dtype=torch.bfloat16)
            total += _graph_ms(lambda part=part, x=x: part.quant(x))
        else:
            x = torch.randn(1, rows, SIZES["hidden_size"], device="cuda", dtype=torch.bfloat16)
            total += _graph_ms(lambda part=part, x=x: part(x))
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_transformers.json")
    args = parser.parse_args(argv)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tempfile.mkdtemp()
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**SIZES)).to(torch.bfloat16).save_pretrained(folder)
    fused, unfused, bf16, report = _models(folder)
    print(str(report).splitlines()[0])
    _check(fused, unfused, bf16)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sizes": SIZES}
    for name, model in (("fused", fused), ("unfused", unfused)):
        layer = model.model.layers[0]
        prefill_args, prefill_kwargs = _layer_inputs(model, 2048)
        decode_args, decode_kwargs = _layer_inputs(model, 1)
        compiled = torch.compile(layer, fullgraph=True)
        results[name] = {
            "layer_prefill_2048_eager_ms": _eager_ms(lambda: layer(*prefill_args, **prefill_kwargs)),
            "layer_prefill_2048_compiled_ms": _eager_ms(lambda: compiled(*prefill_args, **prefill_kwargs)),
            "layer_decode_1_graph_ms": _graph_ms(lambda: layer(*decode_args, **decode_kwargs)),
            "norm_quant_2048_ms": _share(model, 2048),
            "norm_quant_1_ms": _share(model, 1),
        }
    one = torch.randint(0, SIZES["vocab_size"], (1, 1), device="cuda")
    for name, model in (("fp8_fused", fused), ("bf16", bf16)):
        results[f"model_decode_1_graph_ms_{name}"] = _graph_ms(lambda model=model: model(input_ids=one, use_cache=False))
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=1)
    print(f"{'':34s}{'fused':>10s}{'unfused':>10s}")
    for key in results["fused"]:
        print(f"{key:34s}{results['fused'][key]:10.4f}{results['unfused'][key]:10.4f}")
    print(f"2-layer model, one token (graph): FP8 fused {results['model_decode_1_graph_ms_fp8_fused']:.4f} ms, "
          f"bf16 {results['model_decode_1_graph_ms_bf16']:.4f} ms")


if __name__ == "__main__":
    main()
