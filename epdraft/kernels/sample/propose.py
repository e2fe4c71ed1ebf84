"""Draft tokens from their logits in one launch (CUDA): q = softmax(logits / T) stored fp32 and a
token drawn from it by the counter-based inverse CDF, for a readout without top-k / top-p
(`epdraft.sampling.Readout.SAMPLE`).

Why: the torch chain it equals (`epdraft.sampling.propose_tokens`: the scaled softmax, the hash's
~120 elementwise launches, an fp64 cumulative sum over the vocabulary and a search) added 37-47 %
to the N = 1..64 graph step of the issue-13 preset on an H100, this launch 1-3 %
(docs/performance.md). It reads the logits twice (max and normalizer; q stored) and a third time
up to the block where the draw falls, and writes q once. Every launch has a shape-only grid and
reads nothing on the host: a CUDA graph holds it. tests/gpu/test_sample_kernel.py holds it against
the torch chain (the same uniforms bit for bit, q to a few fp32 ulps, the same tokens but where a
draw falls within that rounding of a CDF step).
"""

from __future__ import annotations

import torch

from epdraft.kernels import launch

BLOCK_V = 4096
NUM_WARPS = 16  # tools/sample_tune.py on an H100: 143 us at 960 x 32000 (4096 x 8: 164, 2048 x 8: 155)


def unsupported_reason(device_type: str, dtype: torch.dtype) -> str | None:
    """Why the launch cannot run on `device_type`, or None (it reads logits of any float dtype)."""
    return launch.unsupported_reason(device_type)


def propose_sampled(
    logits_NkV: torch.Tensor, temperature_N: torch.Tensor, seed_N: torch.Tensor, first_N: torch.Tensor, stream: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N, k] int64, q [N, k, V] fp32) of `logits_NkV`: row (n, i) at temperature_N[n] (0:
    the argmax, one-hot q), its uniform keyed by (seed_N[n], first_N[n] + i, `stream`)."""
    from epdraft.kernels.sample._propose_triton import propose_kernel

    N, k, V = logits_NkV.shape
    rows = logits_NkV.reshape(N * k, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    tokens = torch.empty(N, k, dtype=torch.int64, device=logits_NkV.device)
    q = torch.empty(N, k, V, dtype=torch.float32, device=logits_NkV.device)
    if N * k:
        propose_kernel[(N * k,)](
            rows, temperature_N.float().contiguous(), seed_N.contiguous(), first_N.contiguous(), tokens, q,
            V, k, rows.stride(0), STREAM=stream, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS, **launch.kwargs(logits_NkV.device),
        )  # fmt: skip
    return tokens, q
