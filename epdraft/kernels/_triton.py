"""Triton kernels of the fused experts. Imported only when a kernel runs (it imports triton).

Wrappers, shape checks and launch geometry live in `align.py` and `fused_moe.py`; this module is
the device code alone.
"""

from __future__ import annotations

import triton
import triton.language as tl

ACT_SWIGLU = 0
ACT_SWIGLUOAI = 1


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    cursor_ptr,
    num_pairs,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program: histogram -> padded offsets -> block experts -> scatter pairs by atomics."""
    drop_bin = NUM_BINS - 1  # >= num_experts: collects -1 and out-of-range ids
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        e = tl.where((e >= 0) & (e < num_experts), e, drop_bin)
        counts += tl.histogram(e, NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    counts = tl.where(bins < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    starts = ends - padded
    tl.store(cursor_ptr + bins, starts)
    # blocks past `total` are never read (the GEMMs exit first), so only real groups are labelled:
    # step j labels every expert's j-th block at once
    first_block = starts // BLOCK_M
    expert_blocks = padded // BLOCK_M
    for j in range(0, tl.max(expert_blocks, 0)):
        tl.store(block_expert_ptr + first_block + j, bins, mask=j < expert_blocks)
    for r0 in range(0, total, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + rows, num_pairs, mask=rows < total)
    # the cursor and padding stores above must land before any thread's atomics and scatter
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        keep = (offs < num_pairs) & (e >= 0) & (e < num_experts)
        pos = tl.atomic_add(cursor_ptr + e, 1, mask=keep, sem="relaxed")  # ordered by the barrier
        tl.store(sorted_ptr + pos, offs, mask=keep)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def gemm1_act_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    h_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    num_blocks,
    F,
    H,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_be,
    stride_hm,
    limit,
    alpha,
    TOP_K: tl.constexpr,
    ACT: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """h[rows, n] = act(x W_gate^T + b_gate, x W_up^T + b_up) for one block of sorted rows.

    Block index runs fastest, so programs running together share an expert's weight tile in L2.
    """
    pid = tl.program_id(0)
    pid_m = pid % num_blocks
    pid_n = pid // num_blocks
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_w = offs_n % F  # wrap instead of masking the weight loads; wrapped columns are not stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh
    g_ptrs = w_ptr + expert * stride_we + offs_n_w[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + F * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_left = H - k * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
            g = tl.load(g_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            u = tl.load(u_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc_g = tl.dot(a, g, acc_g)
        acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + expert * stride_be + offs_n_w).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + expert * stride_be + F + offs_n_w).to(tl.float32)[None, :]
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    if ACT == 0:
        h = acc_g * tl.sigmoid(acc_g) * acc_u
    else:
        h = (acc_u + 1.0) * (acc_g * tl.sigmoid(acc_g * alpha))
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=offs_n[None, :] < F)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def gemm2_weight_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    topk_weights_ptr,
    num_pairs,
    num_blocks,
    H,
    F,
    stride_hm,
    stride_we,
    stride_wh,
    stride_be,
    stride_os,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[split, pair, n] = w_pair * (h W_down^T (+ b_down in split 0)) over this split's slice of F.

    Split-K gives short down GEMMs (few rows, K = F) enough programs to cover the SMs; the
    partial sums are added in a fixed order by `topk_sum_kernel`, so the result is deterministic.
    """
    pid = tl.program_id(0)
    pid_m = pid % num_blocks
    rest = pid // num_blocks
    pid_n = rest % tl.cdiv(H, BLOCK_N)
    pid_k = rest // tl.cdiv(H, BLOCK_N)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_w = offs_n % H
    k_tiles = tl.cdiv(tl.cdiv(F, BLOCK_K), SPLIT_K)
    k_start = pid_k * k_tiles * BLOCK_K
    offs_k = k_start + tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n_w[None, :].to(tl.int64) * stride_wh + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, k_tiles):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_left = F - k * BLOCK_K  # offs_k already counts this split's start
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(b_ptr + expert * stride_be + offs_n_w).to(tl.float32)[None, :]
    weight = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + pid_k * stride_os + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < H))


@triton.jit
def topk_sum_kernel(
    out_ptr,
    ids_ptr,
    y_ptr,
    H,
    num_experts,
    stride_os,
    stride_om,
    stride_yt,
    TOP_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """y[t] = sum over j, split of out[split, t*K + j] in fp32, in a fixed order; dropped pairs skipped."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j)
        keep = (e >= 0) & (e < num_experts)
        for s in tl.static_range(SPLIT_K):
            ptrs = out_ptr + s * stride_os + (t * TOP_K + j) * stride_om + offs
            acc += tl.load(ptrs, mask=in_h & keep, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_yt + offs, acc.to(y_ptr.dtype.element_ty), mask=in_h)
