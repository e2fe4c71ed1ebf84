"""The mHC launches (`epdraft.kernels.step.hc`) against the torch functions they replace
(`epdraft.models.hyper_connections`, the CPU path): fp32 rounding order apart in fp32 streams, at
most one bf16 rounding apart in bf16 ones; and a HyperConnection built fused equals the torch one."""

from __future__ import annotations

import pytest
import torch

from epdraft.kernels.step import hc
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
