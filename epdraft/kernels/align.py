"""Routing setup for the fused experts: token-expert pairs sorted by expert into block-padded groups.

One Triton launch, no host synchronization, so the whole MoE forward can be captured in a CUDA
graph: buffers are sized from shapes alone (an upper bound on the padded length) and the GEMM
programs past the real padded count exit at once. Programs own slices of the pairs, publish their
per-expert counts in a per-device scratch and meet at a grid barrier whose counters the launch
leaves zeroed, so launches on one device must not run concurrently on different streams.

Pair p = t * K + j names (token t, its j-th choice). An expert id outside [0, e) (-1: another
rank's expert, or a padded row) drops the pair.
"""

from __future__ import annotations

import dataclasses
import functools

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


_MAX_CHUNK = 256  # pairs ranked at once: a CHUNK x CHUNK comparison per chunk
_MIN_PAIRS_PER_PROG = 256  # fewer pairs per program cost more in reading every program's counts
_scratch: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _scratch_for(device: torch.device, num_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per device and bin count: [SMs, num_bins] int32 counts (no init needed), [2] int32 barrier counters (kept zeroed)."""
    key = (device, num_bins)
    if key not in _scratch:
        counts = torch.empty(num_sms(device), num_bins, dtype=torch.int32, device=device)
        _scratch[key] = (counts, torch.zeros(2, dtype=torch.int32, device=device))
    return _scratch[key]


def align_pairs(ids_P: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """Group the flat pair list `ids_P` ([P] int, local expert ids) by expert; one kernel launch.

    Within an expert, pairs keep ascending pair order, so the layout is deterministic. The grid is
    at most one program per SM: the programs meet at a grid barrier, so all must be resident.
    """
    from epdraft.kernels._triton import align_kernel

    num_pairs = ids_P.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    device = ids_P.device
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    num_bins = max(16, _next_pow2(num_experts))
    counts, sync = _scratch_for(device, num_bins)
    num_progs = max(1, min(num_sms(device), -(-num_pairs // _MIN_PAIRS_PER_PROG)))
    pairs_per_prog = -(-num_pairs // num_progs)
    chunk = max(16, min(_MAX_CHUNK, _next_pow2(pairs_per_prog)))
    align_kernel[(num_progs,)](
        ids_P,
        sorted_pairs,
        block_expert,
        num_padded,
        counts,
        sync,
        num_pairs,
        num_experts,
        pairs_per_prog,
        BLOCK_M=block_m,
        NUM_BINS=num_bins,
        EXPERTS_PER_PROG=max(2, _next_pow2(-(-num_experts // num_progs))),
        CHUNK=chunk,
        ROWS=max(1, min(_next_pow2(num_progs), 16384 // num_bins)),
        ONE_PROG=num_progs == 1,
        ONE_CHUNK=pairs_per_prog <= chunk,
        num_warps=8 if chunk * chunk + num_bins * 16 > 32768 else 4,
    )
    return AlignedPairs(sorted_pairs, block_expert, num_padded, block_m, num_pairs)
