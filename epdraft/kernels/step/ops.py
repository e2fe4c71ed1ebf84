"""The draft step's small ops as single Triton launches (CUDA): norms, q/k norm + rotary + KV-pool
write, the attention split merge, the router's logits and top-k, the gated activation and the FFN's
output + residual add.

Why: inside a CUDA graph each kernel still costs a few microseconds, and the step's torch chains
(fp32 casts, pow/mean/rsqrt, the rotary's slices and cats, softmax/top-k/gather) made ~630
kernels a step, 3-4x its memory floor (docs/performance.md). Each function here names the torch
code it equals; that code stays the CPU path and is what tests/gpu/test_step_ops.py holds these
launches against. Every launch has a grid that depends on shapes only and reads no tensor on the
host, so a CUDA graph can hold it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from epdraft.errors import ConfigError
from epdraft.kernels import launch
from epdraft.kernels.launch import next_pow2

# Rows per merge program: N * g programs alone leave most SMs idle at small N. 4 against 16: the
# split + merge 28.3 vs 30.3 µs at one request / 8k, 23.4 vs 25.2 at 8 / 1k, within 1 µs elsewhere
# (H100, tools/attention_tune.py --merge-only; docs/performance.md, sixteenth session).
_MERGE_ROWS = 4
_PLACEMENT_TILE = 8192  # rows x requests a placement program compares (row -> its request)
# rows up to which `Router` takes `router_logits` at any expert count: on the H200 (docs/performance.md)
# it ran in 4 µs at 16 rows where the fp32 cast, cuBLAS's GEMM and its reduce took ~13, and 7 µs at 128
ROUTER_KERNEL_MAX_ROWS = 128
# experts up to which it takes any row count: with 64-row tiles above 128 rows, 8 experts x 4096 ran
# (with the top-k launch) in 8.9 / 15.1 / 28.0 / 53.3 µs at 256 / 512 / 1024 / 2048 rows on an H100,
# where x's fp32 copy and cuBLAS's fp32 GEMM took 14.9 / 26.1 / 34.1 / 58.9 (fourteenth session);
# wider routers at many rows are unmeasured and keep cuBLAS
ROUTER_KERNEL_ANY_ROWS_EXPERTS = 32
# H slices of a launch: 32 programs per 16 rows spread the weight read over the chip. The slice width
# depends on H alone, so a token's logits (their summation order) do not depend on the batch around it:
# eager and graph steps, padded to another row count, pick the same experts on near-ties
_ROUTER_SLICES = 32
_ROUTER_MIN_SPLIT = 128  # narrower H slices: more partials for topk_route to read than the split gains
_ROUTER_ROWS = 16  # rows of a logits program up to ROUTER_KERNEL_MAX_ROWS, and of a routing program that fits:
_ROUTE_TILE = 8192  # its S partials' fp32 logits, loaded at once (unrolled): ~64 registers a thread over 4 warps
_ROUTER_MAX_TILES = ROUTER_KERNEL_MAX_ROWS // _ROUTER_ROWS  # `router_topk`'s row tiles: its arrival counts


def unsupported_reason(device_type: str, dtype: torch.dtype) -> str | None:
    """Why these launches cannot run on `device_type`, or None (they take any float `dtype`). They
    have no backward (`launch.refuse_autograd`): a draft trained with autograd is built with the
    torch chains, `StepKernels.reference()`."""
    return launch.unsupported_reason(device_type)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with a unit stride in the last dim (a view when it is one)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *, round_first: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, s) with s = x + residual (x itself without one) and normed = `RMSNorm` of s:
    weight * (s * rsqrt(mean(s^2) + eps)) rounded to x's dtype before the scale
    (`epdraft.models.attention.RMSNorm.reference`), or with `round_first=False` scaled in fp32 and
    rounded once (`epdraft.models.deepseek_attention.DeepseekRMSNorm`). One program per row."""
    launch.refuse_autograd("rms_norm", x, residual)
    from epdraft.kernels.step._step_triton import rms_norm_kernel

    shape, H = x.shape, x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        r2, s2 = x2, x2
    else:
        r2 = _rows(residual)
        s2 = torch.empty_like(out)
    if x2.shape[0]:
        rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, s2, H, x2.stride(0), r2.stride(0), out.stride(0), s2.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK_H=next_pow2(H), ROUND_FIRST=round_first,
            num_warps=4 if H <= 4096 else 8,
            **launch.kwargs(x.device),
        )  # fmt: skip
    return out.view(shape), s2.view(shape)


def _check_pool_store(
    name: str, first: str, rows: tuple[torch.Tensor, ...], pool_k: torch.Tensor, pool_v: torch.Tensor,
    cos_CR: torch.Tensor, sin_CR: torch.Tensor,
) -> None:  # fmt: skip
    """ConfigError unless the rows (the first called `first`) are in the pool's dtype, the rotary
    table is fp32 and every tensor's last dim is contiguous: what the pool-writing launches assume."""
    if pool_k.dtype != rows[0].dtype or cos_CR.dtype != torch.float32:
        raise ConfigError(
            f"{name}: {first} is {rows[0].dtype}, the pool {pool_k.dtype}, the rotary table {cos_CR.dtype}: "
            "the kernel rounds where the torch chain does only for a pool in the model's dtype and an fp32 table"
        )
    if any(t.stride(-1) != 1 for t in (*rows, pool_k, pool_v, cos_CR, sin_CR)):
        raise ConfigError(f"{name}: every tensor's last dim must be contiguous")


def qk_norm_rope_store(
    q_TX: torch.Tensor,
    k_TX: torch.Tensor,
    v_TX: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_CR: torch.Tensor,
    sin_CR: torch.Tensor,
    positions_NB: torch.Tensor,
    slots_N: torch.Tensor,
    pool_k_PgCD: torch.Tensor,
    pool_v_PgCD: torch.Tensor,
) -> torch.Tensor:
    """A draft block's attention inputs in one launch: q [N, B, h, D] normed and rotated (in the
    pool's dtype), the block's k (normed, rotated) and v written to rows `positions` of each
    request's pool slot. Equals q_norm/k_norm (`RMSNorm`) then `apply_rope`, then the pool writes of
    `DFlashAttention.forward_pooled`.

    q_TX [N*B, h*D], k_TX / v_TX [N*B, g*D] (the projections' outputs, rows unit-strided);
    cos_CR / sin_CR [C, D/2] fp32: the rotary table of positions 0..C-1 (`rope_cos_sin`'s first half).
    """
    launch.refuse_autograd("qk_norm_rope_store", q_TX, k_TX, v_TX)
    from epdraft.kernels.step._step_triton import qk_rope_store_kernel

    N, B = positions_NB.shape
    D = q_norm_weight.shape[0]
    h, g = q_TX.shape[1] // D, k_TX.shape[1] // D
    if (q_TX.shape[1], k_TX.shape[1], v_TX.shape[1]) != (h * D, g * D, g * D) or pool_k_PgCD.shape[1:] != (
        g, pool_k_PgCD.shape[2], D
    ):
        raise ConfigError(
            f"qk_norm_rope_store: q {tuple(q_TX.shape)}, k {tuple(k_TX.shape)}, v {tuple(v_TX.shape)}, pool "
            f"{tuple(pool_k_PgCD.shape)}: expected widths h*D, g*D, g*D and a pool [P, g, C, D] for D = {D}"
        )
    _check_pool_store("qk_norm_rope_store", "q", (q_TX, k_TX, v_TX), pool_k_PgCD, pool_v_PgCD, cos_CR, sin_CR)
    positions_NB, slots_N = positions_NB.contiguous(), slots_N.contiguous()  # read as flat arrays
    q_out = torch.empty(N, B, h, D, dtype=pool_k_PgCD.dtype, device=q_TX.device)
    if N:
        qk_rope_store_kernel[(N * B,)](
            q_TX, k_TX, v_TX, q_norm_weight, k_norm_weight, cos_CR, sin_CR, positions_NB, slots_N,
            q_out, pool_k_PgCD, pool_v_PgCD,
            q_TX.stride(0), k_TX.stride(0), v_TX.stride(0), cos_CR.stride(0), q_out.stride(1),
            *pool_k_PgCD.stride()[:3], *pool_v_PgCD.stride()[:3],
            eps,
            NUM_Q=h, NUM_KV=g, B=B, D=D, Q_P=next_pow2(h), KV_P=next_pow2(g), HALF_P=next_pow2(D // 2),
            D_P=next_pow2(D), num_warps=4, **launch.kwargs(q_TX.device),
        )  # fmt: skip
    return q_out


def kv_norm_rope_store(
    k_TX: torch.Tensor,
    v_TX: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_CR: torch.Tensor,
    sin_CR: torch.Tensor,
    positions_T: torch.Tensor,
    slots_T: torch.Tensor,
    pool_k_PgCD: torch.Tensor,
    pool_v_PgCD: torch.Tensor,
) -> None:
    """Context rows' K/V into a pool in one launch: row t's k normed (`RMSNorm`) and rotated
    (`apply_rope`) at positions_T[t], and its v, written to pool row positions_T[t] of slot
    slots_T[t]: `DFlashAttention.context_kv` then `KVPool.store`. k_TX / v_TX [T, g*D] (the
    projections' outputs); cos_CR / sin_CR as `qk_norm_rope_store` takes them."""
    launch.refuse_autograd("kv_norm_rope_store", k_TX, v_TX)
    from epdraft.kernels.step._step_triton import kv_rope_store_kernel

    D = k_norm_weight.shape[0]
    g = k_TX.shape[1] // D
    if v_TX.shape[1] != g * D or k_TX.shape[1] != g * D or pool_k_PgCD.shape[1] != g or pool_k_PgCD.shape[3] != D:
        raise ConfigError(
            f"kv_norm_rope_store: k {tuple(k_TX.shape)}, v {tuple(v_TX.shape)}, pool {tuple(pool_k_PgCD.shape)}: "
            f"expected widths g*D and a pool [P, g, C, D] for D = {D}"
        )
    _check_pool_store("kv_norm_rope_store", "k", (k_TX, v_TX), pool_k_PgCD, pool_v_PgCD, cos_CR, sin_CR)
    positions_T, slots_T = positions_T.contiguous(), slots_T.contiguous()
    if positions_T.shape[0]:
        kv_rope_store_kernel[(positions_T.shape[0],)](
            k_TX, v_TX, k_norm_weight, cos_CR, sin_CR, positions_T, slots_T, pool_k_PgCD, pool_v_PgCD,
            k_TX.stride(0), v_TX.stride(0), cos_CR.stride(0),
            *pool_k_PgCD.stride()[:3], *pool_v_PgCD.stride()[:3],
            eps,
            NUM_KV=g, D=D, KV_P=next_pow2(g), HALF_P=next_pow2(D // 2), D_P=next_pow2(D), num_warps=4,
            **launch.kwargs(k_TX.device),
        )  # fmt: skip


def merge_attention_splits(acc: torch.Tensor, stat: torch.Tensor, out_NBhD: torch.Tensor, G: int, B: int) -> None:
    """Write the block attention's output [N, B, h, D] from its key splits (acc [N, g, splits,
    rows, D] unnormalized sums, stat [..., rows, 2] = each split's row max m_s and row sum l_s):
    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s (exp2 domain)."""
    from epdraft.kernels.step._step_triton import attention_merge_kernel

    N, g, splits, rows, D = acc.shape
    chunk = min(rows, _MERGE_ROWS)
    if N:
        attention_merge_kernel[(N, g, -(-G * B // chunk))](
            acc, stat, out_NBhD, splits,
            *acc.stride()[:4], *stat.stride()[:3], *out_NBhD.stride()[:3],
            G=G, B=B, D=D, ROWS=chunk, BLOCK_D=max(16, next_pow2(D)), num_warps=4,
            **launch.kwargs(acc.device),
        )  # fmt: skip


SCORINGS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2, "softmax_topk": 3}


def router_kernel_takes(rows: int, experts: int) -> bool:
    """Whether `Router` computes these logits with `router_logits` (`router_topk`; else cuBLAS's fp32 GEMM)."""
    return rows <= ROUTER_KERNEL_MAX_ROWS or experts <= ROUTER_KERNEL_ANY_ROWS_EXPERTS


def _router_split(H: int) -> int:
    """The width of the router's H slices: a function of H alone (see _ROUTER_SLICES)."""
    return min(next_pow2(H), max(_ROUTER_MIN_SPLIT, next_pow2(-(-H // _ROUTER_SLICES))))


def _router_tiles(E: int, split_h: int) -> tuple[int, int]:
    """(BLOCK_E, BLOCK_H) of the router's logits programs."""
    block_e = min(128, max(16, next_pow2(E)))
    return block_e, max(16, min(split_h, 64 if block_e > 32 else 256))  # tl.dot's K is 16 or more


def router_logits(x_TH: torch.Tensor, weight_EH: torch.Tensor) -> torch.Tensor:
    """Partial fp32 router logits [S, T, E] of x [T, H] (any float dtype) under the weight [E, H]:
    part[s] = x[:, slice s] @ weight[:, slice s]^T in fp32 over S power-of-two slices of H, which
    `topk_route` sums in split order (no atomics: the logits are the same bits on every launch).

    Launches per MoE layer: 2 (this, then `topk_route`; 1 where `router_topk` fits them in one)
    where the router took 4 (x's fp32 cast, cuBLAS's fp32 GEMM, its split-K reduce, `topk_route`;
    5 with a logit bias's add). One program per
    (BLOCK_T rows, H slice), _ROUTER_SLICES slices of H: one program walking all of H alone
    made the step slower.

    Raises:
        ConfigError: x and the weight differ in H.
    """
    launch.refuse_autograd("router_logits", x_TH)
    from epdraft.kernels.step._step_triton import router_logits_kernel

    T, H = x_TH.shape
    E = weight_EH.shape[0]
    if weight_EH.shape[1] != H:
        raise ConfigError(f"router_logits: x {tuple(x_TH.shape)} and weight {tuple(weight_EH.shape)} differ in H")
    # 64-row tiles read each weight slice once per 64 rows, not 16: 15 µs at 512 rows against 25 (H100)
    block_t = _ROUTER_ROWS if T <= ROUTER_KERNEL_MAX_ROWS else 64
    tiles = -(-T // block_t)
    split_h = _router_split(H)
    splits = -(-H // split_h)
    partials = torch.empty(splits, T, E, dtype=torch.float32, device=x_TH.device)
    if T:
        x, w = _rows(x_TH), _rows(weight_EH)
        block_e, block_h = _router_tiles(E, split_h)
        tile = block_t * block_e + block_h * (block_t + block_e)  # fp32 registers: ~96 a thread at most
        router_logits_kernel[(tiles, splits)](
            x, w, partials, T, E, H, x.stride(0), w.stride(0), partials.stride(0), partials.stride(1),
            SPLIT_H=split_h, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=block_h, num_warps=4 if tile <= 12288 else 8,
            **launch.kwargs(x.device),
        )  # fmt: skip
    return partials


class Selection(NamedTuple):
    """How `topk_route` and `router_topk` pick and weigh a token's experts: a `RouterSpec`'s
    scoring, top-k and weights, with the router's biases (selection_bias_E shifts the choice,
    never the weights; logit_bias_E [E] fp32 is added to the logits)."""

    top_k: int
    scoring: str
    selection_bias_E: torch.Tensor | None
    norm_topk_prob: bool
    renorm_eps: float
    routed_scaling_factor: float
    logit_bias_E: torch.Tensor | None = None

    def launch_args(self, absent: torch.Tensor) -> tuple[tuple, dict]:
        """(the bias pointers, renorm_eps, scale), the constexprs: what the routing launches take
        (an absent bias's pointer is `absent`, never read)."""
        # `route` picks softmax_topk's experts by the logits alone: a selection bias does not apply
        has_bias = self.selection_bias_E is not None and self.scoring != "softmax_topk"
        logit_bias = self.logit_bias_E if self.logit_bias_E is not None else absent
        args = (logit_bias, self.selection_bias_E if has_bias else absent, self.renorm_eps, self.routed_scaling_factor)
        constexprs = dict(TOP_K=self.top_k, K=next_pow2(self.top_k), SCORING=SCORINGS[self.scoring],
                          HAS_LOGIT_BIAS=self.logit_bias_E is not None, HAS_BIAS=has_bias,
                          NORM=self.norm_topk_prob)  # fmt: skip
        return args, constexprs


def _route_rows(splits: int, experts: int) -> int:
    """Tokens one routing program takes: _ROUTER_ROWS for a router that `router_logits` takes at
    any row count whose `splits` partials of E logits fit _ROUTE_TILE, else 1. Those tiles (with 4
    warps) are what `router_topk` routes in its logits launch up to 128 rows, and `topk_route`
    routes above: a token's weights are the same bits in a batch of any size."""
    fits = splits * _ROUTER_ROWS * max(16, next_pow2(experts)) <= _ROUTE_TILE
    return _ROUTER_ROWS if experts <= ROUTER_KERNEL_ANY_ROWS_EXPERTS and fits else 1


def topk_route(logits_STE: torch.Tensor, selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, K] int64, weights [T, K] fp32) in one launch: what `epdraft.layers.routing.route`
    computes without group-limited selection (ties go to the lower expert; E up to a few thousand:
    one program holds a token's E logits).

    logits_STE: fp32 partial logits [S, T, E] (`router_logits`), summed in split order, or
    finished logits [T, E] (S = 1); the selection's logit bias is added to the sum, as
    `Router.forward` adds it to the logits.
    Raises:
        ConfigError: logits not fp32, or of neither shape.
    """
    from epdraft.kernels.step._step_triton import topk_route_kernel

    if logits_STE.dtype != torch.float32 or logits_STE.dim() not in (2, 3):
        got = f"{logits_STE.dtype} {tuple(logits_STE.shape)}"
        raise ConfigError(f"topk_route: logits {got}, expected fp32 [S, T, E] or [T, E]")
    parts = logits_STE if logits_STE.dim() == 3 else logits_STE.unsqueeze(0)
    S, T, E = parts.shape
    ids = torch.empty(T, selection.top_k, dtype=torch.long, device=parts.device)
    weights = torch.empty(T, selection.top_k, dtype=torch.float32, device=parts.device)
    if T:
        parts = parts if parts.stride(-1) == 1 else parts.contiguous()
        args, constexprs = selection.launch_args(parts)
        rows, block_e = _route_rows(S, E), max(16, next_pow2(E))
        # a token's S partials are loaded at once (unrolled): at most ~64 fp32 registers a thread
        warps = 4 if rows > 1 else min(8, max(1 if E <= 256 else 4, next_pow2(-(-S * block_e // 2048))))
        topk_route_kernel[(-(-T // rows),)](
            parts, *args[:2], ids, weights, T, E, parts.stride(0), parts.stride(1), *args[2:], SPLITS=S, ROWS=rows,
            BLOCK_E=block_e, **constexprs, num_warps=warps, **launch.kwargs(parts.device),
        )  # fmt: skip
    return ids, weights


def router_topk(x_TH: torch.Tensor, weight_EH: torch.Tensor, selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_route(router_logits(x_TH, weight_EH), selection)`, the same bits, in one launch where the
    routing fits the logits launch (up to ROUTER_KERNEL_MAX_ROWS rows whose partials fit one
    program's tile, `_route_rows`: e.g. 8 experts over H = 4096): the last of a row tile's H
    slices to finish routes the tile. Elsewhere the two launches.
    """
    T, H = x_TH.shape
    E = weight_EH.shape[0]
    split_h = _router_split(H)
    splits = -(-H // split_h)
    if not 0 < T <= ROUTER_KERNEL_MAX_ROWS or _route_rows(splits, E) != _ROUTER_ROWS:
        return topk_route(router_logits(x_TH, weight_EH), selection)
    launch.refuse_autograd("router_topk", x_TH)
    from epdraft.kernels.step._step_triton import router_topk_kernel

    if weight_EH.shape[1] != H:
        raise ConfigError(f"router_topk: x {tuple(x_TH.shape)} and weight {tuple(weight_EH.shape)} differ in H")
    x, w = _rows(x_TH), _rows(weight_EH)
    tiles = -(-T // _ROUTER_ROWS)
    partials = torch.empty(splits, T, E, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, selection.top_k, dtype=torch.long, device=x.device)
    weights = torch.empty(T, selection.top_k, dtype=torch.float32, device=x.device)
    route_args, constexprs = selection.launch_args(partials)
    block_e, block_h = _router_tiles(E, split_h)
    router_topk_kernel[(tiles, splits)](
        x, w, partials, launch.zeroed_counts("router_topk", x.device, _ROUTER_MAX_TILES), *route_args[:2], ids,
        weights, T, E, H, x.stride(0), w.stride(0), partials.stride(0), partials.stride(1), *route_args[2:],
        SPLIT_H=split_h, BLOCK_T=_ROUTER_ROWS, BLOCK_E=block_e, BLOCK_H=block_h, SPLITS=splits,
        ROUTE_E=max(16, next_pow2(E)), **constexprs, num_warps=4, **launch.kwargs(x.device),
    )  # fmt: skip
    return ids, weights


def gated_act(gate_TI: torch.Tensor, up_TI: torch.Tensor, swiglu: bool, limit: float, alpha: float) -> torch.Tensor:
    """act(gate, up) in fp32 rounded to gate's dtype (`epdraft.layers.activations.gated_act` then
    `.to(dtype)`): swiglu, or swigluoai with `alpha`; `limit` > 0 clamps first."""
    launch.refuse_autograd("gated_act", gate_TI, up_TI)
    from epdraft.kernels.step._step_triton import gated_act_kernel

    g2, u2 = _rows(gate_TI), _rows(up_TI)
    T, I = g2.shape
    out = torch.empty(T, I, dtype=gate_TI.dtype, device=gate_TI.device)
    block = min(2048, next_pow2(I))
    if T:
        gated_act_kernel[(T, -(-I // block))](
            g2, u2, out, I, g2.stride(0), u2.stride(0), out.stride(0), limit, alpha,
            SWIGLU=swiglu, HAS_LIMIT=limit > 0, BLOCK=block, num_warps=4, **launch.kwargs(out.device),
        )  # fmt: skip
    return out.view(gate_TI.shape)


def placement(
    slots_N: torch.Tensor, counts_N: torch.Tensor, lengths: torch.Tensor, rows: int, pad_slot: int,
    keep_rows: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_T, position_T) int64 of `rows` packed context rows in one launch, as
    `KVPool.placement`'s torch chain computes them (~15 small launches there): request i's
    counts_N[i] rows at positions lengths[slots_N[i]] ..; padding rows, and rows older than
    `keep_rows` of their request, at the pad slot's position 0."""
    from epdraft.kernels.step._step_triton import placement_kernel

    N = slots_N.shape[0]
    slot_T = torch.empty(rows, dtype=torch.long, device=slots_N.device)
    position_T = torch.empty(rows, dtype=torch.long, device=slots_N.device)
    if rows:
        block_n = max(16, next_pow2(N))
        block_t = max(16, min(next_pow2(rows), _PLACEMENT_TILE // block_n))
        placement_kernel[(-(-rows // block_t),)](
            slots_N, counts_N, lengths, slot_T, position_T, N, rows, pad_slot, keep_rows or 0,
            HAS_KEEP=keep_rows is not None, BLOCK_N=block_n, BLOCK_T=block_t, num_warps=4,
            **launch.kwargs(slots_N.device),
        )  # fmt: skip
    return slot_T, position_T


def step_blocks(
    anchors_N: torch.Tensor, slots_N: torch.Tensor, lengths: torch.Tensor, mask_token_id: int, block_size: int,
    num_layers: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids_NB, positions_NB, ends_N, nonfinite_L) of a draft step in one launch, as the torch chain
    of `DFlashDraft.step` (~8 small launches there) computes them: request n's block [anchors_N[n],
    mask x (B-1)] int64, its positions lengths[slots_N[n]] + [0, B) int64, its attention end (the
    last position + 1) and the L layer flags int32 zeroed. N = 0 (an idle rank's eager step)
    launches nothing but the flags' zeroing."""
    from epdraft.kernels.step._step_triton import step_blocks_kernel

    N, B, device = anchors_N.shape[0], block_size, anchors_N.device
    ids_NB = torch.empty(N, B, dtype=torch.long, device=device)
    positions_NB = torch.empty(N, B, dtype=torch.long, device=device)
    ends_N = torch.empty(N, dtype=torch.long, device=device)
    if N == 0:
        return ids_NB, positions_NB, ends_N, torch.zeros(num_layers, dtype=torch.int32, device=device)
    nonfinite_L = torch.empty(num_layers, dtype=torch.int32, device=device)
    step_blocks_kernel[(N,)](
        anchors_N, slots_N, lengths, ids_NB, positions_NB, ends_N, nonfinite_L, num_layers, mask_token_id,
        B=B, BLOCK_B=max(2, next_pow2(B)), BLOCK_L=max(2, next_pow2(num_layers)), num_warps=1,
        **launch.kwargs(device),
    )  # fmt: skip
    return ids_NB, positions_NB, ends_N, nonfinite_L


class Epilogue(NamedTuple):
    """What `ffn_residual` also makes of each row it writes (a draft layer's output): the next
    norm's output into `normed_TH` [T, H] (the next layer's input norm, or the final one: RMSNorm
    under `norm_weight_H`, `eps`, rounded before the scale as `rms_norm` does) and `nonfinite_1`
    ([1] int32, zeroed by the caller) set to 1 when the row holds a NaN or inf: two launches a
    layer fewer than an `rms_norm` launch and a finite check after it."""

    norm_weight_H: torch.Tensor
    eps: float
    normed_TH: torch.Tensor
    nonfinite_1: torch.Tensor


def _check_epilogue(epilogue: Epilogue, T: int, H: int, rows: torch.Tensor) -> None:
    """ConfigError for an epilogue the launch would misread: it writes normed_TH as [T, H] rows
    (by its row stride) in the rows' dtype, reads H norm weights and one int32 flag."""
    normed, weight, flag = epilogue.normed_TH, epilogue.norm_weight_H, epilogue.nonfinite_1
    problems = []
    if normed.shape != (T, H) or normed.stride(-1) != 1 or normed.dtype != rows.dtype:
        problems.append(f"normed_TH {tuple(normed.shape)} {normed.dtype} strides {normed.stride()}: expected "
                        f"[{T}, {H}] {rows.dtype} with unit-stride rows")  # fmt: skip
    if weight.shape != (H,):
        problems.append(f"norm_weight_H {tuple(weight.shape)}: expected [{H}]")
    if flag.shape != (1,) or flag.dtype != torch.int32:
        problems.append(f"nonfinite_1 {tuple(flag.shape)} {flag.dtype}: expected [1] torch.int32")
    if any(t.device != rows.device for t in (normed, weight, flag)):
        devices = ", ".join(str(t.device) for t in (normed, weight, flag))
        problems.append(f"the epilogue's tensors on {devices}, the rows on {rows.device}")
    if problems:
        raise ConfigError("ffn_residual's epilogue: " + "; ".join(problems))


def refuse_epilogue(owner: str, epilogue: Epilogue | None) -> None:
    """ConfigError where an FFN would take its torch chain with an `epilogue`: only the Triton
    residual launch writes the next norm and the flag, and a caller reading them would read
    uninitialised rows and a flag that never fires."""
    if epilogue is not None:
        raise ConfigError(f"{owner}: an epilogue (the next norm and the non-finite flag) needs the Triton step ops' "
                          "residual launch; this FFN runs its torch chain")  # fmt: skip


def ffn_residual(
    residual_TH: torch.Tensor | None,
    y_TH: torch.Tensor | None,
    shared_TH: torch.Tensor | None = None,
    gate_T1: torch.Tensor | None = None,
    *,
    gate_rows_TH: torch.Tensor | None = None,
    gate_weight_1H: torch.Tensor | None = None,
    epilogue: Epilogue | None = None,
) -> torch.Tensor:
    """[residual +] ([y +] shared [* sigmoid(gate)]) in one launch, rounded to the tensors' dtype
    after the gate and after each add, as `DraftMLP.forward`, `DraftMoE.forward` and the layer's
    residual add round: the FFN output and the residual stream in one pass. y or shared is given
    (a gated shared alone is DraftMLP's own output gate); all [T, H]. The output gate's logits are
    gate_T1 [T, 1], or computed in the launch from its input rows gate_rows_TH [T, H] and weight
    gate_weight_1H [1, H] (x @ w^T in fp32, rounded to x's dtype as nn.Linear's output is): one
    launch where cuBLAS took a split-K GEMM and its reduce for a [T, H] x [H] product. `epilogue`:
    the same launch also writes the next norm of each row and the non-finite flag (`Epilogue`)."""
    launch.refuse_autograd("ffn_residual", residual_TH, y_TH, shared_TH, gate_rows_TH)
    given = [t for t in (residual_TH, y_TH, shared_TH) if t is not None]
    first = given[0]
    T, H = first.reshape(-1, first.shape[-1]).shape
    if epilogue is not None:
        _check_epilogue(epilogue, T, H, first)
    from epdraft.kernels.step._step_triton import ffn_residual_kernel

    r2, y2, s2, gx2 = (_rows(t) if t is not None else None for t in (residual_TH, y_TH, shared_TH, gate_rows_TH))
    g2 = gate_T1.reshape(-1, 1) if gate_T1 is not None else None
    gw = gate_weight_1H.reshape(-1) if gate_weight_1H is not None else None
    out = torch.empty(T, H, dtype=first.dtype, device=first.device)
    if T:
        # an absent operand's pointer is `out` (never read: its HAS_ flag is off)
        r, y, sh, g, gx = (t if t is not None else out for t in (r2, y2, s2, g2, gx2))
        nw, normed, flag, eps = (epilogue.norm_weight_H, epilogue.normed_TH, epilogue.nonfinite_1, epilogue.eps) \
            if epilogue is not None else (out, out, out, 0.0)  # fmt: skip
        ffn_residual_kernel[(T,)](
            r, y, sh, g, gx, gw if gw is not None else out, out, nw, normed, flag, H,
            r.stride(0), y.stride(0), sh.stride(0), g.stride(0), gx.stride(0), out.stride(0), normed.stride(0), eps,
            HAS_RESIDUAL=r2 is not None, HAS_Y=y2 is not None, HAS_SHARED=s2 is not None,
            HAS_GATE=g2 is not None or gx2 is not None, GATE_FROM_ROWS=gx2 is not None,
            HAS_EPILOGUE=epilogue is not None, BLOCK_H=next_pow2(H), num_warps=4 if H <= 4096 else 8,
            **launch.kwargs(out.device),
        )  # fmt: skip
    return out.view(first.shape)
