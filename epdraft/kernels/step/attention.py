"""Block attention of a draft step: each request's B block rows attend, non-causally, to the first
`kv_lens[n]` keys of its KV pool slot `slots[n]` (its context, then the block itself), in place.

`block_attention` is the Triton kernel (CUDA; split-K over keys, then one merge launch where the
keys take more than one split; no host sync, a grid that depends on shapes only, so a CUDA graph
can hold it); `block_attention_reference` is the same contract through torch's SDPA with a length
mask (any device, the tests' oracle).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from epdraft.errors import ConfigError
from epdraft.kernels import launch
from epdraft.kernels.launch import next_pow2
from epdraft.kernels.step.ops import merge_attention_splits

_BLOCK_S = 64
_NUM_WARPS, _NUM_STAGES = 4, 3  # Triton's defaults (tools/attention_tune.py measures others)
_MIN_SPLIT_KEYS = 256
_TARGET_PROGRAMS = 264  # two per H200 SM: one wave of key splits that a small batch still fills the GPU with


def _check(q_NhBD, k_PgSD, v_PgSD, slots_N, kv_lens_N) -> None:
    if q_NhBD.dim() != 4 or k_PgSD.dim() != 4 or v_PgSD.shape != k_PgSD.shape:
        raise ConfigError(
            f"block_attention: q {tuple(q_NhBD.shape)}, k {tuple(k_PgSD.shape)}, v {tuple(v_PgSD.shape)}: "
            "expected q [N, h, B, D] and k, v [P, g, S, D]"
        )
    N, h, _, D = q_NhBD.shape
    if k_PgSD.shape[3] != D or h % k_PgSD.shape[1]:
        raise ConfigError(
            f"block_attention: q {tuple(q_NhBD.shape)} and k {tuple(k_PgSD.shape)} disagree on D, "
            "or the query heads are not a multiple of the KV heads"
        )
    for name, t in (("slots", slots_N), ("kv_lens", kv_lens_N)):
        if tuple(t.shape) != (N,) or t.dtype.is_floating_point:
            raise ConfigError(f"block_attention: {name} has shape {tuple(t.shape)} {t.dtype}, expected [{N}] ints")


def block_attention_reference(
    q_NhBD: torch.Tensor, k_PgSD: torch.Tensor, v_PgSD: torch.Tensor, slots_N: torch.Tensor, kv_lens_N: torch.Tensor
) -> torch.Tensor:
    """[N, h, B, D] in q's dtype: softmax(q k^T / sqrt(D)) v over keys [0, kv_lens[n]) of slot slots[n].

    Gathers the N slots' first max(kv_lens) rows (a copy; the kernel reads them in place).
    """
    _check(q_NhBD, k_PgSD, v_PgSD, slots_N, kv_lens_N)
    N, h, B, _ = q_NhBD.shape
    S = int(kv_lens_N.max()) if N else 0
    k_NgSD, v_NgSD = k_PgSD[slots_N, :, :S], v_PgSD[slots_N, :, :S]
    allowed_NS = torch.arange(S, device=q_NhBD.device).unsqueeze(0) < kv_lens_N.to(q_NhBD.device).unsqueeze(1)
    mask = allowed_NS.view(N, 1, 1, S).expand(N, 1, B, S)
    return F.scaled_dot_product_attention(
        q_NhBD, k_NgSD, v_NgSD, attn_mask=mask, enable_gqa=k_NgSD.shape[1] != h
    )


def sliding_block_attention(
    q_NhBD: torch.Tensor, k_PgCD: torch.Tensor, v_PgCD: torch.Tensor, slots_N: torch.Tensor, starts_N: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """A sliding-window layer's block attention over pool slots (SpecForge's training mask at the
    block of anchor position a = starts[n]): block row q sees context positions p in
    [a + q - (W - 1), a) and block rows <= q. Gathers only the W - 1 + B rows that can be seen
    (indices from the device lengths: no host sync, shapes fixed by N, W and B), then SDPA.
    """
    N, h, B, _ = q_NhBD.shape
    device = q_NhBD.device
    span = window - 1 + B
    pos_NJ = starts_N.long().unsqueeze(1) - (window - 1) + torch.arange(span, device=device)
    rows_NJ = pos_NJ.clamp(min=0)
    k_NgJD = k_PgCD[slots_N.unsqueeze(1), :, rows_NJ].transpose(1, 2)
    v_NgJD = v_PgCD[slots_N.unsqueeze(1), :, rows_NJ].transpose(1, 2)
    a_N11 = starts_N.long().view(N, 1, 1)
    q_1B1 = torch.arange(B, device=device).view(1, B, 1)
    p_N1J = pos_NJ.unsqueeze(1)
    context_ok = (p_N1J >= 0) & (p_N1J < a_N11) & (p_N1J >= a_N11 + q_1B1 - (window - 1))
    block_ok = (p_N1J >= a_N11) & (p_N1J <= a_N11 + q_1B1)
    mask = (context_ok | block_ok).unsqueeze(1)
    return F.scaled_dot_product_attention(q_NhBD, k_NgJD, v_NgJD, attn_mask=mask, enable_gqa=k_PgCD.shape[1] != h)


def num_splits_for(num_requests: int, num_kv_heads: int, capacity: int) -> int:
    """Key splits per (request, KV head): as many as keep the grid within _TARGET_PROGRAMS (one
    wave of two programs per SM: rounding up put 320 programs in a 264-slot wave at 8 requests x
    8 KV heads, and the straggling 56 cost 20 % at an 8k context, docs/performance.md), none
    shorter than _MIN_SPLIT_KEYS (each split writes a [rows, D] fp32 partial that the merge reads
    back: at a short context, many splits move more partial bytes than K/V bytes)."""
    wanted = max(1, _TARGET_PROGRAMS // max(1, num_requests * num_kv_heads))
    return max(1, min(wanted, math.ceil(capacity / _MIN_SPLIT_KEYS)))


def unsupported_reason(device_type: str, dtype: torch.dtype) -> str | None:
    """Why `block_attention` cannot run on `device_type`, or None (bf16, fp16 and fp32 `dtype` all run)."""
    return launch.unsupported_reason(device_type)


def block_attention(
    q_NhBD: torch.Tensor, k_PgSD: torch.Tensor, v_PgSD: torch.Tensor, slots_N: torch.Tensor, kv_lens_N: torch.Tensor
) -> torch.Tensor:
    """The Triton kernel of `block_attention_reference` (same contract; CUDA, bf16/fp16 or fp32).

    q_NhBD: [N, h, B, D] block queries (normed, rotated); k_PgSD / v_PgSD: [P, g, S, D] pool
    tensors with the last dim contiguous; slots_N, kv_lens_N: [N] ints on q's device, each length
    in [1, S]. Reads no key past a request's length; no host sync. Returns [N, h, B, D] in q's dtype
    (a transposed view of [N, B, h, D] memory).
    """
    _check(q_NhBD, k_PgSD, v_PgSD, slots_N, kv_lens_N)
    if not q_NhBD.is_cuda:
        raise ConfigError(f"block_attention: q is on {q_NhBD.device}; the Triton kernel needs CUDA (use the reference)")
    return _launch(q_NhBD, k_PgSD, v_PgSD, slots_N, kv_lens_N)


def _launch(q_NhBD, k_NgSD, v_NgSD, slots_N, kv_lens_N) -> torch.Tensor:
    """The split launch and, past one split, the merge launch (also what Triton's CPU interpreter
    runs in development)."""
    from epdraft.kernels.step._attention_triton import block_attention_split_kernel

    for name, t in (("q", q_NhBD), ("k", k_NgSD), ("v", v_NgSD)):
        if t.stride(-1) != 1:
            raise ConfigError(f"block_attention: {name}'s last dim must be contiguous, strides {t.stride()}")
    N, h, B, D = q_NhBD.shape
    g, S = k_NgSD.shape[1], k_NgSD.shape[2]
    G = h // g
    slots_N, kv_lens_N = slots_N.contiguous(), kv_lens_N.contiguous()  # the kernel reads them as flat arrays
    rows = max(16, next_pow2(G * B))
    splits = num_splits_for(N, g, S)
    chunk = math.ceil(math.ceil(S / splits) / _BLOCK_S) * _BLOCK_S
    # [N, B, h, D] memory, returned as its [N, h, B, D] view: the o_proj reads it without a copy
    out_NBhD = q_NhBD.new_empty(N, B, h, D)
    # one split (past 132 (request, KV head) pairs, e.g. 17+ requests at 8 KV heads, or <= 256 keys): the
    # split launch writes the output, no partials, no merge
    finish = splits == 1
    if finish:
        acc = stat = out_NBhD  # never read nor written: stand-ins for the partials' pointer and strides
    else:
        acc = q_NhBD.new_empty(N, g, splits, rows, D, dtype=torch.float32)
        stat = q_NhBD.new_empty(N, g, splits, rows, 2, dtype=torch.float32)
    if N:
        block_attention_split_kernel[(N, g, splits)](
            q_NhBD, k_NgSD, v_NgSD, slots_N, kv_lens_N, acc, stat, out_NBhD,
            q_NhBD.stride(0), q_NhBD.stride(1), q_NhBD.stride(2),
            k_NgSD.stride(0), k_NgSD.stride(1), k_NgSD.stride(2),
            v_NgSD.stride(0), v_NgSD.stride(1), v_NgSD.stride(2),
            acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3),
            stat.stride(0), stat.stride(1), stat.stride(2),
            *out_NBhD.stride()[:3],
            D**-0.5 * math.log2(math.e),
            chunk,
            G=G, B=B, D=D, ROWS=rows, BLOCK_S=_BLOCK_S, BLOCK_D=max(16, next_pow2(D)),
            PRECISION="ieee" if q_NhBD.dtype == torch.float32 else "tf32",  # fp32 means fp32, not TF32
            FINISH=finish, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES, **launch.kwargs(q_NhBD.device),
        )  # fmt: skip
    if not finish:
        merge_attention_splits(acc, stat, out_NBhD, G, B)
    return out_NBhD.transpose(1, 2)
