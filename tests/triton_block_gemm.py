"""The simplest correct row-layout block-FP8 GEMM in Triton: the kind of consumer that reads
our row-major scales (per token and 128-column group) as they are, through their strides.

out[M, N] = sum over K blocks of (A_block @ B_block^T) * a_scale[m, kb] * b_scale[nb, kb],
with A fp8 [M, K] (row scales [M, K/128]) and B fp8 [N, K] (128x128 block scales [N/128, K/128]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128


@triton.jit
def _block_fp8_gemm(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, out_ptr, M, N, K,
    a_scale_stride_m, a_scale_stride_k, b_scale_stride_n, b_scale_stride_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + ks
        a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=rows[:, None] < M, other=0.0)
        b = tl.load(b_ptr + cols[:, None] * K + k[None, :], mask=cols[:, None] < N, other=0.0)
        a_scale = tl.load(a_scale_ptr + rows * a_scale_stride_m + kb * a_scale_stride_k, mask=rows < M, other=0.0)
        # BLOCK_N is the weight's 128-wide scale block: program n reads block row n.
        b_scale = tl.load(b_scale_ptr + tl.program_id(1) * b_scale_stride_n + kb * b_scale_stride_k)
        acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16), mask=(rows[:, None] < M) & (cols[None, :] < N))


def block_fp8_gemm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor) -> torch.Tensor:
    """bf16 [M, N] from fp8 a [M, K] with per-(row, group) scales and fp8 b [N, K] with 128x128 block scales."""
    M, K = a.shape
    N = b.shape[0]
    if K % BLOCK or N % BLOCK or a_scales.shape != (M, K // BLOCK) or b_scales.shape != (N // BLOCK, K // BLOCK):
        raise ValueError(f"block_fp8_gemm takes K, N multiples of {BLOCK}; got a {tuple(a.shape)}, b {tuple(b.shape)}")
    out = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    grid = (triton.cdiv(M, 64), N // BLOCK)
    _block_fp8_gemm[grid](
        a, b, a_scales, b_scales, out, M, N, K, *a_scales.stride(), *b_scales.stride(),
        BLOCK_M=64, BLOCK_N=BLOCK, BLOCK_K=BLOCK,
    )
    return out
