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
    """One draft row r = n * K + i: q = softmax(logits / T) (one-hot argmax at T = 0), stored fp32,
    and the token at the inverse CDF of q at u = uniforms(seed_n, first_n + i, STREAM), with fp64
    sums of the stored q."""
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
        best = tl.full([], float("-inf"), tl.float32)
        token = tl.full([], 0, tl.int64)
        for start in range(0, V, BLOCK_V):
            x = tl.load(row + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
            m = tl.max(x, axis=0)
            at = start + tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64)
            token = tl.where(m > best, at, token)  # strictly greater: the first maximum wins, as torch.argmax
            best = tl.maximum(best, m)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            tl.store(out + idx, tl.where(idx == token, 1.0, 0.0), mask=idx < V)
        tl.store(tokens_ptr + r, token)
    else:
        # max and normalizer of the scaled logits, online over the row's blocks
        m_run = tl.full([], float("-inf"), tl.float32)
        s_run = tl.full([], 0.0, tl.float32)
        for start in range(0, V, BLOCK_V):
            x = tl.load(row + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32) / temperature
            m_new = tl.maximum(m_run, tl.max(x, axis=0))
            s_run = s_run * tl.exp(m_run - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m_run = m_new
        # q stored, its fp64 total and its last nonzero token (the fallback should rounding leave the scan short)
        total = tl.full([], 0.0, tl.float64)
        last = tl.full([], 0, tl.int64)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            ok = idx < V
            x = tl.load(row + idx, mask=ok, other=float("-inf")).to(tl.float32) / temperature
            q = tl.exp(x - m_run) / s_run
            tl.store(out + idx, q, mask=ok)
            total += tl.sum(q.to(tl.float64), axis=0)
            last = tl.maximum(last, tl.max(tl.where(q > 0.0, idx.to(tl.int64), 0), axis=0))
        lo, hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
        p_lo, p_hi = position & 0xFFFFFFFF, (position >> 32) & 0xFFFFFFFF
        words = (lo.to(tl.uint32), hi.to(tl.uint32), p_lo.to(tl.uint32), p_hi.to(tl.uint32))
        a = _hash(*words, tl.full([], STREAM, tl.uint32), tl.full([], 0x9E3779B9, tl.uint32)) >> 6
        b = _hash(*words, tl.full([], STREAM, tl.uint32), tl.full([], 0x7F4A7C15, tl.uint32)) >> 5
        u = (a.to(tl.float64) * 134217728.0 + b.to(tl.float64)) * 1.1102230246251565e-16  # (a * 2**27 + b) * 2**-53
        point = u * total
        # the inverse CDF: the first token whose cumulative q passes the point (q recomputed bit-equal to the stored)
        token = tl.full([], V, tl.int64)
        cumulative = tl.full([], 0.0, tl.float64)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32) / temperature
            q = (tl.exp(x - m_run) / s_run).to(tl.float64)
            cdf = cumulative + tl.cumsum(q, axis=0)
            hit = tl.min(tl.where((cdf > point) & (idx < V), idx.to(tl.int64), V), axis=0)
            token = tl.minimum(token, hit)
            cumulative += tl.sum(q, axis=0)
        tl.store(tokens_ptr + r, tl.where(token < V, token, last))
