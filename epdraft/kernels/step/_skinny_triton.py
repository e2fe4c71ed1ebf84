"""The Triton programs of `epdraft.kernels.step.skinny` (imported on first launch, never at package import).

A draft step's dense projections multiply few rows (N requests x B block rows, at most
`skinny.MAX_ROWS`) by large weights: memory-bound on the weight bytes. A program owns BLOCK_N
weight rows (output columns) over one of SPLIT_K slices of K and all of the step's rows, so each
weight byte is read once, and several weights (q, k, v) or a gate/up pair run in one launch.
Splitting K gives a narrow projection (a 1536-wide gate/up: 48 column tiles) enough programs to
stream from every SM; the splits' fp32 partials are summed in split order by the tile's last
program to arrive, so the result does not depend on which came last.

With PDL a program prefetches the first PREFETCH bytes of each of its weight rows' K slice into
L2 before it waits for the previous kernel (`epdraft.kernels.launch`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from epdraft.kernels._launch_triton import launch_next, prefetch_l2, wait_previous
from epdraft.kernels.step._step_triton import gated


@triton.jit
def _k_range(pid_k, K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[k_start, k_stop) of split pid_k: whole BLOCK_K tiles, the last split may hold fewer."""
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * per_split
    return k_start, tl.minimum(k_start + per_split, K)


@triton.jit
def _prefetch_rows(w_ptr, n0, N, k_start, stride_wn, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """With PDL, this program's weight rows [n0, n0 + BLOCK_N) get their first PREFETCH bytes from
    k_start prefetched into L2 (called between `launch_next` and `wait_previous`: no kernel writes weights)."""
    if PDL and PREFETCH > 0:
        n = tl.minimum(n0 + tl.arange(0, BLOCK_N), N - 1)
        prefetch_l2(w_ptr + n.to(tl.int64) * stride_wn + k_start, tl.full([BLOCK_N], PREFETCH, tl.int32))


@triton.jit
def _enter(w_ptr, n0, N, k_start, stride_wn, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """PDL entry of a one-weight program: the next kernel may launch, its weight rows are
    prefetched (`_prefetch_rows`), then the wait for the previous kernel."""
    launch_next(PDL)
    _prefetch_rows(w_ptr, n0, N, k_start, stride_wn, BLOCK_N, PREFETCH, PDL)
    wait_previous(PDL)


@triton.jit
def _row_tiles(x_ptr, w_ptr, n0, M, N, k_start, k_stop, stride_xm, stride_wn, acc,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """acc + x[:M, k_start:k_stop] @ w[n0 : n0 + BLOCK_N, k_start:k_stop]^T (fp32 accumulation)."""
    m = tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m[:, None] * stride_xm + k[None, :]
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :]
    for k0 in range(k_start, k_stop, BLOCK_K):
        k_ok = (k0 + k) < k_stop
        x = tl.load(x_ptrs + k0, mask=(m < M)[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=(n < N)[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _last_split(part_ptrs, arrived_ptr, tile, pid_k, stride_ps, acc, mask, SPLIT_K: tl.constexpr):
    """Store this split's partial acc; (whether this program is the tile's last split to arrive,
    the sum of all splits' partials in split order when it is). The last one resets the count."""
    tl.store(part_ptrs + pid_k * stride_ps, acc, mask=mask)
    tl.debug_barrier()  # every thread's partials are written before the release below
    last = tl.atomic_add(arrived_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
    total = tl.zeros(acc.shape, tl.float32)
    if last:
        tl.store(arrived_ptr + tile, 0)
        total = _sum_splits(part_ptrs, stride_ps, mask, acc.shape, SPLIT_K)
    return last, total


@triton.jit
def _sum_splits(part_ptrs, stride_ps, mask, shape: tl.constexpr, SPLIT_K: tl.constexpr):
    """The SPLIT_K partials at part_ptrs (split s at + s * stride_ps) summed in split order, past L1."""
    total = tl.zeros(shape, tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(part_ptrs + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def skinny_linear_kernel(
    x_ptr, w0_ptr, w1_ptr, w2_ptr, out_ptr, part_ptr, arrived_ptr,
    M, N0, N1, N2, K, stride_xm, stride_w0, stride_w1, stride_w2, stride_om, stride_ps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr = 0, PDL: tl.constexpr = False,
):  # fmt: skip
    """out[:, concat] = x @ [w0; w1; w2]^T: column tiles [0, t0) are w0's, then w1's, then w2's
    (a weight with N_i = 0 has none); program pid is tile pid // SPLIT_K, split pid % SPLIT_K.
    out's columns are w0's, then w1's, then w2's; part_ptr [SPLIT_K, M, N0 + N1 + N2] fp32 and
    arrived_ptr (one zeroed count per tile, left zeroed) serve SPLIT_K > 1."""
    tile = tl.program_id(0) // SPLIT_K
    pid_k = tl.program_id(0) % SPLIT_K
    t0 = tl.cdiv(N0, BLOCK_N)
    t1 = tl.cdiv(N1, BLOCK_N)
    which = (tile >= t0).to(tl.int32) + (tile >= t0 + t1).to(tl.int32)
    n0 = (tile - tl.where(which == 0, 0, tl.where(which == 1, t0, t0 + t1))) * BLOCK_N
    N = tl.where(which == 0, N0, tl.where(which == 1, N1, N2))
    col = tl.where(which == 0, 0, tl.where(which == 1, N0, N0 + N1))
    k_start, k_stop = _k_range(pid_k, K, SPLIT_K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if which == 0:
        _enter(w0_ptr, n0, N, k_start, stride_w0, BLOCK_N, PREFETCH, PDL)
        acc = _row_tiles(x_ptr, w0_ptr, n0, M, N, k_start, k_stop, stride_xm, stride_w0, acc, BLOCK_M, BLOCK_N, BLOCK_K)
    elif which == 1:
        _enter(w1_ptr, n0, N, k_start, stride_w1, BLOCK_N, PREFETCH, PDL)
        acc = _row_tiles(x_ptr, w1_ptr, n0, M, N, k_start, k_stop, stride_xm, stride_w1, acc, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        _enter(w2_ptr, n0, N, k_start, stride_w2, BLOCK_N, PREFETCH, PDL)
        acc = _row_tiles(x_ptr, w2_ptr, n0, M, N, k_start, k_stop, stride_xm, stride_w2, acc, BLOCK_M, BLOCK_N, BLOCK_K)
    m = tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    mask = (m < M)[:, None] & (n < N)[None, :]
    o_ptrs = out_ptr + m[:, None] * stride_om + (col + n)[None, :]
    if SPLIT_K == 1:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part_ptrs = part_ptr + m[:, None] * (N0 + N1 + N2) + (col + n)[None, :]
        last, total = _last_split(part_ptrs, arrived_ptr, tile, pid_k, stride_ps, acc, mask, SPLIT_K)
        if last:
            tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def skinny_gate_up_kernel(
    x_ptr, wg_ptr, wu_ptr, out_ptr, part_ptr, arrived_ptr,
    M, I, K, stride_xm, stride_wg, stride_wu, stride_om, stride_ps, limit, alpha,
    SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr = 0, PDL: tl.constexpr = False,
):  # fmt: skip
    """out = act(x @ wg^T, x @ wu^T) for one BLOCK_N column tile (program pid: tile pid // SPLIT_K,
    split pid % SPLIT_K): the gate and up GEMMs and the gated activation (fp32, as
    `epdraft.layers.activations.gated_act`, rounded to out's dtype) in one launch, the gate and up
    products rounded to x's dtype first as nn.Linear rounds them. part_ptr [SPLIT_K, M, 2 I] fp32
    (gate columns, then up) and arrived_ptr as in `skinny_linear_kernel`."""
    tile = tl.program_id(0) // SPLIT_K
    pid_k = tl.program_id(0) % SPLIT_K
    n0 = tile * BLOCK_N
    dtype = out_ptr.dtype.element_ty
    k_start, k_stop = _k_range(pid_k, K, SPLIT_K, BLOCK_K)
    launch_next(PDL)
    _prefetch_rows(wg_ptr, n0, I, k_start, stride_wg, BLOCK_N, PREFETCH, PDL)
    _prefetch_rows(wu_ptr, n0, I, k_start, stride_wu, BLOCK_N, PREFETCH, PDL)
    wait_previous(PDL)
    m = tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m[:, None] * stride_xm + k[None, :]
    wg_ptrs = wg_ptr + n[:, None].to(tl.int64) * stride_wg + k[None, :]
    wu_ptrs = wu_ptr + n[:, None].to(tl.int64) * stride_wu + k[None, :]
    g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):  # both weights' tiles in one loop: twice the loads in flight
        k_ok = (k0 + k) < k_stop
        w_ok = (n < I)[:, None] & k_ok[None, :]
        x = tl.load(x_ptrs + k0, mask=(m < M)[:, None] & k_ok[None, :], other=0.0)
        g = tl.dot(x, tl.trans(tl.load(wg_ptrs + k0, mask=w_ok, other=0.0)), g)
        u = tl.dot(x, tl.trans(tl.load(wu_ptrs + k0, mask=w_ok, other=0.0)), u)
    mask = (m < M)[:, None] & (n < I)[None, :]
    o_ptrs = out_ptr + m[:, None] * stride_om + n[None, :]
    if SPLIT_K == 1:
        h = gated(g.to(dtype).to(tl.float32), u.to(dtype).to(tl.float32), limit, alpha, SWIGLU, HAS_LIMIT)
        tl.store(o_ptrs, h.to(dtype), mask=mask)
    else:
        part_ptrs = part_ptr + m[:, None] * (2 * I) + n[None, :]
        tl.store(part_ptrs + I + pid_k * stride_ps, u, mask=mask)  # up's partial; gate's goes with the count
        last, g = _last_split(part_ptrs, arrived_ptr, tile, pid_k, stride_ps, g, mask, SPLIT_K)
        if last:
            u = _sum_splits(part_ptrs + I, stride_ps, mask, (BLOCK_M, BLOCK_N), SPLIT_K)
            h = gated(g.to(dtype).to(tl.float32), u.to(dtype).to(tl.float32), limit, alpha, SWIGLU, HAS_LIMIT)
            tl.store(o_ptrs, h.to(dtype), mask=mask)
