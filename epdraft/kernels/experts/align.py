"""Routing setup for the fused experts: token-expert pairs sorted by expert into block-padded groups.

One Triton launch, no host synchronization, so the whole MoE forward can be captured in a CUDA
graph: buffers are sized from shapes alone (an upper bound on the padded length) and the GEMM
programs past the real padded count exit at once. Programs own slices of the experts and hand each
other their group sizes through a small per-device scratch that the launch leaves zeroed, so
launches on one device must not run concurrently on different streams.

Pair p = t * K + j names (token t, its j-th choice). An expert id outside [0, e) (-1: another
rank's expert, or a padded row) drops the pair.
"""

from __future__ import annotations

import dataclasses

import torch

from epdraft.kernels import launch


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


_EXPERTS_PER_PROG = 4  # at most; 4 fields of 13 bits (chunks of 4096 pairs) fit one int64
_MIN_PROGS = 128  # fewer experts per program while there are at most this many programs
_sync_scratch: dict[tuple[torch.device, int], torch.Tensor] = {}


def _sync_buffer(device: torch.device, max_progs: int) -> torch.Tensor:
    """[max_progs + 1] int32 zeros per device: published group sizes and a finish counter (kept zeroed)."""
    key = (device, max_progs)
    if key not in _sync_scratch:
        _sync_scratch[key] = torch.zeros(max_progs + 1, dtype=torch.int32, device=device)
    return _sync_scratch[key]


def align_pairs(ids_P: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """Group the flat pair list `ids_P` ([P] int, local expert ids) by expert; one kernel launch.

    Within an expert, pairs keep ascending pair order, so the layout is deterministic.
    """
    from epdraft.kernels.experts._triton import align_kernel

    num_pairs = ids_P.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    device = ids_P.device
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    experts_per_prog = min(_EXPERTS_PER_PROG, launch.next_pow2(-(-num_experts // _MIN_PROGS)))
    num_progs = -(-num_experts // experts_per_prog)
    max_progs = max(_MIN_PROGS, launch.next_pow2(num_progs))
    chunk = max(16, min(launch.next_pow2(num_pairs), 4096))
    align_kernel[(num_progs,)](
        ids_P,
        sorted_pairs,
        block_expert,
        num_padded,
        _sync_buffer(device, max_progs),
        num_pairs,
        num_experts,
        BLOCK_M=block_m,
        EXPERTS_PER_PROG=experts_per_prog,
        MAX_PROGS=max_progs,
        CHUNK=chunk,
        FIELD_BITS=chunk.bit_length(),
        num_warps=16 if chunk >= 4096 else 8 if chunk >= 1024 else 4,
        **launch.kwargs(device),
    )
    return AlignedPairs(sorted_pairs, block_expert, num_padded, block_m, num_pairs)
