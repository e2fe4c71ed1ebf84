"""Triton kernels of the fused experts. Imported only when a kernel runs (it imports triton).

Wrappers, shape checks and launch geometry live in `align.py` and `fused.py`; this module is
the device code alone.
"""

from __future__ import annotations

import triton
import triton.language as tl

from epdraft.kernels._launch_triton import enter
from epdraft.kernels.experts.e2m1 import E2M1_CONSTRAINTS, E2M1_HI_PTX, E2M1_LO_PTX, SHIFT_HI_PTX, SHIFT_LO_PTX
from epdraft.kernels.experts.e4m3 import E4M3_CONSTRAINTS, E4M3_PTX

ACT_SWIGLU = 0
ACT_SWIGLUOAI = 1


@triton.jit
def _own_pairs(ids_ptr, offs, num_pairs, num_experts, pid, EXPERTS_PER_PROG: tl.constexpr, FIELD_BITS: tl.constexpr):
    """Per pair of one chunk: its expert's lane in this program, whether it is ours, and a one in that lane's field."""
    e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    lane = e - pid * EXPERTS_PER_PROG
    mine = (lane >= 0) & (lane < EXPERTS_PER_PROG) & (e < num_experts)
    lane = tl.where(mine, lane, 0)
    one = tl.full(offs.shape, 1, tl.int64) << (lane * FIELD_BITS).to(tl.int64)
    return lane, mine, tl.where(mine, one, 0)


@triton.jit(do_not_specialize=["num_pairs"])
def align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    sync_ptr,
    num_pairs,
    num_experts,
    BLOCK_M: tl.constexpr,
    EXPERTS_PER_PROG: tl.constexpr,
    MAX_PROGS: tl.constexpr,
    CHUNK: tl.constexpr,
    FIELD_BITS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program p sorts the pairs of experts [p*EPP, (p+1)*EPP) into their block-padded groups.

    Each program scans every pair twice: counts of its experts, then in-order ranks. Both come from
    one int64 sum / cumsum per chunk in which each of the program's experts owns a FIELD_BITS-wide
    field, so pairs of one expert keep ascending pair order and no per-pair atomics are needed. The
    start of its groups is the sum of the padded sizes of the programs before it: each program
    publishes its own size in `sync_ptr[p]` (as size + 1; 0 = not yet) before it waits on the lower
    programs, so with programs started in index order no program waits on one that cannot run.
    The last program to finish zeroes `sync_ptr` again for the next launch.
    """
    enter(PDL)
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    lanes = tl.arange(0, EXPERTS_PER_PROG)
    experts = pid * EXPERTS_PER_PROG + lanes
    shifts = (lanes * FIELD_BITS).to(tl.int64)
    field_mask = (1 << FIELD_BITS) - 1
    counts = tl.zeros([EXPERTS_PER_PROG], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        _, _, one = _own_pairs(ids_ptr, offs, num_pairs, num_experts, pid, EXPERTS_PER_PROG, FIELD_BITS)
        counts += ((tl.sum(one, 0) >> shifts) & field_mask).to(tl.int32)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.atomic_xchg(sync_ptr + pid, tl.sum(padded, 0) + 1, sem="release")
    progs = tl.arange(0, MAX_PROGS)
    below = progs < pid
    published = tl.atomic_add(sync_ptr + progs, 0, mask=below, sem="acquire")
    while tl.min(tl.where(below, published, 1), 0) == 0:
        published = tl.atomic_add(sync_ptr + progs, 0, mask=below, sem="acquire")
    base = tl.sum(tl.where(below, published - 1, 0), 0)
    starts = base + tl.cumsum(padded, 0) - padded
    if pid == num_progs - 1:
        tl.store(num_padded_ptr, base + tl.sum(padded, 0))
    # block labels and padding rows (pad = num_pairs) of this program's groups
    first_block = starts // BLOCK_M
    for j in range(0, tl.max(padded, 0) // BLOCK_M):
        tl.store(block_expert_ptr + first_block + j, experts, mask=j * BLOCK_M < padded)
    pad_rows = tl.arange(0, BLOCK_M)
    pad_ptrs = sorted_ptr + (starts + counts)[:, None] + pad_rows[None, :]
    tl.store(pad_ptrs, num_pairs, mask=pad_rows[None, :] < (padded - counts)[:, None])
    # pairs: position = group start + number of earlier pairs of the same expert
    seen = starts - 1
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        lane, mine, one = _own_pairs(ids_ptr, offs, num_pairs, num_experts, pid, EXPERTS_PER_PROG, FIELD_BITS)
        rank = ((tl.cumsum(one, 0) >> (lane * FIELD_BITS).to(tl.int64)) & field_mask).to(tl.int32)
        for i in tl.static_range(EXPERTS_PER_PROG):
            rank += tl.where(lane == i, tl.sum(tl.where(lanes == i, seen, 0), 0), 0)
        tl.store(sorted_ptr + rank, offs, mask=mine)
        seen += ((tl.sum(one, 0) >> shifts) & field_mask).to(tl.int32)
    done = tl.atomic_add(sync_ptr + MAX_PROGS, 1, sem="acq_rel")
    if done == num_progs - 1:
        tl.store(sync_ptr + progs, tl.zeros([MAX_PROGS], dtype=tl.int32))
        tl.store(sync_ptr + MAX_PROGS, 0)


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


@triton.jit
def _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """Row block `pid_m`: its expert (int64), its sorted row indices, their pairs, which are pairs (not padding)."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    return expert, rows, pair, pair < num_pairs


@triton.jit
def _cols(pid_n, N, BLOCK_N: tl.constexpr):
    """Column tile `pid_n` of N, and the same wrapped into [0, N): weight loads need no mask, wrapped
    columns are never stored."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_n, offs_n % N


@triton.jit
def _w_tile(w_ptr, w_desc, expert, rows, n_first, k0, stride_we, stride_wn, BLOCK_K: tl.constexpr,
            W_TMA: tl.constexpr):
    """W[expert, rows, k0 : k0 + BLOCK_K] as a [BLOCK_K, len(rows)] tile (K along dim 0, what the dots take).

    W_TMA: one tensor-memory-accelerator copy of rows [n_first, n_first + len(rows)) through
    `w_desc` (a [e, N, K] descriptor, block [1, len(rows), BLOCK_K]; rows past N read as zeros)
    instead of a 16-byte load per thread with its own address: the main loop drops the per-element
    address arithmetic. `rows` (int64, kept inside the expert) are what the per-thread loads read.
    """
    if W_TMA:
        tile = w_desc.load([expert.to(tl.int32), n_first, k0])
        return tl.trans(tl.reshape(tile, [rows.shape[0], BLOCK_K]))
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + expert * stride_we + rows[None, :] * stride_wn + offs_k[:, None])


@triton.jit
def _k_slice(pid_k, K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """K tiles per split, and split `pid_k`'s first BLOCK_K offsets into K."""
    k_tiles = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    return k_tiles, pid_k * k_tiles * BLOCK_K + tl.arange(0, BLOCK_K)


_E2M1_LO_PTX = tl.constexpr(E2M1_LO_PTX)
_E2M1_HI_PTX = tl.constexpr(E2M1_HI_PTX)
_E2M1_CONSTRAINTS = tl.constexpr(E2M1_CONSTRAINTS)
_SHIFT_LO_PTX = tl.constexpr(SHIFT_LO_PTX)
_SHIFT_HI_PTX = tl.constexpr(SHIFT_HI_PTX)
_E4M3_PTX = tl.constexpr(E4M3_PTX)
_E4M3_CONSTRAINTS = tl.constexpr(E4M3_CONSTRAINTS)


@triton.jit
def _even_odd(a_pairs):
    """bf16 K-column pairs read as int32 [M, K/2] -> the even and the odd columns, each [M, K/2] bf16."""
    even = (a_pairs & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    odd = (a_pairs >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return even, odd


@triton.jit
def _e8m0_to_bf16(e, SHIFT: tl.constexpr = False):
    """uint8 e8m0 exponents -> the bf16 scale operand: 2**(e - 127) (e << 7 as bits: 0 for e = 0, +inf
    for e = 255); with SHIFT, the shift decode's 2**(e - 1) ((e + 126) << 7, e <= 128)."""
    if SHIFT:
        return ((e.to(tl.int16) + 126) << 7).to(tl.bfloat16, bitcast=True)
    return (e.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e2m1_to_bf16(w, SHIFT: tl.constexpr = False):
    """uint8 bytes of two e2m1 codes -> (their low nibbles, their high nibbles) as unscaled bf16, same shape.

    `epdraft.kernels.experts.e2m1` says how: table lookups on checkpoint-order bytes, or with SHIFT the
    shift decode of `shift_pack`ed bytes (values times 2**-126). Keep the bytes' `tl.load` right
    before this call: Triton then loads them straight into the dot operand's register layout (see
    E2M1_LO_PTX), whose four bytes a register holds are one aligned 32-bit word of the tile.
    """
    if SHIFT:
        lo = tl.inline_asm_elementwise(_SHIFT_LO_PTX, _E2M1_CONSTRAINTS, [w], dtype=tl.bfloat16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(_SHIFT_HI_PTX, _E2M1_CONSTRAINTS, [w], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        lo = tl.inline_asm_elementwise(_E2M1_LO_PTX, _E2M1_CONSTRAINTS, [w], dtype=tl.bfloat16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(_E2M1_HI_PTX, _E2M1_CONSTRAINTS, [w], dtype=tl.bfloat16, is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _e4m3_to_bf16(w):
    """An e4m3 tile -> its values as bf16 (exact), with integer ops (`epdraft.kernels.experts.e4m3` says how).
    Keep the tile's load right before this call, as for `_e2m1_to_bf16`."""
    return tl.inline_asm_elementwise(_E4M3_PTX, _E4M3_CONSTRAINTS, [w.to(tl.uint8, bitcast=True)],
                                     dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _dot_mxfp4_bits(a_even, a_odd, acc, w_ptr, w_desc, s_ptr, expert, rows, n_first, k0, stride_we, stride_wn,
                    stride_se, stride_sn, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr, SHIFT: tl.constexpr):
    """acc + a @ W[rows, k0 : k0 + BLOCK_K]^T for MXFP4 rows `rows` (int64) of `expert`, a given as its
    even and odd K columns [BLOCK_M, BLOCK_K / 2]: each byte's low nibble is an even column's weight,
    its high nibble the next odd one's, so the two bf16 tiles (`_e2m1_to_bf16`, times the group's
    scale as bf16) multiply a_even and a_odd apart: no weight tile is interleaved.
    """
    offs_s = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scale = _e8m0_to_bf16(tl.load(s_ptr + expert * stride_se + rows[None, :] * stride_sn + offs_s[:, None]), SHIFT)
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], [BLOCK_K // 32, 16, rows.shape[0]]),
                       [BLOCK_K // 2, rows.shape[0]])  # [K/2, N]: one scale per 16 bytes along K
    w = _w_tile(w_ptr, w_desc, expert, rows, n_first, k0 // 2, stride_we, stride_wn, BLOCK_K // 2, W_TMA)  # [K/2, N] u8
    lo, hi = _e2m1_to_bf16(w, SHIFT)
    acc = tl.dot(a_even, lo * scale, acc)
    return tl.dot(a_odd, hi * scale, acc)


@triton.jit
def _dot_quantized(a, acc, w_ptr, w_desc, s_ptr, expert, rows, n_first, k0, stride_we, stride_wn, stride_se, stride_sn,
                   W_FMT: tl.constexpr, QBN: tl.constexpr, QBK: tl.constexpr, BLOCK_K: tl.constexpr,
                   W_TMA: tl.constexpr):
    """acc + a @ W[rows, k0 : k0 + BLOCK_K]^T for quantized weight rows `rows` (int64) of `expert`.

    FP8: the e4m3 tile (exact in bf16: `_e4m3_to_bf16`) times a, then the product times the block's fp32 scale per
    column; MXFP4: `tl.dot_scaled` (e2m1 upcast with its e8m0 scales, exact in bf16). The MXFP4
    bits path is `_dot_mxfp4_bits`.
    """
    if W_FMT == 1:
        w = _w_tile(w_ptr, w_desc, expert, rows, n_first, k0, stride_we, stride_wn, BLOCK_K, W_TMA)
        scale = tl.load(s_ptr + expert * stride_se + (rows // QBN) * stride_sn + k0 // QBK)
        # e4m3 -> bf16 is exact; the block's scale multiplies this K tile's partial product (a BLOCK_K
        # tile never crosses a scale block), BLOCK_M x BLOCK_N multiplies instead of BLOCK_K x BLOCK_N
        return acc + tl.dot(a, _e4m3_to_bf16(w)) * scale[None, :]
    else:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        w = tl.load(w_ptr + expert * stride_we + rows[None, :] * stride_wn + offs_b[:, None])
        offs_s = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        scale = tl.load(s_ptr + expert * stride_se + rows[:, None] * stride_sn + offs_s[None, :])
        return tl.dot_scaled(a, None, "bf16", w, scale, "e2m1", acc)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "group_m"])
def gemm1_act_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    s_ptr,
    b_ptr,
    h_ptr,
    part_ptr,
    arrived_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    num_blocks,
    group_m,
    F,
    H,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
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
    W_FMT: tl.constexpr = 0,
    QBN: tl.constexpr = 1,
    QBK: tl.constexpr = 1,
    MXFP4_DOT_SCALED: tl.constexpr = False,
    W_TMA: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """h[rows, n] = act(x W_gate^T + b_gate, x W_up^T + b_up) for one block of sorted rows.

    W_FMT: 0 = weights in x's dtype; 1 = FP8 e4m3 with fp32 scales per (QBN x QBK) block in `s_ptr`
    (`[e, ceil(2F/QBN), ceil(H/QBK)]`, QBK a multiple of BLOCK_K); 2 = MXFP4, `w_ptr` the packed
    bytes `[e, 2F, H/2]` and `s_ptr` the e8m0 scales `[e, 2F, H/32]`; 3 = MXFP4 with its bytes
    `shift_pack`ed (`epdraft.kernels.experts.e2m1`; the bits path only, every scale <= 128). Quantized tiles are
    converted to bf16 right after their load and scaled (`_dot_quantized`); K must be even.
    MXFP4_DOT_SCALED: MXFP4 through `tl.dot_scaled`; else the bits path (`_dot_mxfp4_bits`), which
    reads x's K-column pairs as int32 (x contiguous along H, stride_xt even, 4-byte aligned).
    W_TMA: weight tiles copied through `w_desc` (`_w_tile`); else `w_desc` is unused.

    With SPLIT_K > 1 each program sums one slice of H into fp32 partials (`part_ptr`, gate then up
    columns); the tile's last program to arrive (counted in `arrived_ptr`, left zeroed) adds the
    partials in split order and applies the activation, so the result does not depend on which
    program came last. Splitting gives short GEMMs enough programs to even out the SMs' work.
    """
    enter(PDL)
    pid_m, pid_n, pid_k = _tile(tl.program_id(0), num_blocks, tl.cdiv(F, BLOCK_N), group_m, SPLIT_K)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, rows, pair, valid = _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M)
    token = (pair // TOP_K).to(tl.int64)
    offs_n, offs_n_w = _cols(pid_n, F, BLOCK_N)
    k_tiles, offs_k = _k_slice(pid_k, H, SPLIT_K, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if W_FMT == 0:
        g_ptrs = w_ptr + expert * stride_we + offs_n_w[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        u_ptrs = g_ptrs + F * stride_wn
        k_first = pid_k * k_tiles * BLOCK_K
        for k in range(0, k_tiles):
            k_left = H - k * BLOCK_K  # offs_k already counts this split's start
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
            if W_TMA:  # columns past H read as zeros
                g = _w_tile(w_ptr, w_desc, expert, offs_n_w, pid_n * BLOCK_N, k_first + k * BLOCK_K, stride_we,
                            stride_wn, BLOCK_K, W_TMA)
                u = _w_tile(w_ptr, w_desc, expert, offs_n_w, F + pid_n * BLOCK_N, k_first + k * BLOCK_K, stride_we,
                            stride_wn, BLOCK_K, W_TMA)
            elif EVEN_K:
                g = tl.load(g_ptrs)
                u = tl.load(u_ptrs)
            else:
                g = tl.load(g_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                u = tl.load(u_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BLOCK_K * stride_xh
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    else:
        tl.static_assert(EVEN_K, "quantized weights need H % (BLOCK_K * SPLIT_K) == 0")
        w_rows = offs_n_w.to(tl.int64)
        k_first = pid_k * k_tiles * BLOCK_K
        a_pairs_ptrs = (x_ptr.to(tl.pointer_type(tl.int32)) + token[:, None] * (stride_xt // 2)
                        + (k_first // 2 + tl.arange(0, BLOCK_K // 2))[None, :])
        for k in range(0, k_tiles):
            if W_FMT >= 2 and not MXFP4_DOT_SCALED:
                a_even, a_odd = _even_odd(tl.load(a_pairs_ptrs + k * (BLOCK_K // 2), mask=valid[:, None], other=0))
                acc_g = _dot_mxfp4_bits(a_even, a_odd, acc_g, w_ptr, w_desc, s_ptr, expert, w_rows, pid_n * BLOCK_N,
                                        k_first + k * BLOCK_K, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K,
                                        W_TMA, W_FMT == 3)
                acc_u = _dot_mxfp4_bits(a_even, a_odd, acc_u, w_ptr, w_desc, s_ptr, expert, w_rows + F,
                                        F + pid_n * BLOCK_N, k_first + k * BLOCK_K, stride_we, stride_wn, stride_se,
                                        stride_sn, BLOCK_K, W_TMA, W_FMT == 3)
            else:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                acc_g = _dot_quantized(a, acc_g, w_ptr, w_desc, s_ptr, expert, w_rows, pid_n * BLOCK_N,
                                       k_first + k * BLOCK_K, stride_we, stride_wn, stride_se, stride_sn, W_FMT, QBN,
                                       QBK, BLOCK_K, W_TMA)
                acc_u = _dot_quantized(a, acc_u, w_ptr, w_desc, s_ptr, expert, w_rows + F, F + pid_n * BLOCK_N,
                                       k_first + k * BLOCK_K, stride_we, stride_wn, stride_se, stride_sn, W_FMT, QBN,
                                       QBK, BLOCK_K, W_TMA)
            a_ptrs += BLOCK_K * stride_xh
    store_n = offs_n[None, :] < F
    if SPLIT_K > 1:
        part_ptrs = part_ptr + rows[:, None].to(tl.int64) * (2 * F) + offs_n[None, :]
        tl.store(part_ptrs + pid_k * stride_ps, acc_g, mask=store_n)
        tl.store(part_ptrs + pid_k * stride_ps + F, acc_u, mask=store_n)
        tl.debug_barrier()  # every thread's partials are written before the release below
        tile_id = pid_m * tl.cdiv(F, BLOCK_N) + pid_n
        if tl.atomic_add(arrived_ptr + tile_id, 1, sem="acq_rel") != SPLIT_K - 1:
            return
        tl.store(arrived_ptr + tile_id, 0)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc_g += tl.load(part_ptrs + s * stride_ps, mask=store_n, other=0.0, cache_modifier=".cg")
            acc_u += tl.load(part_ptrs + s * stride_ps + F, mask=store_n, other=0.0, cache_modifier=".cg")
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
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=store_n)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "group_m"])
def gemm2_weight_kernel(
    h_ptr,
    w_ptr,
    w_desc,
    s_ptr,
    b_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    topk_weights_ptr,
    num_pairs,
    num_blocks,
    group_m,
    H,
    F,
    stride_hm,
    stride_we,
    stride_wh,
    stride_se,
    stride_sh,
    stride_be,
    stride_os,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_FMT: tl.constexpr = 0,
    QBN: tl.constexpr = 1,
    QBK: tl.constexpr = 1,
    MXFP4_DOT_SCALED: tl.constexpr = False,
    W_TMA: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """out[split, pair, n] = w_pair * (h W_down^T (+ b_down in split 0)) over this split's slice of F.

    Split-K gives short down GEMMs (few rows, K = F) enough programs to cover the SMs; the
    partial sums are added in a fixed order by `topk_sum_kernel`, so the result is deterministic.
    W_FMT, QBN, QBK, MXFP4_DOT_SCALED, W_TMA: as in `gemm1_act_kernel`, for W_down `[e, H, F]` (h's pairs as int32).
    """
    enter(PDL)
    pid_m, pid_n, pid_k = _tile(tl.program_id(0), num_blocks, tl.cdiv(H, BLOCK_N), group_m, SPLIT_K)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, rows, pair, valid = _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M)
    offs_n, offs_n_w = _cols(pid_n, H, BLOCK_N)
    k_tiles, offs_k = _k_slice(pid_k, F, SPLIT_K, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if W_FMT == 0:
        w_ptrs = w_ptr + expert * stride_we + offs_n_w[None, :].to(tl.int64) * stride_wh + offs_k[:, None]
        k_first = pid_k * k_tiles * BLOCK_K
        for k in range(0, k_tiles):
            k_left = F - k * BLOCK_K  # offs_k already counts this split's start
            if EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            if W_TMA:  # columns past F read as zeros
                w = _w_tile(w_ptr, w_desc, expert, offs_n_w, pid_n * BLOCK_N, k_first + k * BLOCK_K, stride_we,
                            stride_wh, BLOCK_K, W_TMA)
            elif EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, w, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    else:
        tl.static_assert(EVEN_K, "quantized weights need F % (BLOCK_K * SPLIT_K) == 0")
        w_rows = offs_n_w.to(tl.int64)
        k_first = pid_k * k_tiles * BLOCK_K
        a_pairs_ptrs = (h_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None].to(tl.int64) * (stride_hm // 2)
                        + (k_first // 2 + tl.arange(0, BLOCK_K // 2))[None, :])
        for k in range(0, k_tiles):
            if W_FMT >= 2 and not MXFP4_DOT_SCALED:
                a_even, a_odd = _even_odd(tl.load(a_pairs_ptrs + k * (BLOCK_K // 2)))
                acc = _dot_mxfp4_bits(a_even, a_odd, acc, w_ptr, w_desc, s_ptr, expert, w_rows, pid_n * BLOCK_N,
                                      k_first + k * BLOCK_K, stride_we, stride_wh, stride_se, stride_sh, BLOCK_K, W_TMA,
                                      W_FMT == 3)
            else:
                a = tl.load(a_ptrs)
                acc = _dot_quantized(a, acc, w_ptr, w_desc, s_ptr, expert, w_rows, pid_n * BLOCK_N,
                                     k_first + k * BLOCK_K, stride_we, stride_wh, stride_se, stride_sh, W_FMT, QBN, QBK,
                                     BLOCK_K, W_TMA)
            a_ptrs += BLOCK_K
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
    PDL: tl.constexpr = False,
):
    """y[t] = sum over j, split of out[split, t*K + j] in fp32, in a fixed order; dropped pairs skipped."""
    enter(PDL)
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
