"""The draft step's fused launches (`epdraft.kernels.step.ops`, `epdraft.kernels.step.skinny`) against the
torch chains and cuBLAS GEMMs they replace (the CPU path): same values to fp32 rounding order in
fp32, and within one bf16 rounding in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epdraft.bench.step import preset_config
from epdraft.config.ffn import ActivationSpec, RouterSpec
from epdraft.kernels import launch
from epdraft.kernels.step import ops as step_ops, skinny
from epdraft.layers.activations import gated_act
from epdraft.layers.router import Router
from epdraft.layers.routing import route, score
from epdraft.layers.step_kernels import StepKernels
from epdraft.models import DFlashDraft, DraftModelSpec
from epdraft.models.attention import DFlashAttention, RMSNorm, apply_rope, rope_cos_sin

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float32]


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: rounding order only; bf16: at most one bf16 rounding apart (2^-7 relative)."""
    tol = dict(rtol=2**-7, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.float(), ref.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 4096), (37, 5120), (300, 96), (0, 64)])
def test_rms_norm_and_residual_add_equal_the_torch_chain(dtype, T, H):
    norm = RMSNorm(H, 1e-6, dtype=dtype, device="cuda")
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(T, H, device="cuda").to(dtype)
    delta = torch.randn(T, H, device="cuda").to(dtype)
    _close(step_ops.rms_norm(x, norm.weight, norm.eps)[0], norm.reference(x), dtype)
    normed, summed = step_ops.rms_norm(x, norm.weight, norm.eps, residual=delta)
    assert torch.equal(summed, x + delta)
    _close(normed, norm.reference(x + delta), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,B,h,g,D", [(1, 16, 32, 8, 128), (5, 16, 8, 2, 64), (2, 7, 6, 3, 128)])
def test_qk_norm_rope_store_equals_norm_rope_and_pool_writes(dtype, N, B, h, g, D):
    attn = DFlashAttention(64, h, g, D, rms_norm_eps=1e-6, rope_theta=1e6, dtype=dtype, device="cuda")
    torch.nn.init.normal_(attn.q_norm.weight)
    torch.nn.init.normal_(attn.k_norm.weight)
    P, C = N + 2, 9000
    pool_k = torch.zeros(P, g, C, D, dtype=dtype, device="cuda")
    pool_v = torch.zeros_like(pool_k)
    slots = torch.randperm(P, device="cuda")[:N]
    positions = torch.randint(0, C - B, (N, 1), device="cuda") + torch.arange(B, device="cuda")
    q = torch.randn(N * B, h * D, device="cuda").to(dtype)
    k = torch.randn(N * B, g * D, device="cuda").to(dtype)
    v = torch.randn(N * B, g * D, device="cuda").to(dtype)
    cos, sin = attn.rope_table(C, torch.device("cuda"))
    got_q = step_ops.qk_norm_rope_store(q, k, v, attn.q_norm.weight, attn.k_norm.weight, 1e-6, cos, sin,
                                        positions, slots, pool_k, pool_v)  # fmt: skip
    rc, rs = rope_cos_sin(positions, D, 1e6)
    ref_q = apply_rope(attn.q_norm.reference(q.view(N, B, h, D)).transpose(1, 2), rc, rs).transpose(1, 2)
    ref_k = apply_rope(attn.k_norm.reference(k.view(N, B, g, D)).transpose(1, 2), rc, rs).transpose(1, 2)
    _close(got_q, ref_q, dtype)
    index = (slots.unsqueeze(1), slice(None), positions)
    _close(pool_k[index], ref_k, dtype)
    assert torch.equal(pool_v[index], v.view(N, B, g, D))
    untouched = torch.ones(P, C, dtype=torch.bool, device="cuda")
    untouched[slots.unsqueeze(1), positions] = False
    assert not pool_k.permute(0, 2, 1, 3)[untouched].any() and not pool_v.permute(0, 2, 1, 3)[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,g,D", [(1, 8, 128), (37, 2, 64), (300, 3, 128)])
def test_kv_norm_rope_store_equals_context_kv_and_pool_writes(dtype, T, g, D):
    attn = DFlashAttention(64, g, g, D, rms_norm_eps=1e-6, rope_theta=1e6, dtype=dtype, device="cuda")
    torch.nn.init.normal_(attn.k_norm.weight)
    P, C = 5, 9000
    pool_k = torch.zeros(P, g, C, D, dtype=dtype, device="cuda")
    pool_v = torch.zeros_like(pool_k)
    cells = torch.randperm(P * C, device="cuda")[:T]  # distinct (slot, position) per row, as `placement` gives
    slots, positions = cells // C, cells % C
    k = torch.randn(T, g * D, device="cuda").to(dtype)
    v = torch.randn(T, g * D, device="cuda").to(dtype)
    cos, sin = attn.rope_table(C, torch.device("cuda"))
    step_ops.kv_norm_rope_store(k, v, attn.k_norm.weight, 1e-6, cos, sin, positions, slots, pool_k, pool_v)
    rc, rs = rope_cos_sin(positions.unsqueeze(0), D, 1e6)
    ref_k = apply_rope(attn.k_norm.reference(k.view(1, T, g, D)).transpose(1, 2), rc, rs)[0].transpose(0, 1)
    _close(pool_k[slots, :, positions], ref_k, dtype)
    assert torch.equal(pool_v[slots, :, positions], v.view(T, g, D))
    untouched = torch.ones(P, C, dtype=torch.bool, device="cuda")
    untouched[slots, positions] = False
    assert not pool_k.permute(0, 2, 1, 3)[untouched].any() and not pool_v.permute(0, 2, 1, 3)[untouched].any()


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus", "softmax_topk"])
@pytest.mark.parametrize("E,K", [(8, 2), (8, 1), (16, 2), (32, 4), (128, 3), (256, 8), (60, 1)])
def test_topk_route_equals_route(scoring, E, K):
    """Against `route` on finished logits: up to 32 experts 16 tokens a program, above one."""
    spec = RouterSpec(num_experts=E, top_k=K, scoring=scoring, norm_topk_prob=scoring != "softmax",
                      routed_scaling_factor=2.5, renorm_eps=1e-20)  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(E * K)
    logits = torch.randn(513, E, generator=gen, device="cuda") * 4
    bias = torch.randn(E, generator=gen, device="cuda") if scoring == "sigmoid" else None
    ref_ids, ref_w = route(logits, spec, bias)
    selection = step_ops.Selection(K, scoring, bias, spec.norm_topk_prob, spec.renorm_eps, spec.routed_scaling_factor)
    ids, w = step_ops.topk_route(logits, selection)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    empty_ids, empty_w = step_ops.topk_route(logits[:0], step_ops.Selection(K, scoring, bias, True, 0.0, 1.0))
    assert empty_ids.shape == (0, K) and empty_w.shape == (0, K)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus", "softmax_topk"])
def test_topk_route_of_nan_logits_picks_experts_that_exist(scoring):
    """A non-finite step's NaN logits still route to experts in [0, E) (the dispatchers index by
    them), K distinct ones a token as torch.topk picks; the step's finite flags drop its drafts."""
    logits = torch.randn(40, 12, device="cuda")
    logits[::2] = float("nan")
    logits[1::4, 3] = float("nan")
    ids, _ = step_ops.topk_route(logits, step_ops.Selection(4, scoring, None, True, 1e-20, 1.0))
    assert ids.min() >= 0 and ids.max() < 12
    assert all(len(set(row)) == 4 for row in ids.tolist())


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax_topk"])
def test_topk_route_with_a_selection_bias_picking_low_logits(scoring):
    """A bias that outweighs the logits picks experts whose logits are very negative: sqrt(softplus)
    of those is where log(1 + z) loses its digits; softmax_topk ignores the bias, as `route` does."""
    E, K = 64, 4
    spec = RouterSpec(num_experts=E, top_k=K, scoring=scoring, routed_scaling_factor=1.5)
    gen = torch.Generator(device="cuda").manual_seed(7)
    logits = torch.randn(257, E, generator=gen, device="cuda") * 3 - 9
    bias = torch.randn(E, generator=gen, device="cuda") * 0.5
    ref_ids, ref_w = route(logits, spec, bias)
    selection = step_ops.Selection(K, scoring, bias, spec.norm_topk_prob, spec.renorm_eps, spec.routed_scaling_factor)
    ids, w = step_ops.topk_route(logits, selection)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


def _clear_tokens(logits_TE, selection_bias_E, scoring, K, delta):
    """Tokens whose K-th and (K+1)-th choices no logit error up to delta can swap: a selection value
    moves by at most its score's slope times delta (softmax 2s, sigmoid s(1-s), sqrt(softplus)
    sigmoid / 2s, softmax_topk's logits 1), a bound relative to the scores themselves (softmax
    scores of 256 experts are ~0.004: an absolute margin such as 1e-4 hides most tokens)."""
    s = score(logits_TE, scoring)
    slope = {"softmax": 2 * s, "sigmoid": s * (1 - s), "sqrtsoftplus": torch.sigmoid(logits_TE) / (2 * s),
             "softmax_topk": torch.ones_like(s)}[scoring]  # fmt: skip
    # softmax_topk picks by the logits alone, as `route` does
    selection = s + selection_bias_E if selection_bias_E is not None and scoring != "softmax_topk" else s
    values, ids = selection.topk(K + 1, dim=-1)
    reach = slope.gather(1, ids[:, K - 1 :]).sum(dim=-1) * delta
    return values[:, K - 1] - values[:, K] > reach


@torch.no_grad()
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus", "softmax_topk"])
@pytest.mark.parametrize("bias", ["none", "selection", "logit"])
@pytest.mark.parametrize("E,H", [(8, 4096), (128, 5120), (256, 4096)])
@pytest.mark.parametrize("T", [1, 16, 128, 1000])
def test_router_launches_equal_fp32_linear_then_route(scoring, bias, E, H, T):
    """Router.forward on CUDA (`router_topk` where `router_kernel_takes` the shape: one launch at 8
    experts up to 128 rows, else router_logits + topk_route; elsewhere cuBLAS's fp32 logits +
    topk_route) against F.linear in fp32 (+ logit bias) then `route`.
    The two sum each logit's products in different orders (~1e-6 apart): a token
    whose K-th and (K+1)-th choices are closer than that may pick either, so ids are compared on
    the tokens the logits' tolerance cannot flip, and as sets: two near-equal chosen experts may
    come in either order, which the combine does not see."""
    K = 2 if E == 8 else 8
    spec = RouterSpec(num_experts=E, top_k=K, scoring=scoring, norm_topk_prob=scoring != "softmax",
                      routed_scaling_factor=2.5, bias=bias)  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(E + H + T)
    router = Router(spec, H, device="cuda")
    # logits' std ~1: a softmax weight's relative error is up to twice the logits' absolute one,
    # which grows with their size (std 2 came within 10% of rtol 1e-5 in a CPU emulation)
    router.weight.copy_(torch.randn(E, H, generator=gen, device="cuda") * H**-0.5)
    if bias != "none":
        router.bias.copy_(torch.randn(E, generator=gen, device="cuda") * (0.02 if bias == "selection" else 1.0))
    x = torch.randn(T, H, generator=gen, device="cuda").bfloat16()

    linear = F.linear(x.float(), router.weight)
    parts = step_ops.router_logits(x, router.weight)
    summed = parts[0]
    for p in parts[1:]:  # topk_route's order
        summed = summed + p
    delta = 1e-5 * linear.abs().max()
    assert (summed - linear).abs().max() <= delta

    logits = linear + router.bias if bias == "logit" else linear
    selection_bias = router.bias if bias == "selection" else None
    ref_ids, ref_w = route(logits, spec, selection_bias)
    ids, w = router(x)
    # Router.forward took the launches, and they give the same bits every time (no atomics)
    taken = parts if step_ops.router_kernel_takes(T, E) else linear
    selection = step_ops.Selection(K, scoring, selection_bias, spec.norm_topk_prob, spec.renorm_eps, 2.5,
                                   router.bias if bias == "logit" else None)  # fmt: skip
    launch_ids, launch_w = step_ops.topk_route(taken, selection)
    assert torch.equal(ids, launch_ids) and torch.equal(w, launch_w)
    clear = _clear_tokens(logits, selection_bias, scoring, K, delta)
    assert clear.sum() >= int(0.9 * T)
    order, ref_order = ids[clear].argsort(-1), ref_ids[clear].argsort(-1)
    assert torch.equal(ids[clear].gather(1, order), ref_ids[clear].gather(1, ref_order))
    torch.testing.assert_close(w[clear].gather(1, order), ref_w[clear].gather(1, ref_order), rtol=1e-5, atol=1e-8)

    empty_ids, empty_w = router(x[:0])
    assert empty_ids.shape == (0, K) and empty_w.shape == (0, K)


@torch.no_grad()
@pytest.mark.parametrize("E,H,rows", [(8, 4096, 1000), (256, 5120, 128)])
def test_router_logits_of_a_row_do_not_depend_on_the_rows_around_it(E, H, rows):
    """A graph step pads its rows to the bucket: the router's logits of a row (their summation
    order) must be the same bits whatever the batch (16-row tiles up to 128 rows, 64-row tiles
    above), or eager and graph steps pick other experts on near-ties."""
    x = torch.randn(rows, H, device="cuda").bfloat16()
    w = torch.randn(E, H, device="cuda") * H**-0.5
    selection = step_ops.Selection(2, "softmax", None, True, 1e-20, 1.0)
    full = step_ops.router_topk(x, w, selection)
    for T in (1, 16, 77, 128, 300):
        T = min(T, rows)
        part = step_ops.router_topk(x[:T], w, selection)
        assert torch.equal(part[0], full[0][:T]) and torch.equal(part[1], full[1][:T])


@torch.no_grad()
@pytest.mark.parametrize("E,H,T", [(8, 4096, 1), (8, 4096, 16), (8, 4096, 77), (8, 4096, 128), (24, 96, 20),
                                   (12, 1000, 5), (256, 4096, 16)])  # fmt: skip
def test_router_topk_is_router_logits_then_topk_route(E, H, T):
    """`router_topk` routes a row tile in the logits launch's last H slice to finish (8 experts in
    32 slices up to 128 rows, 24 in one slice at H = 96, 12 in 8 slices at H = 1000; 256 experts
    take the two launches): the two launches' bits, every time, the one launch's arrival counts left
    zeroed."""
    gen = torch.Generator(device="cuda").manual_seed(E + H + T)
    x = torch.randn(T, H, generator=gen, device="cuda").bfloat16()
    w = torch.randn(E, H, generator=gen, device="cuda") * H**-0.5
    bias = torch.randn(E, generator=gen, device="cuda") * 0.02
    for scoring in ("softmax", "sigmoid", "sqrtsoftplus", "softmax_topk"):
        selection = step_ops.Selection(2, scoring, bias, scoring != "softmax", 1e-20, 2.5, bias * 10)
        want = step_ops.topk_route(step_ops.router_logits(x, w), selection)
        for _ in range(3):
            got = step_ops.router_topk(x, w, selection)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if E <= step_ops.ROUTER_KERNEL_ANY_ROWS_EXPERTS:  # the one launch, which counts arrivals
        torch.cuda.synchronize()
        assert not launch.zeroed_counts("router_topk", x.device, step_ops._ROUTER_MAX_TILES).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [ActivationSpec(), ActivationSpec(kind="swigluoai", limit=7.0, alpha=1.702)])
def test_gated_act_equals_the_torch_activation(dtype, act):
    gate = (torch.randn(33, 1536, device="cuda") * 4).to(dtype)
    up = (torch.randn(33, 1536, device="cuda") * 4).to(dtype)
    got = step_ops.gated_act(gate, up, act.kind == "swiglu", act.limit, act.alpha)
    _close(got, gated_act(gate, up, act).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ffn_residual_equals_the_torch_adds(dtype):
    T, H = 21, 4096
    r, y, s = (torch.randn(T, H, device="cuda").to(dtype) for _ in range(3))
    gate = torch.randn(T, 1, device="cuda").to(dtype)
    gated = (torch.sigmoid(gate.float()) * s.float()).to(dtype)
    _close(step_ops.ffn_residual(r, y, s, gate), r + (y + gated), dtype)
    _close(step_ops.ffn_residual(r, None, s, gate), r + gated, dtype)
    _close(step_ops.ffn_residual(r, y), r + y, dtype)
    _close(step_ops.ffn_residual(None, y, s), y + s, dtype)
    # The gate's logits from its input rows and weight in the launch, against nn.Linear's (cuBLAS).
    x = torch.randn(T, H, device="cuda").to(dtype)
    w = (torch.randn(1, H, device="cuda") / H**0.5).to(dtype)
    gated_x = (torch.sigmoid(torch.nn.functional.linear(x, w).float()) * s.float()).to(dtype)
    _close(step_ops.ffn_residual(r, y, s, gate_rows_TH=x, gate_weight_1H=w), r + (y + gated_x), dtype)
    _close(step_ops.ffn_residual(r, None, s, gate_rows_TH=x[:, :H], gate_weight_1H=w), r + gated_x, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 4096), (70, 4096), (33, 5120), (5, 96)])
def test_ffn_residual_epilogue_is_the_norm_and_the_finite_check_after_it(dtype, T, H):
    """`ffn_residual`'s epilogue: the same output, the next norm as the `rms_norm` launch it replaces
    makes it (bit for bit: the same reduction) and within one rounding of `RMSNorm.reference`, and
    the flag set by an inf or a NaN in any row (its own flag only), left 0 otherwise."""
    gen = torch.Generator(device="cuda").manual_seed(T * H)
    r, y, s = (torch.randn(T, H, generator=gen, device="cuda").to(dtype) for _ in range(3))
    x = torch.randn(T, H, generator=gen, device="cuda").to(dtype)
    gate_w = (torch.randn(1, H, generator=gen, device="cuda") / H**0.5).to(dtype)
    norm = RMSNorm(H, 1e-6, dtype=dtype, device="cuda")
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=gen, device="cuda"))
    flags = torch.zeros(3, dtype=torch.int32, device="cuda")
    for i, bad in enumerate([None, float("inf"), float("nan")]):
        if bad is not None:
            r[T - 1, H - 1] = bad
        plain = step_ops.ffn_residual(r, y, s, gate_rows_TH=x, gate_weight_1H=gate_w)
        normed = torch.empty(T, H, dtype=dtype, device="cuda")
        epilogue = step_ops.Epilogue(norm.weight, norm.eps, normed, flags[i : i + 1])
        got = step_ops.ffn_residual(r, y, s, gate_rows_TH=x, gate_weight_1H=gate_w, epilogue=epilogue)
        torch.testing.assert_close(got, plain, rtol=0, atol=0, equal_nan=True)
        if bad is None:
            assert torch.equal(epilogue.normed_TH, step_ops.rms_norm(plain, norm.weight, norm.eps)[0])
            _close(epilogue.normed_TH, norm.reference(plain), dtype)
    assert flags.tolist() == [0, 1, 1]


@torch.no_grad()
@pytest.mark.parametrize("T", [1, 16, 32])
@pytest.mark.parametrize("K,widths", [(4096, (4096, 1024, 1024)), (1536, (4096,)), (320, (40, 17))])
def test_skinny_linear_equals_cublas(T, K, widths):
    x = torch.randn(T, K, device="cuda").bfloat16()
    ws = [torch.randn(n, K, device="cuda").bfloat16() * K**-0.5 for n in widths]
    assert skinny.fits(x, ws)
    _close(skinny.linear(x, ws), torch.cat([F.linear(x, w) for w in ws], 1), torch.bfloat16)


@torch.no_grad()
@pytest.mark.parametrize("act", [ActivationSpec(), ActivationSpec(kind="swigluoai", limit=7.0, alpha=1.702)])
@pytest.mark.parametrize("T", [16, 32])
def test_skinny_gate_up_equals_linear_then_activation(act, T):
    x = torch.randn(T, 4096, device="cuda").bfloat16()
    wg, wu = (torch.randn(1536, 4096, device="cuda").bfloat16() * 0.05 for _ in range(2))
    got = skinny.gate_up_act(x, wg, wu, act.kind == "swiglu", act.limit, act.alpha)
    # the gate and up products round to bf16 before the activation, as nn.Linear's do, but in
    # another summation order: a product one bf16 rounding apart moves h by up to ~|h| / 128
    ref = gated_act(F.linear(x, wg), F.linear(x, wu), act).bfloat16()
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-6, atol=5e-2)


@torch.no_grad()
@pytest.mark.parametrize("split", [1, 2, 3, 8])
def test_skinny_split_k_equals_cublas_and_repeats_bit_for_bit(split):
    """K split over programs, the partials summed by each tile's last program in split order: the
    product of the unsplit launch's accuracy, the same bits on every call, the counts left zeroed."""
    x = torch.randn(16, 4096, device="cuda").bfloat16()
    ws = [torch.randn(n, 4096, device="cuda").bfloat16() * 4096**-0.5 for n in (4096, 1024, 1024)]
    got = skinny.linear(x, ws, split_k=split)
    _close(got, torch.cat([F.linear(x, w) for w in ws], 1), torch.bfloat16)
    assert all(torch.equal(skinny.linear(x, ws, split_k=split), got) for _ in range(5))
    wg, wu = ws[1], ws[2] * 2
    act = ActivationSpec()
    h = skinny.gate_up_act(x, wg, wu, True, 0.0, 1.0, split_k=split)
    torch.testing.assert_close(h.float(), gated_act(F.linear(x, wg), F.linear(x, wu), act).float(), rtol=2**-6, atol=5e-2)
    assert torch.equal(skinny.gate_up_act(x, wg, wu, True, 0.0, 1.0, split_k=split), h)
    torch.cuda.synchronize()
    assert not launch.zeroed_counts("skinny", x.device, skinny._MAX_TILES).any()


@torch.no_grad()
def test_skinny_split_launches_on_both_streams_at_once_count_apart():
    """The commit's K/V projections run split over K on `launch.Fork`'s second stream beside the
    main stream's (issue13's k/v at 16 rows: 64 tiles, split 4): launches running at once must
    count their tiles' arrivals apart, or a program of one sums the other's unfinished partials.
    Both streams' launches are queued behind one sleep, so they start together; each must give
    the serial launch's bits, and every count is zero after."""
    x = torch.randn(16, 4096, device="cuda").bfloat16()
    ws = [torch.randn(1024, 4096, device="cuda").bfloat16() * 4096**-0.5 for _ in range(4)]
    want_main, want_side = skinny.linear(x, ws[:2], split_k=4), skinny.linear(x, ws[2:], split_k=4)
    for _ in range(20):
        torch.cuda._sleep(1_000_000)
        fork = launch.Fork(x.device)  # the second stream waits for the sleep too
        with fork.side():
            side = skinny.linear(x, ws[2:], split_k=4)
        main = skinny.linear(x, ws[:2], split_k=4)
        fork.join()
        assert torch.equal(main, want_main) and torch.equal(side, want_side)
    torch.cuda.synchronize()
    main_counts = launch.zeroed_counts("skinny", x.device, skinny._MAX_TILES)
    with fork.side():
        side_counts = launch.zeroed_counts("skinny", x.device, skinny._MAX_TILES)
    assert not main_counts.any() and not side_counts.any() and side_counts.data_ptr() != main_counts.data_ptr()
    # `cuda` and `cuda:0` name one device: one second stream, and its launches count on the side's counts
    unindexed = launch.Fork(torch.device("cuda"))
    assert unindexed.other is fork.other
    with unindexed.side():
        assert launch.zeroed_counts("skinny", torch.device("cuda"), skinny._MAX_TILES) is side_counts


@torch.no_grad()
def test_pdl_launches_equal_launches_without_pdl_eager_and_in_a_graph():
    """Programmatic dependent launch changes when a kernel starts, never what it reads: a chain of
    ~130 dependent launches (each reading the one before's output, the skinny ones prefetching
    their weights before the wait; the router's logits + top-k in one launch, whose last program
    of a row tile reads the others' partials; the FFN residual writing the next norm and the
    finite flag) gives the same bits with PDL as without, eager and replayed behind a busy stream."""

    device = torch.device("cuda", torch.cuda.current_device())
    if not launch.pdl(device):
        pytest.skip("PDL needs sm_90 or newer")
    H, I, E = 4096, 1536, 8
    norm_w = torch.randn(H, device=device).bfloat16()
    wg, wu = (torch.randn(I, H, device=device).bfloat16() * H**-0.5 for _ in range(2))
    w_down = torch.randn(H, I, device=device).bfloat16() * I**-0.5
    router_w = torch.randn(E, H, device=device).bfloat16() * H**-0.5
    selection = step_ops.Selection(2, "softmax", None, True, 1e-20, 1.0)
    x = torch.randn(16, H, device=device).bfloat16()

    def chain(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.zeros_like(h)
        for _ in range(33):  # 3 launches each, all with PDL
            normed, h = step_ops.rms_norm(h, norm_w, 1e-6, residual=y)
            y = skinny.linear(skinny.gate_up_act(normed, wg, wu, True, 0.0, 1.0), [w_down])
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        routed = []
        for _ in range(10):  # the router's launch reads the epilogue's norm; the FFN's reads its weights
            epilogue = step_ops.Epilogue(norm_w, 1e-6, torch.empty_like(h), flag)
            h = step_ops.ffn_residual(h, y, epilogue=epilogue)
            ids, weights = step_ops.router_topk(epilogue.normed_TH, router_w, selection)
            routed.append(ids)
            y = skinny.linear(skinny.gate_up_act(epilogue.normed_TH, wg, wu, True, 0.0, 1.0), [w_down])
            y = y * weights[:, :1].to(y.dtype)
        return h + y, torch.stack(routed), flag

    with_pdl = chain(x)
    with launch.pdl_off():
        without = chain(x)
    assert torch.isfinite(without[0]).all() and without[2].item() == 0
    assert len(without[1].unique()) > 1  # the routing varies: a stale read would show
    for got, want in zip(with_pdl, without, strict=True):
        assert torch.equal(got, want)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    chain(static_x)  # warm: compile every launch before the capture
    with torch.cuda.graph(graph):
        static_out = chain(static_x)
    for _ in range(20):
        torch.cuda._sleep(100_000)  # the replay queued behind a busy stream
        graph.replay()
        for got, want in zip(static_out, without, strict=True):
            assert torch.equal(got, want)
    counts = launch.zeroed_counts("router_topk", device, step_ops._ROUTER_MAX_TILES)
    assert not counts.any(), "router_topk left arrival counts set"


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("T", [64, 128, 512])
def test_joint_projections_above_the_skinny_rows_equal_separate_gemms(dtype, T):
    """Above `skinny.MAX_ROWS` q / k / v (and a gate / up pair) held joint run as one GEMM over the
    joint weight: each output as its own nn.Linear computes it, to one bf16 rounding (cuBLAS picks
    other kernels for the joint shape)."""
    from epdraft.layers.mlp import DraftMLP
    from epdraft.layers.projection import gate_up, joint_weight, project

    torch.manual_seed(0)
    attn = DFlashAttention(4096, 32, 8, 128, rms_norm_eps=1e-6, rope_theta=1e4, dtype=dtype, device="cuda")
    mlp = DraftMLP(4096, 1536, dtype=dtype, device="cuda")
    for module in (attn, mlp):
        for p in module.parameters():
            torch.nn.init.normal_(p, std=4096**-0.5)
    linears = (attn.q_proj, attn.k_proj, attn.v_proj)
    assert attn.kernels.projections == mlp.kernels.projections == "skinny"  # the joint GEMMs' path
    assert joint_weight([lin.weight for lin in linears]) is not None  # still joint after the in-place init
    x = torch.randn(T, 4096, device="cuda").to(dtype)
    with torch.no_grad():
        for got, lin in zip(project(attn.kernels, x, *linears), linears):
            _close(got, F.linear(x, lin.weight), dtype)
        ref = gated_act(F.linear(x, mlp.gate_proj.weight), F.linear(x, mlp.up_proj.weight), ActivationSpec())
        _close(gate_up(mlp.kernels, x, mlp.gate_proj, mlp.up_proj, ActivationSpec()), ref.to(dtype), dtype)


@pytest.mark.parametrize("keep_rows", [None, 5])
@pytest.mark.parametrize("N,per_request", [(1, 16), (3, 7), (8, 16), (40, 16), (130, 4)])
def test_placement_launch_equals_the_pools_torch_chain(N, per_request, keep_rows):
    """`step_ops.placement` (one launch) against `KVPool.placement`'s torch chain on the same
    lengths: requests with no rows (a bucket's padding), rows past the counts, a ring's keep_rows."""
    from types import SimpleNamespace

    from epdraft.models.kv_pool import KVPool

    gen = torch.Generator().manual_seed(N * 31 + per_request)
    lengths = torch.randint(0, 500, (N + 7,), generator=gen, dtype=torch.int32).cuda()
    pad_slot = N + 6
    slots_N = torch.randperm(N + 5, generator=gen)[:N].cuda()
    counts_N = torch.randint(0, per_request + 1, (N,), generator=gen).cuda()
    counts_N[-1] = 0  # a padding request last
    pool = SimpleNamespace(lengths=lengths, pad_slot=pad_slot, keep_rows=keep_rows)
    rows = N * per_request + 3
    want = KVPool.placement(pool, slots_N, counts_N, rows)
    got = step_ops.placement(slots_N, counts_N, lengths, rows, pad_slot, keep_rows)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("N,B,L", [(1, 16, 5), (3, 5, 3), (8, 16, 5), (33, 7, 1), (0, 16, 5)])
def test_step_blocks_launch_equals_the_steps_torch_chain(N, B, L):
    """`DFlashDraft.block_inputs` with the Triton step ops (`step_ops.step_blocks`, one launch) against
    the same draft's torch chain (the CPU path's): the blocks' ids, positions and attention ends, the
    flags zeroed (over junk)."""
    config = preset_config(dict(hidden=256, heads=2, kv_heads=1, layers=L, experts=4, moe_intermediate=64,
                                top_k=2, vocab=32000, block_size=B))  # fmt: skip
    spec = DraftModelSpec.from_config(config)
    launched, chained = (DFlashDraft(spec, device="cuda", kernels=StepKernels(step_ops=ops))
                         for ops in ("triton", "torch"))  # fmt: skip
    gen = torch.Generator().manual_seed(N * 7 + B)
    lengths = torch.randint(0, 9000, (N + 5,), generator=gen, dtype=torch.int32).cuda()
    slots_N = torch.randperm(N + 5, generator=gen)[:N].cuda()
    anchors_N = torch.randint(0, 32000, (N,), generator=gen).cuda()
    torch.full((1 << 16,), -7, dtype=torch.int32, device="cuda")  # junk in the allocator's next blocks
    got = launched.block_inputs(anchors_N, slots_N, lengths)
    want = chained.block_inputs(anchors_N, slots_N, lengths)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_host_ints_reach_the_device_without_a_host_sync():
    """An eager step's slots, anchors and counts (`launch.host_ints`): queued behind the stream's
    work (a sleep here) without the host waiting, and right once it ran; `torch.tensor(values,
    device=cuda)`, which it replaces, is refused under the same sync check."""
    device = torch.device("cuda")
    torch.cuda._sleep(50_000_000)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = launch.host_ints([3, 1, 4, 1, 5], device)
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.tensor([3, 1, 4], device=device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.dtype == torch.long and got.tolist() == [3, 1, 4, 1, 5]
