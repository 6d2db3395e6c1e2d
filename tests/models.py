"""Tiny models for the compile tests: a Llama-style block and a VL-style wrapper whose
config nests the text config (the case that crashed vLLM's dispatcher)."""

from __future__ import annotations

import dataclasses

import torch

import tvm_rmsquant
from tvm_rmsquant import reference


@dataclasses.dataclass
class TextConfig:
    hidden_size: int = 256
    intermediate_size: int = 512
    rms_norm_eps: float = 1e-6


@dataclasses.dataclass
class VLConfig:
    text_config: TextConfig = dataclasses.field(default_factory=TextConfig)
    vision_hidden_size: int = 64


class Block(torch.nn.Module):
    def __init__(self, config: TextConfig, device="cpu", consumer="deepgemm_sm90"):
        super().__init__()
        k = config.hidden_size
        self.eps = config.rms_norm_eps
        self.norm = torch.nn.Parameter(torch.ones(k, dtype=torch.bfloat16) + 0.1 * torch.randn(k).bfloat16(), requires_grad=False)
        self.up = BlockFP8Linear(k, config.intermediate_size, device)
        # Chosen once, here: the dispatcher sees the consuming linear's 2-D weight.
        self.quant = tvm_rmsquant.select(k, torch.bfloat16, residual=True, consumer=consumer, device=device, consumer_weight=self.up.weight)

    def forward(self, x, residual):
        q, scales = self.quant(x, self.norm, self.eps, residual=residual)
        return self.up(q, scales, self.quant.spec)


class VLModel(torch.nn.Module):
    def __init__(self, config: VLConfig, device="cpu"):
        super().__init__()
        self.vision = torch.nn.Linear(config.vision_hidden_size, config.text_config.hidden_size).bfloat16()
        self.block = Block(config.text_config, device)

    def forward(self, pixels, residual):
        return self.block(self.vision(pixels), residual)


# --- A tiny Llama-style decoder written with the plain torch reference ops (issue 8) ------


@dataclasses.dataclass
class LlamaConfig:
    hidden_size: int = 1024
    intermediate_size: int = 2048
    num_layers: int = 2
    num_heads: int = 8
    vocab_size: int = 512
    rms_norm_eps: float = 1e-5
    group_size: int = 128
    #: The GEMM behind each norm: its scale layout/format is the layer's init-time choice.
    qkv_consumer: str = "deepgemm_sm90"
    mlp_consumer: str = "triton"


@dataclasses.dataclass
class LlamaVLConfig:
    text_config: LlamaConfig = dataclasses.field(default_factory=LlamaConfig)
    patch_size: int = 192
    vision_hidden_size: int = 256


class NormQuant(torch.nn.Module):
    """RMSNorm (+ residual) then the group quant its consumer reads, as plain reference torch ops.

    The kernel is chosen at init from the consumer; forward only uses its spec, so the
    unfused model computes exactly what the fusion pass swaps the fused op in for.
    """

    def __init__(self, config: LlamaConfig, residual: bool, consumer: str, consumer_weight: torch.Tensor, device):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(config.hidden_size, device=device).bfloat16(), requires_grad=False)
        self.kernel = tvm_rmsquant.select(
            config.hidden_size, torch.bfloat16, config.group_size, residual=residual, consumer=consumer, device=device, consumer_weight=consumer_weight
        )

    def forward(self, x, residual=None):
        y, residual = reference.rms_norm(x, self.weight, self.eps, residual)
        q, scales = reference.group_quant(y, self.kernel.spec)
        return q, scales, residual


class BlockFP8Linear(torch.nn.Module):
    """A linear layer reading block-FP8 activations, as plain torch: dequantize, bf16 matmul."""

    def __init__(self, k: int, n: int, device):
        super().__init__()
        self.weight = torch.nn.Parameter((torch.randn(n, k, device=device) / k**0.5).bfloat16(), requires_grad=False)

    def forward(self, q, scales, spec):
        return reference.dequantize(q, scales, spec).bfloat16() @ self.weight.t()


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: LlamaConfig, first: bool, device):
        super().__init__()
        k, heads = config.hidden_size, config.num_heads
        self.heads = heads
        self.qkv = BlockFP8Linear(k, 3 * k, device)
        self.gate_up = BlockFP8Linear(k, 2 * config.intermediate_size, device)
        self.o_proj = torch.nn.Linear(k, k, bias=False, device=device, dtype=torch.bfloat16)
        self.down = torch.nn.Linear(config.intermediate_size, k, bias=False, device=device, dtype=torch.bfloat16)
        # The first layer's input norm has no residual yet (vLLM's convention).
        self.input_norm = NormQuant(config, not first, config.qkv_consumer, self.qkv.weight, device)
        self.post_attention_norm = NormQuant(config, True, config.mlp_consumer, self.gate_up.weight, device)

    def forward(self, hidden, residual):
        tokens, k = hidden.shape
        if residual is None:
            q, scales, _ = self.input_norm(hidden)
            residual = hidden
        else:
            q, scales, residual = self.input_norm(hidden, residual)
        qkv = self.qkv(q, scales, self.input_norm.kernel.spec).view(tokens, 3, self.heads, k // self.heads).permute(1, 2, 0, 3)
        attention = torch.nn.functional.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        hidden = self.o_proj(attention.permute(1, 0, 2).reshape(tokens, k))
        q2, scales2, residual = self.post_attention_norm(hidden, residual)
        gate, up = self.gate_up(q2, scales2, self.post_attention_norm.kernel.spec).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up), residual, (q, q2)


class TinyLlama(torch.nn.Module):
    """Returns (logits, the fp8 codes of every norm -> quant site)."""

    def __init__(self, config: LlamaConfig, device="cpu"):
        super().__init__()
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=torch.bfloat16)
        self.layers = torch.nn.ModuleList(DecoderLayer(config, i == 0, device) for i in range(config.num_layers))
        self.norm = torch.nn.Parameter(torch.ones(config.hidden_size, device=device, dtype=torch.bfloat16), requires_grad=False)
        self.eps = config.rms_norm_eps
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=torch.bfloat16)

    def forward(self, tokens=None, embeddings=None):
        hidden = self.embed(tokens) if embeddings is None else embeddings
        residual, codes = None, ()
        for layer in self.layers:
            hidden, residual, layer_codes = layer(hidden, residual)
            codes += layer_codes
        # The final norm feeds a bf16 head, not a quant: it stays unfused.
        hidden, _ = reference.rms_norm(hidden, self.norm, self.eps, residual)
        return self.lm_head(hidden), codes


class TinyLlamaVL(torch.nn.Module):
    """A VL-style wrapper: the text config is nested, the vision tower has a 1-D-weight norm with no quant."""

    def __init__(self, config: LlamaVLConfig, device="cpu"):
        super().__init__()
        text = config.text_config
        self.patch_embed = torch.nn.Linear(config.patch_size, config.vision_hidden_size, device=device, dtype=torch.bfloat16)
        self.vision_norm = torch.nn.Parameter(torch.ones(config.vision_hidden_size, device=device, dtype=torch.bfloat16), requires_grad=False)
        self.projector = torch.nn.Linear(config.vision_hidden_size, text.hidden_size, device=device, dtype=torch.bfloat16)
        self.language_model = TinyLlama(text, device)

    def forward(self, patches, tokens):
        vision, _ = reference.rms_norm(self.patch_embed(patches), self.vision_norm, 1e-6)
        embeddings = torch.cat([self.projector(vision), self.language_model.embed(tokens)])
        return self.language_model(embeddings=embeddings)
