"""A DeepSeek DSpark draft's Triton launches against the torch code they replace (the CPU path):
the mHC mixing (`epdraft.kernels.step.hc` vs `epdraft.models.hyper_connections`), DeepSeek's RMSNorm
(`ops.rms_norm(round_first=False)`) and the sink attention over the window and the block
(`epdraft.kernels.step.sink_attention` vs `sink_attention` + the inverse rotation): fp32 rounding
order apart in fp32, at most one bf16 rounding apart in bf16; and the modules built fused equal the
torch ones."""

from __future__ import annotations

import pytest
import torch

from epdraft.kernels.step import hc, sink_attention as sink_kernel
from epdraft.models.deepseek_attention import (
    DeepseekDSparkAttention,
    DeepseekRMSNorm,
    apply_interleaved_rope,
    interleaved_rope_cos_sin,
    sink_attention,
)
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
    fused = DeepseekDSparkAttention(256, 8, 64, 128, 64, 2, 32, fused_norms=True, fused_attention=True, **kw)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.1)
    fused.load_state_dict(plain.state_dict())
    assert fused.fused_attention
    N, B, L = 3, 5, 20
    x = torch.randn(N, B, 256, device=DEVICE).bfloat16()
    ctx_pos = torch.arange(L, device=DEVICE).expand(N, L)
    ctx = plain.context_kv(torch.randn(N, L, 256, device=DEVICE).bfloat16(), ctx_pos)
    valid = torch.arange(L, device=DEVICE) < torch.tensor([[7], [20], [1]], device=DEVICE)
    positions = torch.tensor([7, 20, 1], device=DEVICE).unsqueeze(1) + torch.arange(B, device=DEVICE)
    _close(fused(x, positions, ctx, valid), plain(x, positions, ctx, valid), torch.bfloat16)
