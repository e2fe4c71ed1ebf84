"""A DeepSeek DSpark draft's Triton launches against the torch code they replace (the CPU path):
the mHC mixing (`epdraft.kernels.step.hc` vs `epdraft.models.hyper_connections`), DeepSeek's RMSNorm
(`ops.rms_norm(round_first=False)`), the sink attention over the window and the block
(`epdraft.kernels.step.sink_attention` vs `sink_attention` + the inverse rotation) and the K=V row's
finish (`epdraft.kernels.step.kv_finish` vs `finish_kv`, and its ring form vs `WindowKVPool.store`):
fp32 rounding order apart in fp32, at most one bf16 rounding apart in bf16 (the K=V row's FP8 channels
bit for bit); and the modules and the draft's commit built fused equal the torch ones."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from epdraft.bench.step import RandomHeads
from epdraft.kernels.step import hc, kv_finish as kv_kernel, sink_attention as sink_kernel
from epdraft.layers.step_kernels import StepKernels
from epdraft.models import load_draft
from epdraft.models.deepseek_attention import (
    DeepseekDSparkAttention,
    DeepseekRMSNorm,
    apply_interleaved_rope,
    finish_kv,
    interleaved_rope_cos_sin,
    sink_attention,
)
from epdraft.models.kv_pool import WindowKVPool
from epdraft.models.hyper_connections import (
    HyperConnection,
    Streams,
    collapse,
    normalized_projection,
    split_mixes,
    write_back,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
REPO = Path(__file__).resolve().parents[2]


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = dict(rtol=2**-7, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.float(), ref.float(), **tol)


def _mixes_inputs(N: int, c: int, H: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    M = (2 + c) * c
    x = torch.randn(N, c, H, generator=gen, device=DEVICE).to(dtype)
    fn = torch.randn(M, c * H, generator=gen, device=DEVICE) * (c * H) ** -0.5
    scale = torch.rand(3, generator=gen, device=DEVICE) + 0.5
    base = torch.randn(M, generator=gen, device=DEVICE)
    return x, fn, scale, base


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,c,H", [(1, 4, 4096), (5, 4, 4096), (37, 4, 256), (320, 4, 96), (0, 4, 64), (3, 2, 300)])
def test_mixes_equal_the_projection_and_sinkhorn(dtype, N, c, H):
    x, fn, scale, base = _mixes_inputs(N, c, H, dtype, seed=N + H)
    pre, post, comb = hc.hc_mixes(x, fn, scale, base, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    ref = split_mixes(normalized_projection(x, fn, 1e-6), scale, base, hc_mult=c, sinkhorn_iters=20, hc_eps=1e-6)
    for got, want in zip((pre, post, comb), ref):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # fp32 throughout; sums in another order


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,c,H", [(1, 4, 4096), (40, 4, 1000), (0, 4, 64), (3, 2, 300)])
def test_collapse_and_write_back_equal_the_torch_functions(dtype, N, c, H):
    gen = torch.Generator(device=DEVICE).manual_seed(N * 7 + H)
    x = torch.randn(N, c, H, generator=gen, device=DEVICE).to(dtype)
    y = torch.randn(N, H, generator=gen, device=DEVICE).to(dtype)
    pre = torch.rand(N, c, generator=gen, device=DEVICE)
    post = 2 * torch.rand(N, c, generator=gen, device=DEVICE)
    comb = torch.softmax(torch.randn(N, c, c, generator=gen, device=DEVICE), dim=-1)
    got = hc.hc_collapse(x, pre)
    assert got.dtype == dtype and got.shape == (N, H)
    _close(got, collapse(x, pre), dtype)
    new = hc.hc_write_back(y, x, post, comb)
    assert new.dtype == dtype and new.shape == (N, c, H)
    _close(new, write_back(y, x, post, comb), dtype)


@torch.no_grad()
@pytest.mark.parametrize("single_pass", [False, True])
def test_a_fused_hyper_connection_equals_the_torch_one(single_pass):
    torch.manual_seed(0)
    kw = dict(hc_mult=4, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6, single_pass=single_pass, device=DEVICE)
    torch_hc, fused_hc = HyperConnection(512, **kw), HyperConnection(512, fused=True, **kw)
    fused_hc.load_state_dict(torch_hc.state_dict())
    x = torch.randn(10, 4, 512, device=DEVICE)
    pre = torch.softmax(torch.randn(10, 4, device=DEVICE), dim=-1) if single_pass else None
    streams = Streams(x, pre)
    sub = torch.nn.Linear(512, 512, device=DEVICE)
    _close(fused_hc(streams, sub).x_NcH, torch_hc(streams, sub).x_NcH, torch.float32)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,H", [(1, 4096), (37, 1280), (0, 512)])
def test_deepseek_norm_scales_in_fp32_and_rounds_once(dtype, T, H):
    torch.manual_seed(T + H)
    plain = DeepseekRMSNorm(H, 1e-6, dtype=dtype, device=DEVICE)
    fused = DeepseekRMSNorm(H, 1e-6, fused=True, dtype=dtype, device=DEVICE)
    torch.nn.init.normal_(plain.weight)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(T, H, device=DEVICE).to(dtype)
    _close(fused(x), plain(x), dtype)


def _attention_reference(q, ctx, valid, blk, sinks, cos, sin, scale):
    N, B = q.shape[:2]
    kv = torch.cat([ctx.to(blk.dtype), blk], dim=1)
    ok = torch.cat([valid, torch.ones(N, B, dtype=torch.bool, device=q.device)], dim=1)
    o = sink_attention(q, kv, ok, sinks, scale)
    return apply_interleaved_rope(o, cos.unsqueeze(2), sin.unsqueeze(2), inverse=True).to(q.dtype)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,B,h,D,R,S", [(1, 5, 64, 512, 64, 128), (3, 5, 8, 128, 64, 8), (2, 3, 4, 64, 64, 0),
                                         (0, 5, 4, 64, 64, 8), (4, 5, 64, 512, 64, 128)])  # fmt: skip
def test_sink_attention_equals_the_torch_chain(dtype, N, B, h, D, R, S):
    gen = torch.Generator(device=DEVICE).manual_seed(N * 100 + S)
    q = torch.randn(N, B, h, D, generator=gen, device=DEVICE).to(dtype)
    ctx = torch.randn(N, S, D, generator=gen, device=DEVICE).to(dtype)
    blk = torch.randn(N, B, D, generator=gen, device=DEVICE).to(dtype)
    valid = torch.rand(N, S, generator=gen, device=DEVICE) < 0.8  # rows left out anywhere (a ring's unwritten slots)
    sinks = torch.randn(h, generator=gen, device=DEVICE)
    positions = torch.randint(0, 4000, (N, B), generator=gen, device=DEVICE)
    cos, sin = interleaved_rope_cos_sin(positions, R, 10000.0)
    scale = D**-0.5
    got = sink_kernel.sink_block_attention(q, ctx, valid, blk, sinks, cos, sin, scale)
    assert got.dtype == dtype and got.shape == q.shape
    _close(got, _attention_reference(q, ctx, valid, blk, sinks, cos, sin, scale), dtype)


@torch.no_grad()
@pytest.mark.parametrize("q_norm", [False, True])
def test_a_fused_deepseek_attention_equals_the_torch_one(q_norm):
    torch.manual_seed(1)
    kw = dict(rope_theta=10000.0, rms_norm_eps=1e-6, q_norm=q_norm, kv_fake_quant=True, dtype=torch.bfloat16,
              device=DEVICE)  # fmt: skip
    plain = DeepseekDSparkAttention(256, 8, 64, 128, 64, 2, 32, **kw)
    fused = DeepseekDSparkAttention(256, 8, 64, 128, 64, 2, 32, fused_norms=True, fused_attention=True,
                                    fused_kv=True, **kw)  # fmt: skip
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.1)
    fused.load_state_dict(plain.state_dict())
    assert fused.fused_attention and fused.fused_kv
    N, B, L = 3, 5, 20
    x = torch.randn(N, B, 256, device=DEVICE).bfloat16()
    ctx_pos = torch.arange(L, device=DEVICE).expand(N, L)
    ctx = plain.context_kv(torch.randn(N, L, 256, device=DEVICE).bfloat16(), ctx_pos)
    valid = torch.arange(L, device=DEVICE) < torch.tensor([[7], [20], [1]], device=DEVICE)
    positions = torch.tensor([7, 20, 1], device=DEVICE).unsqueeze(1) + torch.arange(B, device=DEVICE)
    _close(fused(x, positions, ctx, valid), plain(x, positions, ctx, valid), torch.bfloat16)


def _kv_rows(T: int, D: int, R: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, D] K=V rows over a spread of magnitudes (randn times 2^[-20, 10) per row); every 4th row's
    groups have their amax exactly 448 * 2^k (scale 2^k: nothing clamps), every 4th + 1 lies under the
    1e-4 floor (scale 2^-22: FP8 subnormals)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    mag = torch.exp2(torch.randint(-20, 10, (T, 1), generator=gen, device=DEVICE).float())
    kv = torch.randn(T, D, generator=gen, device=DEVICE) * mag
    nope = D - R
    group = 64 if nope % 64 == 0 else nope
    exact = kv[0::4, :nope].unflatten(-1, (-1, group))  # a view: written through
    k = torch.exp2(torch.randint(-14, 6, (*exact.shape[:-1], 1), generator=gen, device=DEVICE).float())
    exact.copy_(torch.randn(exact.shape, generator=gen, device=DEVICE).clamp(-3, 3) * 100 * k)
    exact[..., :1] = 448.0 * k * torch.where(torch.rand(k.shape, generator=gen, device=DEVICE) < 0.5, -1.0, 1.0)
    kv[1::4] = torch.randn(kv[1::4].shape, generator=gen, device=DEVICE) * 1e-6
    return kv.to(dtype)


def _same_kv(got: torch.Tensor, want: torch.Tensor, R: int) -> None:
    """K=V rows [..., D]: the FP8 channels bit for bit (the kernel's exact scale equals the torch
    chain's on every bf16 row, and on fp32 rows but within fp32 ulps above 448 * 2^k: kv_finish's
    docstring), the rotated ones within one rounding to their dtype of the row's largest (the GPU
    may fuse the rotation's products and sum into an FMA)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    bad = (got[:, :-R] != want[:, :-R]).any(-1).nonzero()[:5, 0].tolist()
    assert not bad, f"FP8 channels differ in rows {bad}"
    if got.shape[0]:
        err = (got[:, -R:].float() - want[:, -R:].float()).abs().amax(-1)
        scale = want[:, -R:].float().abs().amax(-1).clamp_min(1e-30)
        tol = 2**-7 if got.dtype == torch.bfloat16 else 2**-21
        assert bool((err <= tol * scale).all()), f"rotated channels: max |d| / row max {float((err / scale).max()):.3g}"


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fake_quant", [True, False])
# V4.1-Flash's K=V head (7 FP8 groups of 64) and tests/models' tiny drafts' (one group of 12)
@pytest.mark.parametrize("D,R", [(512, 64), (16, 4)])
@pytest.mark.parametrize("T", [0, 1, 37, 320])
def test_kv_finish_equals_the_torch_chain(T, D, R, fake_quant, dtype):
    kv = _kv_rows(T, D, R, dtype, seed=T * 10 + D)
    positions = torch.randint(0, 100_000, (T,), device=DEVICE)
    cos, sin = interleaved_rope_cos_sin(positions, R, 10000.0)
    got = kv_kernel.kv_finish(kv, cos, sin, fake_quant=fake_quant)
    assert got.shape == (T, D) and got.dtype == dtype
    _same_kv(got, finish_kv(kv, cos, sin, fake_quant=fake_quant), R)


@torch.no_grad()
@pytest.mark.parametrize("dtype,ring_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                              (torch.float32, torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("D,R", [(512, 64), (16, 4)])
def test_kv_finish_store_equals_the_pool_store_of_the_torch_chain(D, R, dtype, ring_dtype):
    """A commit's rows as `placement` lays them out (a ring empty, one part-filled, one wrapping past
    its window, padding rows to the pad slot): the launch writes what `WindowKVPool.store` of the
    torch chain's rows writes, and leaves every other ring row as it was."""
    gen = torch.Generator(device=DEVICE).manual_seed(D)
    pools = [WindowKVPool(1, D, window=8, max_requests=4, max_context=1000, block_size=5, dtype=ring_dtype,
                          device=DEVICE) for _ in range(2)]  # fmt: skip
    fill = torch.randn(pools[0].kv[0].shape, generator=gen, device=DEVICE).to(ring_dtype)
    slots_N = torch.tensor([0, 1, 3, pools[0].pad_slot], device=DEVICE)
    for pool in pools:
        pool.kv[0].copy_(fill)
        pool.advance(slots_N, torch.tensor([0, 5, 37, 0], device=DEVICE))
    counts_N = torch.tensor([3, 12, 5, 0], device=DEVICE)  # 12 > window 8: the oldest 4 go to the pad slot
    slot_T, position_T = pools[0].placement(slots_N, counts_N, 24)  # rows 20.. are a bucket's padding
    kv = _kv_rows(24, D, R, dtype, seed=D + 1)
    cos, sin = interleaved_rope_cos_sin(position_T, R, 10000.0)
    pools[0].store(0, slot_T, position_T, finish_kv(kv, cos, sin, fake_quant=True))
    kv_kernel.kv_finish_store(kv, cos, sin, slot_T, position_T, pools[1].kv[0], fake_quant=True)
    pad = pools[0].pad_slot  # its rows are written in no fixed order and never read
    _same_kv(pools[1].kv[0][:pad], pools[0].kv[0][:pad], R)
    assert torch.equal(pools[1].kv[0][pad, 1:], fill[pad, 1:])  # the pad slot's rows all land on its row 0


def _tool_draft(tmp_path: Path, variant: str, kernels: StepKernels | None = None):
    out = tmp_path / f"draft-{variant}"
    if not out.exists():
        flags = ["--v41"] if variant == "v41" else []
        made = subprocess.run([sys.executable, str(REPO / "tools" / "make_deepseek_dspark_draft.py"), str(out), *flags],
                              capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
        assert made.returncode == 0, made.stderr
    return load_draft(out, dtype=torch.bfloat16, device=DEVICE, kernels=kernels).eval()


@contextlib.contextmanager
def _torch_kv(draft) -> Iterator[None]:
    """The draft's K=V rows by the torch chain (`fused_kv` off), everything else as built."""
    for layer in draft.layers:
        layer.attn.fused_kv = False
    try:
        yield
    finally:
        for layer in draft.layers:
            layer.attn.fused_kv = True


def _commit(draft, pool, seed: int) -> torch.Tensor:
    """Three requests' prompts (2, 9, 33 rows: rings part-filled and wrapped, window 8), then one
    padded commit as a graph bucket runs it; returns their slots."""
    spec, R = draft.spec, draft.num_drafts + 1
    width = spec.num_target_features * spec.hidden_size
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    for rid in range(3):
        pool.admit(rid)
    draft.extend(pool, [0, 1, 2], [torch.randn(n, width, generator=gen, device=DEVICE).bfloat16() for n in (2, 9, 33)])
    slots = torch.tensor([pool.slot(0), pool.slot(1), pool.slot(2), pool.pad_slot], device=DEVICE)
    rows = torch.randn(4 * R, width, generator=gen, device=DEVICE).bfloat16()
    draft.write_context(pool, slots, torch.tensor([R, 1, 5, 0], device=DEVICE), rows)
    return slots[:3]


@torch.no_grad()
@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_triton_write_context_equals_the_torch_chain(variant, tmp_path):
    """The tiny tool draft's (D = 32, R = 8: one FP8 group of 24) commit with the K=V launch
    (`store_context_kv`) against the same draft's torch chain + `WindowKVPool.store`: the rings'
    FP8 channels bit for bit, the rotated ones within a bf16 rounding; its step's block rows through
    the launch too (`_kv`) give the same hidden; and against the draft built all torch
    (`StepKernels.reference()`: its norms round elsewhere), the rings within one bf16 rounding of
    the norms (one FP8 step in the FP8 channels)."""
    draft = _tool_draft(tmp_path, variant)
    assert draft.kernels.step_ops == "triton" and all(layer.attn.fused_kv for layer in draft.layers)
    R = draft.spec.deepseek.rope_head_dim
    pools = [draft.new_pool(max_requests=4, max_context=200) for _ in range(3)]
    slots = _commit(draft, pools[0], seed=3)
    with _torch_kv(draft):
        _commit(draft, pools[1], seed=3)
    assert torch.equal(pools[0].lengths, pools[1].lengths)
    for got, want in zip(pools[0].buffers, pools[1].buffers):
        _same_kv(got[:3], want[:3], R)
    spec = draft.spec
    heads = RandomHeads(spec.vocab_size, spec.hidden_size, dtype=torch.bfloat16, device=torch.device(DEVICE))
    anchors, lengths = torch.tensor([3, 5, 7], device=DEVICE), pools[0].lengths[slots].long()
    windows = [pools[0].window_of(i, slots) for i in range(draft.spec.num_layers)]
    fused_hidden, _ = draft.block_hidden(anchors, lengths, windows, heads, None)
    with _torch_kv(draft):
        torch_hidden, _ = draft.block_hidden(anchors, lengths, windows, heads, None)
    _close(fused_hidden, torch_hidden, torch.bfloat16)

    reference = _tool_draft(tmp_path, variant, kernels=StepKernels.reference())
    assert not any(layer.attn.fused_kv for layer in reference.layers)
    _commit(reference, pools[2], seed=3)
    assert torch.equal(pools[0].lengths, pools[2].lengths)
    for got, want in zip(pools[0].buffers, pools[2].buffers):
        got, want, D = got[:3].float(), want[:3].float(), got.shape[-1]
        # the norms' bf16 roundings differ now and then, and a value moved by one bf16 ulp across an FP8
        # rounding boundary moves by one e4m3 step (2^-3 of it at most)
        torch.testing.assert_close(got[..., : D - R], want[..., : D - R], rtol=2**-3, atol=1e-2)
        torch.testing.assert_close(got[..., D - R :], want[..., D - R :], rtol=2**-7, atol=1e-2)
