"""Triton kernels of the fused experts. Imported only when a kernel runs (it imports triton).

Wrappers, shape checks and launch geometry live in `align.py` and `fused_moe.py`; this module is
the device code alone.
"""

from __future__ import annotations

import triton
import triton.language as tl

ACT_SWIGLU = 0
ACT_SWIGLUOAI = 1


@triton.jit
def _load_chunk(ids_ptr, start, end, num_experts, CHUNK: tl.constexpr):
    """Pair ids start..start+CHUNK, their expert (0 where dropped) and whether each is kept (< end, in [0, E))."""
    offs = start + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < end, other=-1).to(tl.int32)
    keep = (offs < end) & (e >= 0) & (e < num_experts)
    return offs, tl.where(keep, e, 0), keep


@triton.jit
def _place_chunk(sorted_ptr, offs, e, keep, next_row, CHUNK: tl.constexpr):
    """Write each kept pair id at its expert's next free row plus its rank among equal experts in the chunk."""
    earlier = tl.arange(0, CHUNK)[None, :] < tl.arange(0, CHUNK)[:, None]
    same = (e[:, None] == e[None, :]) & keep[None, :] & earlier
    row = tl.gather(next_row, e, 0) + tl.sum(same.to(tl.int32), 1)
    tl.store(sorted_ptr + row, offs, mask=keep)


@triton.jit(do_not_specialize=["num_pairs", "pairs_per_prog"])
def align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    counts_ptr,
    sync_ptr,
    num_pairs,
    num_experts,
    pairs_per_prog,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,
    EXPERTS_PER_PROG: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    ONE_PROG: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
):
    """Program p sorts pairs [p*pairs_per_prog, (p+1)*pairs_per_prog) into their block-padded groups.

    1. count the pairs of each expert in its slice (`counts_ptr[p]`);
    2. wait at a grid barrier: every program must be resident at once, so the grid is at most
       one program per SM (the launch sees to it);
    3. read every program's counts: totals give the group starts, the lower programs' counts
       give where this slice's pairs of each expert begin, so pairs keep ascending order;
    4. place its pairs: row = next free row of its expert + rank among equal experts in the chunk;
    5. label the blocks and pad the groups of experts p, p + grid, p + 2 grid, ...
    The program that finishes last zeroes `sync_ptr` again for the next launch. ONE_PROG (a grid
    of one) skips 2-3 and the counters; ONE_CHUNK (a slice of at most CHUNK pairs) reads ids once.
    """
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    lo = pid * pairs_per_prog
    hi = tl.minimum(lo + pairs_per_prog, num_pairs)
    bins = tl.arange(0, NUM_BINS)
    if ONE_CHUNK:
        offs, e, keep = _load_chunk(ids_ptr, lo, hi, num_experts, CHUNK)
        mine = tl.histogram(e, NUM_BINS, mask=keep)
    else:
        mine = tl.zeros([NUM_BINS], dtype=tl.int32)
        for start in range(lo, hi, CHUNK):
            _, e, keep = _load_chunk(ids_ptr, start, hi, num_experts, CHUNK)
            mine += tl.histogram(e, NUM_BINS, mask=keep)
    if ONE_PROG:
        total = mine
        before = tl.zeros([NUM_BINS], dtype=tl.int32)
    else:
        tl.store(counts_ptr + pid * NUM_BINS + bins, mine)
        tl.debug_barrier()  # every thread's counts are written before the release below
        tl.atomic_add(sync_ptr, 1, sem="release")
        while tl.atomic_add(sync_ptr, 0, sem="acquire") < num_progs:
            pass
        total = tl.zeros([NUM_BINS], dtype=tl.int32)
        before = tl.zeros([NUM_BINS], dtype=tl.int32)
        for r in range(0, num_progs, ROWS):
            progs = r + tl.arange(0, ROWS)
            ptrs = counts_ptr + progs[:, None] * NUM_BINS + bins[None, :]
            counts = tl.load(ptrs, mask=progs[:, None] < num_progs, other=0, cache_modifier=".cg")
            total += tl.sum(counts, 0)
            before += tl.sum(tl.where(progs[:, None] < pid, counts, 0), 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, 0) - padded
    if pid == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))
    if ONE_CHUNK:
        _place_chunk(sorted_ptr, offs, e, keep, starts + before, CHUNK)
    else:
        next_row = starts + before
        for start in range(lo, hi, CHUNK):
            offs, e, keep = _load_chunk(ids_ptr, start, hi, num_experts, CHUNK)
            _place_chunk(sorted_ptr, offs, e, keep, next_row, CHUNK)
            next_row += tl.histogram(e, NUM_BINS, mask=keep)
    experts = pid + num_progs * tl.arange(0, EXPERTS_PER_PROG)
    ours = experts < num_experts
    experts = tl.where(ours, experts, 0)
    our_start = tl.gather(starts, experts, 0)
    our_total = tl.gather(total, experts, 0)
    our_padded = tl.where(ours, tl.gather(padded, experts, 0), 0)
    for j in range(0, tl.max(our_padded, 0) // BLOCK_M):
        tl.store(block_expert_ptr + our_start // BLOCK_M + j, experts, mask=j * BLOCK_M < our_padded)
    pad = tl.arange(0, BLOCK_M)
    pad_ptrs = sorted_ptr + (our_start + our_total)[:, None] + pad[None, :]
    tl.store(pad_ptrs, num_pairs, mask=pad[None, :] < (our_padded - our_total)[:, None])
    if not ONE_PROG:
        done = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
        if done == num_progs - 1:
            tl.store(sync_ptr, 0)
            tl.store(sync_ptr + 1, 0)


@triton.jit
def _tile(pid, num_blocks, n_tiles, group_m, SPLIT_K: tl.constexpr):
    """(row block, column tile, K split) of program `pid`.

    Splits of one tile are adjacent; tiles walk `group_m` row blocks down one column tile before
    moving right (group_m >= num_blocks: every block of a column first, so blocks of one expert
    share its weight tile in L2; group_m = 1: along a row block, so programs running together
    read neighbouring weight rows).
    """
    pid_k = pid % SPLIT_K
    tile = pid // SPLIT_K
    per_group = group_m * n_tiles
    first_m = (tile // per_group) * group_m
    rows_in_group = tl.minimum(num_blocks - first_m, group_m)
    pid_m = first_m + (tile % per_group) % rows_in_group
    pid_n = (tile % per_group) // rows_in_group
    return pid_m, pid_n, pid_k


@triton.jit(do_not_specialize=["num_pairs", "group_m"])
def gemm1_act_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    h_ptr,
    part_ptr,
    arrived_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    group_m,
    F,
    H,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_be,
    stride_hm,
    stride_ps,
    limit,
    alpha,
    TOP_K: tl.constexpr,
    ACT: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """h[rows, n] = act(x W_gate^T + b_gate, x W_up^T + b_up), one (row block, column tile, split) per unit.

    Persistent: each program walks units pid, pid + grid, ... over the row blocks actually used;
    without split-K the unit and K loops are flattened into one pipelined loop, so the weight loads
    of the next unit are in flight during this one's epilogue (Triton does not pipeline the split
    epilogue's atomic that way: split units pipeline their own K loop only).
    With SPLIT_K > 1 each unit sums one slice of H into fp32 partials (`part_ptr`, gate then up
    columns); the tile's last unit to arrive (counted in `arrived_ptr`, left zeroed) adds the
    partials in split order and activates, so the result does not depend on which came last.
    """
    num_m = tl.load(num_padded_ptr) // BLOCK_M
    n_tiles = tl.cdiv(F, BLOCK_N)
    k_tiles = tl.cdiv(tl.cdiv(H, BLOCK_K), SPLIT_K)
    for unit in tl.range(tl.program_id(0), num_m * n_tiles * SPLIT_K, tl.num_programs(0), flatten=SPLIT_K == 1):
        pid_m, pid_n, pid_k = _tile(unit, num_m, n_tiles, group_m, SPLIT_K)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows)
        valid = pair < num_pairs
        token = (pair // TOP_K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n_w = offs_n % F  # wrap instead of masking the weight loads; wrapped columns are not stored
        offs_k = pid_k * k_tiles * BLOCK_K + tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh
        g_ptrs = w_ptr + expert * stride_we + offs_n_w[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        u_ptrs = g_ptrs + F * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, k_tiles):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                g = tl.load(g_ptrs)
                u = tl.load(u_ptrs)
            else:
                k_left = H - k * BLOCK_K  # offs_k already counts this split's start
                a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
                g = tl.load(g_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                u = tl.load(u_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BLOCK_K * stride_xh
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        keep = offs_n[None, :] < F
        if SPLIT_K > 1:
            part_ptrs = part_ptr + rows[:, None].to(tl.int64) * (2 * F) + offs_n[None, :]
            tl.store(part_ptrs + pid_k * stride_ps, acc_g, mask=keep)
            tl.store(part_ptrs + pid_k * stride_ps + F, acc_u, mask=keep)
            tl.debug_barrier()  # every thread's partials are written before the release below
            tile_id = pid_m * n_tiles + pid_n
            last = tl.atomic_add(arrived_ptr + tile_id, 1, sem="acq_rel") == SPLIT_K - 1
            tl.store(arrived_ptr + tile_id, 0, mask=last)
            keep = keep & last
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc_g += tl.load(part_ptrs + s * stride_ps, mask=keep, other=0.0, cache_modifier=".cg")
                acc_u += tl.load(part_ptrs + s * stride_ps + F, mask=keep, other=0.0, cache_modifier=".cg")
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
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=keep)


@triton.jit(do_not_specialize=["num_pairs", "group_m"])
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
    group_m,
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

    Persistent like `gemm1_act_kernel`. Split-K gives short down GEMMs (few rows, K = F) more units
    to spread over the SMs; the partial sums are added in a fixed order by `topk_sum_kernel`, so
    the result is deterministic.
    """
    num_m = tl.load(num_padded_ptr) // BLOCK_M
    n_tiles = tl.cdiv(H, BLOCK_N)
    k_tiles = tl.cdiv(tl.cdiv(F, BLOCK_K), SPLIT_K)
    for unit in tl.range(tl.program_id(0), num_m * n_tiles * SPLIT_K, tl.num_programs(0), flatten=True):
        pid_m, pid_n, pid_k = _tile(unit, num_m, n_tiles, group_m, SPLIT_K)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows)
        valid = pair < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n_w = offs_n % H
        offs_k = pid_k * k_tiles * BLOCK_K + tl.arange(0, BLOCK_K)
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
        if HAS_BIAS:  # split 0 adds it; a mask, not an if, keeps the flattened loop one region
            bias = tl.load(b_ptr + expert * stride_be + offs_n_w, mask=(offs_n_w >= 0) & (pid_k == 0), other=0.0)
            acc += bias.to(tl.float32)[None, :]
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
