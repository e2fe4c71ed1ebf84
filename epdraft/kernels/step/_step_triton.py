"""The Triton programs of `epdraft.kernels.step.ops` (imported on first launch, never at package import).

Each program replaces a chain of small torch ops of the draft step with one launch and rounds
where the torch chain rounds (to the tensors' dtype after the same steps), so the two differ only
by fp32 rounding inside a step (summation order, fused multiply-adds, the GPU's exp and log), not
by where bf16 rounding happens.
"""

from __future__ import annotations

import triton
import triton.language as tl

from epdraft.kernels._launch_triton import enter


@triton.jit
def rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr,
    H, stride_x, stride_r, stride_o, stride_s, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, ROUND_FIRST: tl.constexpr = True,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """One row: [s = x + r (rounded, stored)], out = w * (s * rsqrt(mean(s^2) + eps) rounded), or with
    ROUND_FIRST off w * (s * rsqrt(...)) in fp32, rounded once (DeepSeek's norm)."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        s = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, s, mask=ok)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    normed = x * rstd
    if ROUND_FIRST:
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _norm_rotate_store(src, w_ptr, cos, sin, dst, stride_dst, heads, D, eps, HEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    """Heads [0, heads) of one row at src (head-major, D each): RMSNorm over each head (rounded to
    dst's dtype, times the weight, rounded), then the half-split rotary; head i goes to dst + i * stride_dst."""
    half = D // 2
    hd = tl.arange(0, HEADS_P).to(tl.int64)  # head x (C x D) passes 2^31 in a long-context pool slot
    i = tl.arange(0, HALF_P)
    ok = (hd < heads)[:, None] & (i < half)[None, :]
    offs = hd[:, None] * D + i[None, :]
    x1 = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + offs, mask=ok, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + half + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
    dtype = dst.dtype.element_ty
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
    n1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    n2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out = dst + hd[:, None] * stride_dst + i[None, :]
    tl.store(out, (n1 * cos[None, :] - n2 * sin[None, :]).to(dtype), mask=ok)
    tl.store(out + half, (n2 * cos[None, :] + n1 * sin[None, :]).to(dtype), mask=ok)


@triton.jit
def _rotary_row(cos_ptr, sin_ptr, pos, stride_tab, D: tl.constexpr, HALF_P: tl.constexpr):
    """(cos, sin) [HALF_P] fp32 of one position from the rotary table (zero past D / 2)."""
    i = tl.arange(0, HALF_P)
    cos = tl.load(cos_ptr + pos * stride_tab + i, mask=i < D // 2, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_tab + i, mask=i < D // 2, other=0.0)
    return cos, sin


@triton.jit
def qk_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr,
    q_out_ptr, pool_k_ptr, pool_v_ptr,
    stride_q, stride_k, stride_v, stride_tab, stride_qo,
    stride_pp, stride_pg, stride_pc, stride_vp, stride_vg, stride_vc,
    eps,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, B: tl.constexpr, D: tl.constexpr,
    Q_P: tl.constexpr, KV_P: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """One block row (request n = row // B): its query heads normed and rotated into q_out [T, h, D];
    its KV heads, k normed and rotated and v as is, into the request's pool slot at the row's position."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    cos, sin = _rotary_row(cos_ptr, sin_ptr, pos, stride_tab, D, HALF_P)
    _norm_rotate_store(q_ptr + row * stride_q, qw_ptr, cos, sin, q_out_ptr + row * stride_qo, D, NUM_Q, D, eps,
                       Q_P, HALF_P)  # fmt: skip
    slot = tl.load(slots_ptr + row // B).to(tl.int64)
    _store_kv(k_ptr + row * stride_k, v_ptr + row * stride_v, kw_ptr, cos, sin, slot, pos, pool_k_ptr, pool_v_ptr,
              stride_pp, stride_pg, stride_pc, stride_vp, stride_vg, stride_vc, eps, NUM_KV, D, KV_P, HALF_P, D_P)  # fmt: skip


@triton.jit
def _store_kv(
    k_src, v_src, kw_ptr, cos, sin, slot, pos, pool_k_ptr, pool_v_ptr,
    stride_pp, stride_pg, stride_pc, stride_vp, stride_vg, stride_vc, eps,
    NUM_KV: tl.constexpr, D: tl.constexpr, KV_P: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr,
):  # fmt: skip
    """One row's KV heads into the pool at (slot, pos): k normed and rotated, v as is."""
    _norm_rotate_store(k_src, kw_ptr, cos, sin, pool_k_ptr + slot * stride_pp + pos * stride_pc,
                       stride_pg, NUM_KV, D, eps, KV_P, HALF_P)  # fmt: skip
    j = tl.arange(0, KV_P).to(tl.int64)
    d = tl.arange(0, D_P)
    ok = (j < NUM_KV)[:, None] & (d < D)[None, :]
    v = tl.load(v_src + j[:, None] * D + d[None, :], mask=ok)
    v_dst = pool_v_ptr + slot * stride_vp + pos * stride_vc + j[:, None] * stride_vg + d[None, :]
    tl.store(v_dst, v.to(pool_v_ptr.dtype.element_ty), mask=ok)


@triton.jit
def kv_rope_store_kernel(
    k_ptr, v_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, pool_k_ptr, pool_v_ptr,
    stride_k, stride_v, stride_tab,
    stride_pp, stride_pg, stride_pc, stride_vp, stride_vg, stride_vc,
    eps,
    NUM_KV: tl.constexpr, D: tl.constexpr, KV_P: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """One context row: its KV heads, k normed and rotated at the row's position and v as is, into
    the pool at the row's own (slot, position) (a commit's rows, `RequestSlots.placement`)."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    cos, sin = _rotary_row(cos_ptr, sin_ptr, pos, stride_tab, D, HALF_P)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    _store_kv(k_ptr + row * stride_k, v_ptr + row * stride_v, kw_ptr, cos, sin, slot, pos, pool_k_ptr, pool_v_ptr,
              stride_pp, stride_pg, stride_pc, stride_vp, stride_vg, stride_vc, eps, NUM_KV, D, KV_P, HALF_P, D_P)  # fmt: skip


@triton.jit
def attention_merge_kernel(
    acc_ptr, stat_ptr, out_ptr, splits,
    stride_an, stride_ah, stride_as, stride_ar,
    stride_sn, stride_sh, stride_ss,
    stride_on, stride_ob, stride_oh,
    G: tl.constexpr, B: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Merge one (request, KV head)'s key splits for ROWS of its rows: weights 2^(m_s - M) bring each
    split's sums to the common max M; row r = query head j*G + r // B, block row r % B, written to
    out [N, B, h, D]."""
    enter(PDL)
    n = tl.program_id(0)
    j = tl.program_id(1)
    rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < G * B
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    s_base = stat_ptr + n * stride_sn + j * stride_sh
    m_max = tl.full((ROWS,), -1.0e30, tl.float32)
    for s in range(0, splits):
        m_max = tl.maximum(m_max, tl.load(s_base + s * stride_ss + rows * 2, mask=row_ok, other=-1.0e30))
    total = tl.zeros((ROWS, BLOCK_D), tl.float32)
    denom = tl.zeros((ROWS,), tl.float32)
    a_base = acc_ptr + n * stride_an + j * stride_ah + rows[:, None] * stride_ar + d[None, :]
    for s in range(0, splits):
        m = tl.load(s_base + s * stride_ss + rows * 2, mask=row_ok, other=-1.0e30)
        l = tl.load(s_base + s * stride_ss + rows * 2 + 1, mask=row_ok, other=0.0)
        w = tl.exp2(m - m_max)
        denom += l * w
        total += tl.load(a_base + s * stride_as, mask=row_ok[:, None] & d_ok[None, :], other=0.0) * w[:, None]
    out = total / tl.maximum(denom, 1e-30)[:, None]
    head = j * G + rows // B
    o_ptrs = out_ptr + n * stride_on + (rows % B)[:, None] * stride_ob + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _partial_logits(
    x_ptr, w_ptr, part_ptr, rows, t_ok, pid_s, E, H, stride_x, stride_w, stride_ps, stride_pt,
    SPLIT_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """The rows' partial logits over H slice pid_s, all E experts BLOCK_E at a time: x upcast to
    fp32 times the weight in fp32, stored to part [S, T, E] (rows int64 [BLOCK_T], t_ok their mask).

    input_precision="ieee": tl.dot's default for fp32 is TF32, whose 10-bit mantissas would move the
    logits by ~1e-3 of their size and pick other experts than the torch path's fp32 GEMM on near-ties.
    Each product is summed in H order by one thread, whatever the tile: a row's partials are the
    same bits in any launch.
    """
    h_start = pid_s * SPLIT_H
    h_end = tl.minimum(h_start + SPLIT_H, H)
    e = tl.arange(0, BLOCK_E)
    h = tl.arange(0, BLOCK_H)
    for e0 in range(0, E, BLOCK_E):
        ee = e0 + e
        e_ok = ee < E
        acc = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
        for h0 in range(h_start, h_end, BLOCK_H):
            hh = h0 + h
            h_ok = hh < H
            x = tl.load(x_ptr + rows[:, None] * stride_x + hh[None, :], mask=t_ok[:, None] & h_ok[None, :], other=0.0)
            w = tl.load(w_ptr + ee[None, :] * stride_w + hh[:, None], mask=h_ok[:, None] & e_ok[None, :], other=0.0)
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        out = part_ptr + pid_s * stride_ps + rows[:, None] * stride_pt + ee[None, :]
        tl.store(out, acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def router_logits_kernel(
    x_ptr, w_ptr, part_ptr, T, E, H, stride_x, stride_w, stride_ps, stride_pt,
    SPLIT_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """BLOCK_T rows' partial logits over one SPLIT_H slice of H (program_id 1): `_partial_logits`."""
    enter(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = rows < T
    _partial_logits(x_ptr, w_ptr, part_ptr, rows.to(tl.int64), t_ok, tl.program_id(1), E, H, stride_x, stride_w,
                    stride_ps, stride_pt, SPLIT_H, BLOCK_T, BLOCK_E, BLOCK_H)  # fmt: skip


@triton.jit
def _route_tile(
    logits_ptr, rows, t_ok, E, stride_ls, stride_l, logit_bias_ptr, bias_ptr, ids_ptr, weights_ptr, renorm_eps, scale,
    SPLITS: tl.constexpr, TOP_K: tl.constexpr, K: tl.constexpr, SCORING: tl.constexpr, HAS_LOGIT_BIAS: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """The rows' fp32 logits (the sum of their SPLITS partials in split order, then the logit
    bias), scores, top-TOP_K by TOP_K passes of argmax (ties: the lower expert), then the combine
    weights as `epdraft.layers.routing.route` makes them, stored to ids / weights [T, TOP_K]; K is
    TOP_K rounded up to a power of two (the width of the register tiles). rows int64 [R], t_ok
    their mask. The partials are read past L1: in `router_topk_kernel` other programs wrote them.

    SCORING: 0 softmax, 1 sigmoid, 2 sqrt(softplus), 3 softmax over the top-K logits.
    """
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    ok = t_ok[:, None] & e_ok[None, :]
    tile = logits_ptr + rows[:, None] * stride_l + e[None, :]
    logits = tl.load(tile, mask=ok, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLITS):  # unrolled: the loads issue together, the adds keep their order
        logits += tl.load(tile + s * stride_ls, mask=ok, other=0.0, cache_modifier=".cg")
    if HAS_LOGIT_BIAS:
        logits += tl.load(logit_bias_ptr + e, mask=e_ok, other=0.0)[None, :]
    logits = tl.where(e_ok[None, :], logits, float("-inf"))
    if SCORING == 0:
        z = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = z / tl.sum(z, axis=1)[:, None]
    elif SCORING == 1:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    elif SCORING == 2:
        z = tl.exp(tl.minimum(logits, 20.0))
        u = 1.0 + z
        softplus = tl.where(u == 1.0, z, tl.log(u) * (z / (u - 1.0)))  # log1p(z): the rounding of 1 + z cancels
        scores = tl.sqrt(tl.where(logits > 20.0, logits, softplus))
    else:
        scores = logits
    selection = scores
    if HAS_BIAS:
        selection = scores + tl.load(bias_ptr + e, mask=e_ok, other=0.0)[None, :]
    # a NaN or -inf (a non-finite step, flagged and dropped) loses to every finite score yet is picked
    # once like one, as torch.topk picks distinct experts: the lowest finite float, not -inf, which
    # marks the lanes past E and the experts already picked
    lowest = -3.4028234663852886e38
    selection = tl.where(e_ok[None, :], tl.where(selection > lowest, selection, lowest), float("-inf"))
    k = tl.arange(0, K)[None, :]
    top_ids = tl.zeros((rows.shape[0], K), tl.int64)
    top_scores = tl.zeros((rows.shape[0], K), tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(selection, axis=1, tie_break_left=True)[:, None]
        hit = e[None, :] == best
        top_ids = tl.where(k == i, best, top_ids)
        top_scores = tl.where(k == i, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], top_scores)
        selection = tl.where(hit, float("-inf"), selection)
    if SCORING == 3:
        top_scores = tl.where(k < TOP_K, top_scores, float("-inf"))
        z = tl.exp(top_scores - tl.max(top_scores, axis=1)[:, None])
        weights = z / tl.sum(z, axis=1)[:, None]
    else:
        weights = top_scores  # 0 past TOP_K: the sum below is the real K's
        if NORM:
            weights = weights / (tl.sum(weights, axis=1)[:, None] + renorm_eps)
        weights = weights * scale
    out = rows[:, None] * TOP_K + k
    out_ok = t_ok[:, None] & (k < TOP_K)
    tl.store(ids_ptr + out, top_ids, mask=out_ok)
    tl.store(weights_ptr + out, weights, mask=out_ok)


@triton.jit
def topk_route_kernel(
    logits_ptr, logit_bias_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, stride_ls, stride_l, renorm_eps, scale,
    SPLITS: tl.constexpr, TOP_K: tl.constexpr, K: tl.constexpr, SCORING: tl.constexpr, HAS_LOGIT_BIAS: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """ROWS tokens' routing from their logits or partials (`_route_tile`)."""
    enter(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    _route_tile(logits_ptr, rows.to(tl.int64), rows < T, E, stride_ls, stride_l, logit_bias_ptr, bias_ptr, ids_ptr,
                weights_ptr, renorm_eps, scale, SPLITS, TOP_K, K, SCORING, HAS_LOGIT_BIAS, HAS_BIAS, NORM, BLOCK_E)  # fmt: skip


@triton.jit
def router_topk_kernel(
    x_ptr, w_ptr, part_ptr, arrived_ptr, logit_bias_ptr, bias_ptr, ids_ptr, weights_ptr,
    T, E, H, stride_x, stride_w, stride_ps, stride_pt, renorm_eps, scale,
    SPLIT_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
    SPLITS: tl.constexpr, TOP_K: tl.constexpr, K: tl.constexpr, SCORING: tl.constexpr, HAS_LOGIT_BIAS: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ROUTE_E: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """`router_logits_kernel`, then the last of a row tile's SPLITS programs to arrive routes its
    BLOCK_T rows from the partials (`_route_tile`, ROUTE_E = E rounded up to a power of two):
    the two launches' work in one. arrived_ptr: one zeroed count per row tile, left zeroed."""
    enter(PDL)
    tile = tl.program_id(0)
    rows = (tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = rows < T
    _partial_logits(x_ptr, w_ptr, part_ptr, rows, t_ok, tl.program_id(1), E, H, stride_x, stride_w, stride_ps,
                    stride_pt, SPLIT_H, BLOCK_T, BLOCK_E, BLOCK_H)  # fmt: skip
    tl.debug_barrier()  # every thread's partials are written before the release below (or this program's reads)
    last = True
    if SPLITS > 1:
        last = tl.atomic_add(arrived_ptr + tile, 1, sem="acq_rel") == SPLITS - 1
    if last:
        if SPLITS > 1:
            tl.store(arrived_ptr + tile, 0)
        _route_tile(part_ptr, rows, t_ok, E, stride_ps, stride_pt, logit_bias_ptr, bias_ptr, ids_ptr, weights_ptr,
                    renorm_eps, scale, SPLITS, TOP_K, K, SCORING, HAS_LOGIT_BIAS, HAS_BIAS, NORM, ROUTE_E)  # fmt: skip


@triton.jit
def gated(g, u, limit, alpha, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """act(gate, up) of fp32 tiles: swiglu, or swigluoai with alpha; HAS_LIMIT clamps first."""
    if HAS_LIMIT:  # a NaN stays NaN, as torch.clamp keeps it (the layer's NaN flag must see it)
        g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                       propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    if SWIGLU:
        return g / (1.0 + tl.exp(-g)) * u
    return (u + 1.0) * (g / (1.0 + tl.exp(-g * alpha)))


@triton.jit
def gated_act_kernel(
    gate_ptr, up_ptr, out_ptr, I, stride_g, stride_u, stride_o, limit, alpha,
    SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """out = act(gate, up) in fp32, rounded to out's dtype (`epdraft.layers.activations.gated_act`)."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    g = tl.load(gate_ptr + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
    h = gated(g, u, limit, alpha, SWIGLU, HAS_LIMIT)
    tl.store(out_ptr + row * stride_o + offs, h.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def ffn_residual_kernel(
    r_ptr, y_ptr, s_ptr, g_ptr, gx_ptr, gw_ptr, out_ptr, nw_ptr, normed_ptr, flag_ptr,
    H, stride_r, stride_y, stride_s, stride_g, stride_gx, stride_o, stride_n, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_Y: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr,
    GATE_FROM_ROWS: tl.constexpr, HAS_EPILOGUE: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """One row: out = [r +] ([y +] shared [* sigmoid(gate)]) (or r + y), rounding to out's dtype
    after the gate and after each add, as the torch chain does. GATE_FROM_ROWS: the gate's logit
    is the row of gx [T, H] times gw [H] in fp32, rounded to gx's dtype (nn.Linear's output),
    instead of read from g. HAS_EPILOGUE: also normed = nw * (out * rsqrt(mean(out^2) + eps)
    rounded), as `rms_norm_kernel` computes it, and *flag = 1 when out holds a NaN or inf."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_H,), tl.float32)
    if HAS_SHARED:
        acc = tl.load(s_ptr + row * stride_s + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_GATE:
            if GATE_FROM_ROWS:
                gx = tl.load(gx_ptr + row * stride_gx + offs, mask=ok, other=0.0)
                gw = tl.load(gw_ptr + offs, mask=ok, other=0.0)
                gate = tl.sum(gx.to(tl.float32) * gw.to(tl.float32), axis=0).to(gx.dtype).to(tl.float32)
            else:
                gate = tl.load(g_ptr + row * stride_g).to(tl.float32)
            acc = ((1.0 / (1.0 + tl.exp(-gate))) * acc).to(dtype).to(tl.float32)
    if HAS_Y:
        acc = (tl.load(y_ptr + row * stride_y + offs, mask=ok, other=0.0).to(tl.float32) + acc).to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        acc = tl.load(r_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32) + acc
    out = acc.to(dtype)
    tl.store(out_ptr + row * stride_o + offs, out, mask=ok)
    if HAS_EPILOGUE:
        x = tl.where(ok, out.to(tl.float32), 0.0)
        if tl.sum(tl.where((x != x) | (tl.abs(x) == float("inf")), 1, 0), axis=0) > 0:
            tl.store(flag_ptr, 1)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        normed = (x * rstd).to(dtype).to(tl.float32)
        w = tl.load(nw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(normed_ptr + row * stride_n + offs, (w * normed).to(dtype), mask=ok)


@triton.jit
def placement_kernel(
    slots_ptr, counts_ptr, lengths_ptr, slot_out_ptr, pos_out_ptr,
    N, rows, pad_slot, keep_rows,
    HAS_KEEP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """BLOCK_T packed context rows: row t belongs to the request i whose count range holds it
    (ends = cumsum(counts)), at position lengths[slots[i]] + (t - start of i); rows past the last
    request's end, and with HAS_KEEP rows older than keep_rows of their request, go to the pad
    slot's position 0."""
    enter(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.arange(0, BLOCK_N)
    counts = tl.load(counts_ptr + n, mask=n < N, other=0).to(tl.int64)
    ends = tl.cumsum(counts, axis=0)
    total = tl.sum(counts, axis=0)
    # the request of row t: how many requests end at or before it (clamped to the last)
    req = tl.minimum(tl.sum((ends[None, :] <= t[:, None]).to(tl.int64), axis=1), N - 1)
    pick = n[None, :] == req[:, None]
    start = tl.sum(tl.where(pick, (ends - counts)[None, :], 0), axis=1)
    count = tl.sum(tl.where(pick, counts[None, :], 0), axis=1)
    j = t - start
    live = t < total
    if HAS_KEEP:
        live = live & (j >= count - keep_rows)
    slot = tl.load(slots_ptr + req, mask=t < rows, other=0).to(tl.int64)
    pos = tl.load(lengths_ptr + slot, mask=live & (t < rows), other=0).to(tl.int64) + j
    tl.store(slot_out_ptr + t, tl.where(live, slot, pad_slot), mask=t < rows)
    tl.store(pos_out_ptr + t, tl.where(live, pos, 0), mask=t < rows)


@triton.jit
def step_blocks_kernel(
    anchors_ptr, slots_ptr, lengths_ptr, ids_ptr, pos_ptr, ends_ptr, nonfinite_ptr,
    L, mask_id,
    B: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Request n's block [anchor, MASK x (B-1)], its positions lengths[slots[n]] + [0, B) and its
    attention end lengths[slots[n]] + B; program 0 also zeroes the L layer flags."""
    enter(PDL)
    n = tl.program_id(0)
    if n == 0:
        layers = tl.arange(0, BLOCK_L)
        tl.store(nonfinite_ptr + layers, tl.zeros((BLOCK_L,), tl.int32), mask=layers < L)
    j = tl.arange(0, BLOCK_B)
    ok = j < B
    anchor = tl.load(anchors_ptr + n).to(tl.int64)
    start = tl.load(lengths_ptr + tl.load(slots_ptr + n)).to(tl.int64)
    tl.store(ids_ptr + n * B + j, tl.where(j == 0, anchor, mask_id).to(tl.int64), mask=ok)
    tl.store(pos_ptr + n * B + j, start + j, mask=ok)
    tl.store(ends_ptr + n, start + B)
