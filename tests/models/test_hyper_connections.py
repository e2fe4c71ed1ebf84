"""mHC residual: V4 against transformers' DeepseekV4HyperConnection / DeepseekV4HyperHead, Sinkhorn
against a loop written here, V4.1's single pass against a reference written here from
draft_models.md 6b, zero rows and bf16 streams."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

from epdraft.errors import ConfigError
from epdraft.models.hyper_connections import (
    HyperConnection,
    HyperHead,
    Streams,
    collapse,
    enter_streams,
    single_pass_readout,
    sinkhorn,
    write_back,
)

H, HC, ITERS, HC_EPS, NORM_EPS = 16, 4, 20, 1e-6, 1e-6
FP32_TOL = 1e-5  # DESIGN.md: fp32 on CPU within 1e-5 relative


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def hf_config() -> DeepseekV4Config:
    return DeepseekV4Config(
        hidden_size=H, hc_mult=HC, hc_sinkhorn_iters=ITERS, hc_eps=HC_EPS, rms_norm_eps=NORM_EPS
    )


def hc_module(seed: int, *, single_pass: bool) -> HyperConnection:
    """Random fn / base / scale, large enough that comb is far from uniform."""
    gen = torch.Generator().manual_seed(seed)
    hc = HyperConnection(H, hc_mult=HC, sinkhorn_iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, single_pass=single_pass)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=gen) * 0.5)
        hc.base.copy_(torch.randn(hc.base.shape, generator=gen))
        hc.scale.copy_(torch.rand(3, generator=gen) + 0.5)
    return hc


def head_module(seed: int) -> HyperHead:
    gen = torch.Generator().manual_seed(seed)
    head = HyperHead(H, hc_mult=HC, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    with torch.no_grad():
        head.fn.copy_(torch.randn(head.fn.shape, generator=gen) * 0.5)
        head.base.copy_(torch.randn(head.base.shape, generator=gen))
        head.scale.copy_(torch.rand(1, generator=gen) + 0.5)
    return head


def streams(n: int, seed: int = 7, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, HC, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def sublayer_fn(seed: int):
    """A nonlinear stand-in for attention / FFN, computed in the input's dtype."""
    w = torch.randn(H, H, generator=torch.Generator().manual_seed(seed)) / H**0.5
    return lambda h_NH: torch.tanh(h_NH @ w.to(h_NH.dtype))


# (a) V4 equals transformers -------------------------------------------------------------------


def test_v4_sublayer_equals_transformers_decoder_wiring():
    ours = hc_module(0, single_pass=False)
    theirs = DeepseekV4HyperConnection(hf_config())
    theirs.load_state_dict(ours.state_dict())  # DeepSeek/transformers names load unchanged
    x_NcH, f = streams(11), sublayer_fn(1)

    post, comb, collapsed = theirs(x_NcH.unsqueeze(0))  # transformers wants [B, S, c, H]
    y = f(collapsed)
    want = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x_NcH.unsqueeze(0))

    h_NH, m = ours.read_input(Streams(x_NcH))
    assert rel_err(h_NH, collapsed[0]) <= FP32_TOL
    assert rel_err(m.post_Nc, post[0]) <= FP32_TOL
    assert rel_err(m.comb_Ncc, comb[0]) <= FP32_TOL
    got = ours(Streams(x_NcH), f)
    assert got.pre_Nc is None and got.x_NcH.shape == (11, HC, H)
    assert rel_err(got.x_NcH, want[0]) <= FP32_TOL


def test_v4_two_layers_and_head_equal_transformers():
    """attn_hc, ffn_hc per layer, two layers, then the head: the whole V4 residual path."""
    cfg = hf_config()
    ours = [hc_module(s, single_pass=False) for s in (10, 11, 12, 13)]
    theirs = [DeepseekV4HyperConnection(cfg) for _ in ours]
    for a, b in zip(ours, theirs):
        b.load_state_dict(a.state_dict())
    head, hf_head = head_module(20), DeepseekV4HyperHead(cfg)
    hf_head.load_state_dict({f"hc_{k}": v for k, v in head.state_dict().items()})  # hc_head.hc_fn -> fn
    subs = [sublayer_fn(s) for s in (30, 31, 32, 33)]
    x_NH = torch.randn(9, H, generator=torch.Generator().manual_seed(3))

    s = enter_streams(x_NH, HC, single_pass=False)
    ref = x_NH[None].unsqueeze(2).expand(-1, -1, HC, -1).contiguous()  # DeepseekV4Model's expansion
    assert torch.equal(s.x_NcH, ref[0])
    for hc, hf, f in zip(ours, theirs, subs):
        s = hc(s, f)
        post, comb, collapsed = hf(ref)
        ref = post.unsqueeze(-1) * f(collapsed).unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), ref)
        assert rel_err(s.x_NcH, ref[0]) <= FP32_TOL
    assert rel_err(head(s.x_NcH), hf_head(ref)[0]) <= FP32_TOL


# (b) Sinkhorn --------------------------------------------------------------------------------


def sinkhorn_loop(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """One matrix at a time, element loops: the description, not the module's code."""
    n = logits.shape[0]
    m = [[0.0] * n for _ in range(n)]
    for i in range(n):
        row = torch.softmax(logits[i].double(), dim=0).tolist()
        m[i] = [v + eps for v in row]

    def cols():
        for j in range(n):
            d = sum(m[i][j] for i in range(n)) + eps
            for i in range(n):
                m[i][j] /= d

    def rows():
        for i in range(n):
            d = sum(m[i]) + eps
            m[i] = [v / d for v in m[i]]

    cols()
    for _ in range(iters - 1):
        rows()
        cols()
    return torch.tensor(m, dtype=torch.float64)


def test_sinkhorn_doubly_stochastic_and_equal_to_loop():
    # unit-scale logits: with std >= 2 (near-permutation matrices) 20 iterations leave row sums off
    # by up to 2e-2 (columns stay exact: the last step normalizes them); that is Sinkhorn, not a bug
    logits = torch.randn(64, HC, HC, generator=torch.Generator().manual_seed(5))
    comb = sinkhorn(logits, ITERS, HC_EPS)
    assert comb.dtype == torch.float32 and comb.shape == (64, HC, HC)
    assert (comb.sum(-1) - 1).abs().max() <= 1e-4
    assert (comb.sum(-2) - 1).abs().max() <= 1e-4
    for b in range(0, 64, 8):
        assert rel_err(comb[b], sinkhorn_loop(logits[b], ITERS, HC_EPS)) <= FP32_TOL
    sharp = logits * 3  # still equal to the loop where it has not converged
    for b in range(0, 64, 16):
        assert rel_err(sinkhorn(sharp[b], ITERS, HC_EPS), sinkhorn_loop(sharp[b], ITERS, HC_EPS)) <= FP32_TOL


def test_sinkhorn_one_iteration_is_softmax_then_columns():
    logits = torch.randn(HC, HC, generator=torch.Generator().manual_seed(6))
    assert rel_err(sinkhorn(logits, 1, HC_EPS), sinkhorn_loop(logits, 1, HC_EPS)) <= FP32_TOL


# (c) V4.1 single pass --------------------------------------------------------------------------


def reference_single_pass(x_NH, params, subs, eps=HC_EPS, norm_eps=NORM_EPS, iters=ITERS):
    """draft_models.md 6b written out: per sublayer, pre / post / comb from the streams in fp32 (rms of
    the flattened streams, projection, sigmoid / 2 sigmoid / Sinkhorn); the input collapses with the pre
    mix of the previous sublayer (stream 0 at the start); the readout collapses with the last one."""
    n, c = x_NH.shape[0], HC
    x = x_NH.double().unsqueeze(1).repeat(1, c, 1)  # block input copied to every stream
    carried = None  # None: read stream 0
    for (fn, base, scale), f in zip(params, subs):
        flat = x.reshape(n, -1)
        raw = (flat @ fn.double().T) / torch.sqrt((flat**2).mean(-1, keepdim=True) + norm_eps)
        base, scale = base.double(), scale.double()
        pre = torch.sigmoid(raw[:, :c] * scale[0] + base[:c]) + eps
        post = 2 * torch.sigmoid(raw[:, c : 2 * c] * scale[1] + base[c : 2 * c])
        logits = (raw[:, 2 * c :] * scale[2] + base[2 * c :]).reshape(n, c, c)
        comb = torch.stack([sinkhorn_loop(logits[i], iters, eps) for i in range(n)]) if n else logits
        h = x[:, 0] if carried is None else torch.einsum("nj,njh->nh", carried, x)
        y = f(h.float()).double()
        x = post[:, :, None] * y[:, None, :] + torch.einsum("njk,njh->nkh", comb, x)
        carried = pre
    return x, torch.einsum("nj,njh->nh", carried, x)


def test_v41_single_pass_two_layers_equals_reference():
    layers = [hc_module(s, single_pass=True) for s in (40, 41, 42, 43)]  # attn, ffn, attn, ffn
    subs = [sublayer_fn(s) for s in (50, 51, 52, 53)]
    x_NH = torch.randn(13, H, generator=torch.Generator().manual_seed(8))
    want_x, want_out = reference_single_pass(x_NH, [(m.fn, m.base, m.scale) for m in layers], subs)

    s = enter_streams(x_NH, HC, single_pass=True)
    h_NH, _ = layers[0].read_input(s)
    assert torch.equal(h_NH, x_NH)  # stream-zero initial read
    for hc, f in zip(layers, subs):
        s = hc(s, f)
    assert rel_err(s.x_NcH, want_x) <= FP32_TOL
    assert rel_err(single_pass_readout(s), want_out) <= FP32_TOL


def test_v41_differs_from_v4_and_needs_its_streams():
    """The lag matters (so the test above would catch V4 wiring), and V4 streams are refused."""
    hc4, hc41 = hc_module(60, single_pass=False), hc_module(60, single_pass=True)
    f, x_NH = sublayer_fn(61), torch.randn(5, H, generator=torch.Generator().manual_seed(9))
    s4 = hc4(hc4(enter_streams(x_NH, HC, single_pass=False), f), f)
    s41 = hc41(hc41(enter_streams(x_NH, HC, single_pass=True), f), f)
    assert rel_err(s4.x_NcH, s41.x_NcH) > 1e-3
    with pytest.raises(ConfigError, match="single_pass=True"):
        hc41(enter_streams(x_NH, HC, single_pass=False), f)
    with pytest.raises(ConfigError, match="HyperHead"):
        single_pass_readout(s4)


# (d) edge cases -----------------------------------------------------------------------------


@pytest.mark.parametrize("single_pass", [False, True])
def test_zero_rows(single_pass):
    hc, head = hc_module(70, single_pass=single_pass), head_module(71)
    s = enter_streams(torch.empty(0, H), HC, single_pass=single_pass)
    s = hc(hc(s, sublayer_fn(72)), sublayer_fn(73))
    assert s.x_NcH.shape == (0, HC, H)
    out = single_pass_readout(s) if single_pass else head(s.x_NcH)
    assert out.shape == (0, H)


@pytest.mark.parametrize("single_pass", [False, True])
def test_bf16_streams_computed_in_fp32(single_pass):
    hc, head, f = hc_module(80, single_pass=single_pass), head_module(81), sublayer_fn(82)
    x16 = streams(7, seed=83, dtype=torch.bfloat16)
    s16 = Streams(x16, enter_streams(x16[:, 0], HC, single_pass=single_pass).pre_Nc)

    m16, m32 = hc.mixes(x16), hc.mixes(x16.float())
    for a, b in zip(m16, m32):  # mixes from bf16 streams are the fp32 mixes of the same values
        assert a.dtype == torch.float32 and torch.equal(a, b)
    h16, _ = hc.read_input(s16)
    y16 = f(h16)
    assert h16.dtype == torch.bfloat16
    assert torch.equal(h16, collapse(x16.float(), s16.pre_Nc if single_pass else m32.pre_Nc).to(torch.bfloat16))
    out16 = hc(s16, f).x_NcH
    assert out16.dtype == torch.bfloat16
    # one rounding at the end, not one per product: fp32 write-back of the same bf16 values, then cast
    assert torch.equal(out16, write_back(y16.float(), x16.float(), m32.post_Nc, m32.comb_Ncc).to(torch.bfloat16))
    assert torch.equal(head(x16), head(x16.float()).to(torch.bfloat16))


def test_bad_sizes_are_config_errors():
    with pytest.raises(ConfigError, match="hc_sinkhorn_iters = 0"):
        HyperConnection(H, hc_mult=HC, sinkhorn_iters=0, hc_eps=HC_EPS, norm_eps=NORM_EPS, single_pass=False)
    with pytest.raises(ConfigError, match="hc_mult >= 1"):
        HyperHead(H, hc_mult=0, hc_eps=HC_EPS, norm_eps=NORM_EPS)
