"""An independent implementation of cuBLAS's block-scaling-factor layout, for the tests.

Written from the cuBLAS documentation ("1D Block Scaling Factors Layout"), not from
``tvm_rmsquant.scale_layout``: the scale matrix is padded to whole 128 x 4 blocks with
zeros; blocks are stored one after another, row-block-major; and each block is 512 bytes
of 32 rows of 16 bytes, row i of which holds, for the four row strips i, i + 32, i + 64,
i + 96 in turn, that row's four scales.
"""

from __future__ import annotations

import torch

BLOCK_ROWS, BLOCK_COLS = 128, 4


def swizzle(matrix: torch.Tensor) -> torch.Tensor:
    """[M, C] uint8 scales -> the flat bytes cuBLAS reads, by reshaping a zero-padded copy."""
    rows, cols = matrix.shape
    row_blocks, col_blocks = -(-rows // BLOCK_ROWS), -(-cols // BLOCK_COLS)
    padded = torch.zeros(row_blocks * BLOCK_ROWS, col_blocks * BLOCK_COLS, dtype=torch.uint8)
    padded[:rows, :cols] = matrix
    # [row block, strip (4), row in strip (32), col block, col (4)]
    blocks = padded.view(row_blocks, 4, 32, col_blocks, BLOCK_COLS)
    # stored as [row block, col block, row in strip, strip, col]
    return blocks.permute(0, 3, 2, 1, 4).contiguous().flatten()


def offset(row: int, col: int, padded_cols: int) -> int:
    """The byte of scale (row, col), by the documentation's formula, one element at a time."""
    block = (row // BLOCK_ROWS) * (padded_cols // BLOCK_COLS) + col // BLOCK_COLS
    return block * 512 + (row % 32) * 16 + (row % BLOCK_ROWS) // 32 * 4 + col % BLOCK_COLS
