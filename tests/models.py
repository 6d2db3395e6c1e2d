"""Tiny models for the compile tests: a Llama-style block and a VL-style wrapper whose
config nests the text config (the case that crashed vLLM's dispatcher)."""

from __future__ import annotations

import dataclasses

import torch

import tvm_rmsquant
from tvm_rmsquant.reference import scales_fp32


@dataclasses.dataclass
class TextConfig:
    hidden_size: int = 256
    intermediate_size: int = 512
    rms_norm_eps: float = 1e-6


@dataclasses.dataclass
class VLConfig:
    text_config: TextConfig = dataclasses.field(default_factory=TextConfig)
    vision_hidden_size: int = 64


class QuantLinear(torch.nn.Module):
    """A block-FP8 linear written as plain torch: dequantize the activations, then matmul."""

    def __init__(self, k: int, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k) / k**0.5, requires_grad=False)

    def forward(self, q, scales, spec):
        dequantized = q.float().view(q.shape[0], -1, spec.group) * scales_fp32(scales, spec, q.shape[1]).unsqueeze(-1)
        return dequantized.view(q.shape) @ self.weight.t()


class Block(torch.nn.Module):
    def __init__(self, config: TextConfig, device="cpu", consumer="deepgemm_sm90"):
        super().__init__()
        k = config.hidden_size
        self.eps = config.rms_norm_eps
        self.norm = torch.nn.Parameter(torch.ones(k, dtype=torch.bfloat16) + 0.1 * torch.randn(k).bfloat16(), requires_grad=False)
        self.up = QuantLinear(k, config.intermediate_size)
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
