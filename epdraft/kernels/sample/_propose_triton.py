"""The Triton program of `epdraft.kernels.sample.propose` (imported on first launch, never at package import)."""

from __future__ import annotations

import triton
import triton.language as tl

from epdraft.kernels._launch_triton import enter


@triton.jit
def _fmix32(h):
    """murmur3's 32-bit finalizer on uint32 (wrapping products), as `epdraft.sampling.counter_rng`."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _hash(seed_lo, seed_hi, pos_lo, pos_hi, stream, salt):
    h = _fmix32(salt ^ seed_lo)
    h = _fmix32(h ^ seed_hi)
    h = _fmix32(h ^ pos_lo)
    h = _fmix32(h ^ pos_hi)
    return _fmix32(h ^ stream)


@triton.jit
def propose_kernel(
    logits_ptr, temp_ptr, seed_ptr, first_ptr, tokens_ptr, q_ptr,
    V, K, stride_row, STREAM: tl.constexpr, BLOCK_V: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """One draft row r = n * K + i: q = softmax(logits * (1 / T)) (one-hot first argmax at T = 0),
    stored fp32, and the token at the inverse CDF of the stored q at u = uniforms(seed_n,
    first_n + i, STREAM), its sums in fp64.

    Each lane of a block keeps its own running max / sum across the row's blocks (one reduction per
    pass, not one per block); the scan sums each block and takes the cumulative sum of the one
    block where the point falls, then stops reading.
    """
    enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    n = r // K
    temperature = tl.load(temp_ptr + n)
    seed = tl.load(seed_ptr + n)
    position = tl.load(first_ptr + n) + r % K
    row = logits_ptr + r * stride_row
    out = q_ptr + r * V
    offs = tl.arange(0, BLOCK_V)
    if temperature == 0.0:
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        at = tl.full([BLOCK_V], 0, tl.int32)
        for start in range(0, V, BLOCK_V):
            x = tl.load(row + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
            at = tl.where(x > best, start + offs, at)  # strictly greater: each lane keeps its first maximum
            best = tl.maximum(best, x)
        top = tl.max(best, axis=0)
        token = tl.min(tl.where(best == top, at, V), axis=0)  # the first maximum of the row, as torch.argmax
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            tl.store(out + idx, tl.where(idx == token, 1.0, 0.0), mask=idx < V)
        tl.store(tokens_ptr + r, token.to(tl.int64))
    else:
        inv_t = 1.0 / temperature
        m_lane = tl.full([BLOCK_V], float("-inf"), tl.float32)
        s_lane = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):
            x = tl.load(row + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m_lane, x)
            keep = tl.where(m_new == float("-inf"), 0.0, tl.exp(m_lane - m_new))
            s_lane = s_lane * keep + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
            m_lane = m_new
        m = tl.max(m_lane, axis=0)
        inv_s = 1.0 / tl.sum(tl.where(m_lane == float("-inf"), 0.0, s_lane * tl.exp(m_lane - m)), axis=0)
        # q stored; its fp64 total and last nonzero token (the fallback should rounding leave the scan short)
        total_lane = tl.zeros([BLOCK_V], tl.float64)
        last_lane = tl.zeros([BLOCK_V], tl.int32)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            ok = idx < V
            x = tl.load(row + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            q = tl.exp(x - m) * inv_s
            tl.store(out + idx, q, mask=ok)
            total_lane += q.to(tl.float64)
            last_lane = tl.maximum(last_lane, tl.where(q > 0.0, idx, 0))
        total = tl.sum(total_lane, axis=0)
        last = tl.max(last_lane, axis=0)
        lo, hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
        p_lo, p_hi = position & 0xFFFFFFFF, (position >> 32) & 0xFFFFFFFF
        words = (lo.to(tl.uint32), hi.to(tl.uint32), p_lo.to(tl.uint32), p_hi.to(tl.uint32))
        a = _hash(*words, tl.full([], STREAM, tl.uint32), tl.full([], 0x9E3779B9, tl.uint32)) >> 6
        b = _hash(*words, tl.full([], STREAM, tl.uint32), tl.full([], 0x7F4A7C15, tl.uint32)) >> 5
        u = (a.to(tl.float64) * 134217728.0 + b.to(tl.float64)) * 1.1102230246251565e-16  # (a * 2**27 + b) * 2**-53
        point = u * total
        # the inverse CDF: the first token whose cumulative q passes the point (q recomputed bit-equal to the stored)
        token = tl.full([], V, tl.int32)
        cumulative = tl.full([], 0.0, tl.float64)
        for start in range(0, V, BLOCK_V):
            if token == V:
                idx = start + offs
                x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
                q = (tl.exp(x - m) * inv_s).to(tl.float64)
                block = tl.sum(q, axis=0)
                if cumulative + block > point:
                    cdf = cumulative + tl.cumsum(q, axis=0)
                    token = tl.min(tl.where((cdf > point) & (idx < V), idx, V), axis=0)
                cumulative += block
        tl.store(tokens_ptr + r, tl.where(token < V, token, last).to(tl.int64))
