"""Routing setup for the fused experts: token-expert pairs sorted by expert into block-padded groups.

One Triton launch, no host synchronization, so the whole MoE forward can be captured in a CUDA
graph: buffers are sized from shapes alone (an upper bound on the padded length) and the GEMM
programs past the real padded count exit at once.

Pair p = t * K + j names (token t, its j-th choice). An expert id outside [0, e) (-1: another
rank's expert, or a padded row) drops the pair.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class AlignedPairs:
    """Pairs grouped by expert, each group padded to a multiple of `block_m` rows.

    sorted_pairs_M: [max_rows] int32 pair ids; padding rows hold `num_pairs` (one past the last pair).
    block_expert_B: [max_blocks] int32 expert of each block of `block_m` rows; undefined past
        num_padded (the GEMMs never read it there).
    num_padded_1: [1] int32 rows actually used (a multiple of `block_m`).
    """

    sorted_pairs_M: torch.Tensor
    block_expert_B: torch.Tensor
    num_padded_1: torch.Tensor
    block_m: int
    num_pairs: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert_B.shape[0]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on padded blocks: full blocks of all pairs plus one partial block per expert hit."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def align_pairs(ids_P: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """Group the flat pair list `ids_P` ([P] int, local expert ids) by expert; one kernel launch.

    Within an expert the order of pairs is whatever the atomics give: each pair's result is
    written to its own row and summed later in pair order, so the output does not depend on it.
    """
    from epdraft.kernels._triton import align_kernel

    num_pairs = ids_P.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    device = ids_P.device
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    num_bins = _next_pow2(num_experts + 1)
    cursor = torch.empty(num_bins, dtype=torch.int32, device=device)
    chunk = min(4096, max(256, _next_pow2(num_pairs)))
    align_kernel[(1,)](
        ids_P,
        sorted_pairs,
        block_expert,
        num_padded,
        cursor,
        num_pairs,
        num_experts,
        blocks,
        BLOCK_M=block_m,
        NUM_BINS=num_bins,
        CHUNK=chunk,
        num_warps=16,
    )
    return AlignedPairs(sorted_pairs, block_expert, num_padded, block_m, num_pairs)
