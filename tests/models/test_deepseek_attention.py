"""DeepseekDSparkAttention (issue 31): V4 against transformers' DeepseekV4Attention (sliding layer, no
compressor), V4.1 against a plain reference written from DeepSeek's description, the sink in the
denominator, N = 0 and bf16 drift."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from epdraft.errors import ConfigError
from epdraft.models.deepseek_attention import (
    DEEPSEEK_ATTENTION_NAMES,
    DeepseekDSparkAttention,
    context_window,
    sink_attention,
)

HIDDEN, HEADS, Q_RANK, HEAD_DIM, ROPE_DIM, GROUPS, O_RANK, THETA, EPS = 64, 4, 16, 32, 8, 2, 16, 10000.0, 1e-6


def make_attention(*, q_norm: bool, seed: int = 0, dtype: torch.dtype = torch.float32) -> DeepseekDSparkAttention:
    attn = DeepseekDSparkAttention(
        HIDDEN, HEADS, Q_RANK, HEAD_DIM, ROPE_DIM, GROUPS, O_RANK, rope_theta=THETA, rms_norm_eps=EPS, q_norm=q_norm,
        dtype=dtype,
    )  # fmt: skip
    randomize_(attn, seed)
    return attn


def deepseek_weights(seed: int) -> dict[str, torch.Tensor]:
    """Random tensors under DeepSeek's names (`mtp.{i}.attn.*` without the prefix), fp32."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.3):
        return scale * torch.randn(*shape, generator=g)

    return {
        "wq_a.weight": rnd(Q_RANK, HIDDEN),
        "q_norm.weight": 1.0 + rnd(Q_RANK, scale=0.1),
        "wq_b.weight": rnd(HEADS * HEAD_DIM, Q_RANK),
        "wkv.weight": rnd(HEAD_DIM, HIDDEN),
        "kv_norm.weight": 1.0 + rnd(HEAD_DIM, scale=0.1),
        "wo_a.weight": rnd(GROUPS * O_RANK, HEADS * HEAD_DIM // GROUPS),
        "wo_b.weight": rnd(HIDDEN, GROUPS * O_RANK),
        "attn_sink": rnd(HEADS, scale=1.0),
    }


def randomize_(attn: DeepseekDSparkAttention, seed: int) -> None:
    with torch.no_grad():
        for name, t in deepseek_weights(seed).items():
            attn.get_parameter(DEEPSEEK_ATTENTION_NAMES[name]).copy_(t)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# ---------------------------------------------------------------- (a) V4 against transformers


def hf_attention(attn: DeepseekDSparkAttention):
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

    cfg = DeepseekV4Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=Q_RANK, head_dim=HEAD_DIM,
        partial_rotary_factor=ROPE_DIM / HEAD_DIM, o_groups=GROUPS, o_lora_rank=O_RANK, rope_theta=THETA,
        rms_norm_eps=EPS, num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"],
        vocab_size=32, sliding_window=128,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    ref = DeepseekV4Attention(cfg, 0).float().eval()
    assert ref.compressor is None  # sliding layers run no HCA/CSA compressor
    ref.load_state_dict(attn.state_dict(), strict=True)  # the same parameter names
    return ref, DeepseekV4RotaryEmbedding(cfg)


def hf_forward(ref, rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """transformers' output with no mask and no cache: every query sees every key."""
    emb = {kind: rotary(x, positions, layer_type=kind) for kind in ("main", "compress")}
    with torch.no_grad():
        return ref(x, emb, positions, None, cache=None)[0]


def test_v4_block_matches_transformers():
    attn = make_attention(q_norm=True)
    ref, rotary = hf_attention(attn)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, HIDDEN, generator=gen)
    positions = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5]])
    expected = hf_forward(ref, rotary, x, positions)
    with torch.no_grad():
        got = attn(x, positions, torch.zeros(2, 0, HEAD_DIM), torch.zeros(2, 0, dtype=torch.bool))
    assert rel_err(got, expected) <= 1e-5


def test_v4_context_and_block_match_transformers():
    """Context + block as one transformers sequence with no mask = context_kv rows + the block's queries."""
    attn = make_attention(q_norm=True, seed=2)
    ref, rotary = hf_attention(attn)
    gen = torch.Generator().manual_seed(3)
    L, B = 9, 4
    x = torch.randn(2, L + B, HIDDEN, generator=gen)
    positions = torch.arange(L + B).expand(2, -1) + torch.tensor([[0], [17]])
    expected = hf_forward(ref, rotary, x, positions)[:, L:]
    with torch.no_grad():
        kv_ctx = attn.context_kv(x[:, :L], positions[:, :L])
        got = attn(x[:, L:], positions[:, L:], kv_ctx, torch.ones(2, L, dtype=torch.bool))
    assert kv_ctx.shape == (2, L, HEAD_DIM)
    assert rel_err(got, expected) <= 1e-5


# ---------------------------------------------------------------- (b) V4.1 against a plain reference


def _rms(x, weight=None):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return y if weight is None else y * weight


def _rope(x, pos, inverse=False):
    """DeepSeek's interleaved RoPE as complex multiplication on the trailing ROPE_DIM channels:
    channels (2i, 2i+1) are the complex number 2i + 1j*(2i+1)."""
    inv_freq = THETA ** (-torch.arange(0, ROPE_DIM, 2, dtype=torch.float64) / ROPE_DIM)
    angle = pos.double().unsqueeze(-1) * inv_freq  # [T, R/2]
    rot = torch.polar(torch.ones_like(angle), angle)
    if inverse:
        rot = rot.conj()
    while rot.dim() < x.dim():
        rot = rot.unsqueeze(-2)  # broadcast over heads
    pairs = torch.view_as_complex(x[..., -ROPE_DIM:].reshape(*x.shape[:-1], ROPE_DIM // 2, 2).contiguous())
    return torch.cat([x[..., :-ROPE_DIM], torch.view_as_real(pairs * rot).flatten(-2)], dim=-1)


def reference_v41(w, x_BH, pos_B, ctx_LH, ctx_pos_L, window):
    """One request, fp64, written from issue 31's description (no q norm: V4.1)."""
    w = {k: v.double() for k, v in w.items()}
    x_BH, ctx_LH = x_BH.double(), ctx_LH.double()
    B, L = x_BH.shape[0], ctx_LH.shape[0]
    kv = lambda h, p: _rope(_rms(h @ w["wkv.weight"].T, w["kv_norm.weight"]), p)  # noqa: E731
    keep = slice(max(0, L - window), L)  # the last `window` context rows before the block
    keys = torch.cat([kv(ctx_LH[keep], ctx_pos_L[keep]), kv(x_BH, pos_B)])
    q = (_rms(x_BH @ w["wq_a.weight"].T, w["q_norm.weight"]) @ w["wq_b.weight"].T).view(B, HEADS, HEAD_DIM)
    q = _rope(q, pos_B)
    o = torch.empty(B, HEADS, HEAD_DIM, dtype=torch.float64)
    for head in range(HEADS):
        scores = q[:, head] @ keys.T / math.sqrt(HEAD_DIM)  # [B, S]
        sink = w["attn_sink"][head]
        m = torch.maximum(scores.max(-1, keepdim=True).values, sink)
        e = torch.exp(scores - m)
        o[:, head] = (e / (e.sum(-1, keepdim=True) + torch.exp(sink - m))) @ keys
    o = _rope(o, pos_B, inverse=True)
    per_group = HEADS // GROUPS
    parts = [
        o[:, g * per_group : (g + 1) * per_group].reshape(B, -1) @ w["wo_a.weight"][g * O_RANK : (g + 1) * O_RANK].T
        for g in range(GROUPS)
    ]
    return torch.cat(parts, dim=-1) @ w["wo_b.weight"].T


def test_v41_matches_reference_over_a_window():
    window, B = 5, 4
    context_lens = [11, 3, 0, 5, 8]  # longer than the window, shorter, none, exactly it
    N, L = len(context_lens), max(context_lens)
    attn = make_attention(q_norm=False, seed=4)
    w = deepseek_weights(4)
    gen = torch.Generator().manual_seed(5)
    ctx_NLH = torch.randn(N, L, HIDDEN, generator=gen)
    x_NBH = torch.randn(N, B, HIDDEN, generator=gen)
    lens_N = torch.tensor(context_lens)
    ctx_pos_NL = torch.arange(L).expand(N, -1)
    pos_NB = lens_N.unsqueeze(1) + torch.arange(B)
    with torch.no_grad():
        kv_NLD = attn.context_kv(ctx_NLH, ctx_pos_NL)
        kv_NSD, valid_NS = context_window(kv_NLD, lens_N, window)
        got = attn(x_NBH, pos_NB, kv_NSD, valid_NS)
        # A pool's ring of `window` slots (slot = position mod window), read as stored: the same output.
        ring = torch.zeros(N, window, HEAD_DIM)
        ring_valid = torch.zeros(N, window, dtype=torch.bool)
        for n, length in enumerate(context_lens):
            for p in range(length):
                ring[n, p % window], ring_valid[n, p % window] = kv_NLD[n, p], True
        got_ring = attn(x_NBH, pos_NB, ring, ring_valid)
    assert kv_NSD.shape == (N, window, HEAD_DIM)
    assert valid_NS.sum(1).tolist() == [min(window, n) for n in context_lens]
    for n, length in enumerate(context_lens):
        expected = reference_v41(w, x_NBH[n], pos_NB[n], ctx_NLH[n, :length], ctx_pos_NL[n, :length], window)
        assert rel_err(got[n], expected) <= 1e-5, n
        assert rel_err(got_ring[n], expected) <= 1e-5, n


def test_v4_and_v41_differ_only_by_the_q_norm():
    v4, v41 = make_attention(q_norm=True, seed=6), make_attention(q_norm=False, seed=6)
    x = torch.randn(1, 3, HIDDEN, generator=torch.Generator().manual_seed(7))
    pos = torch.arange(3)[None]
    kv, valid = torch.zeros(1, 0, HEAD_DIM), torch.zeros(1, 0, dtype=torch.bool)
    with torch.no_grad():
        assert not torch.allclose(v4(x, pos, kv, valid), v41(x, pos, kv, valid))
    assert dict(v4.named_parameters()).keys() == dict(v41.named_parameters()).keys()


# ---------------------------------------------------------------- (c) the sink


def _sink_case(seed: int = 8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 4, HEADS, HEAD_DIM, generator=gen)
    kv = torch.randn(3, 7, HEAD_DIM, generator=gen)
    valid = torch.rand(3, 7, generator=gen) > 0.3
    valid[:, -1] = True
    return q, kv, valid


def test_sink_joins_the_denominator_only():
    q, kv, valid = _sink_case()
    scale = HEAD_DIM**-0.5
    mask = valid[:, None, None, :]  # [N, 1, 1, S] against q as [N, h, B, D]
    plain = F.scaled_dot_product_attention(
        q.transpose(1, 2), kv[:, None], kv[:, None], attn_mask=mask, scale=scale
    ).transpose(1, 2)  # fmt: skip
    very_negative = sink_attention(q, kv, valid, torch.full((HEADS,), -1e4), scale)
    assert rel_err(very_negative, plain) <= 1e-5

    sinks = torch.tensor([-1.0, 0.0, 2.0, 5.0])  # unscaled: exp(sink) joins sum_s exp(scale * q.k_s)
    z = torch.exp(torch.einsum("nbhd,nsd->nbhs", q, kv) * scale).masked_fill(~valid[:, None, None], 0).sum(-1)
    shrink = (z / (z + sinks.exp())).unsqueeze(-1)
    assert rel_err(sink_attention(q, kv, valid, sinks, scale), plain * shrink) <= 1e-5

    huge = sink_attention(q, kv, valid, torch.full((HEADS,), 1e4), scale)
    assert huge.abs().max() < 1e-30


def test_large_sink_shrinks_the_layer_output():
    attn = make_attention(q_norm=False, seed=9)
    x = torch.randn(2, 4, HIDDEN, generator=torch.Generator().manual_seed(10))
    pos = torch.arange(4).expand(2, -1)
    kv, valid = torch.zeros(2, 0, HEAD_DIM), torch.zeros(2, 0, dtype=torch.bool)
    with torch.no_grad():
        base = attn(x, pos, kv, valid)
        attn.sinks.fill_(50.0)
        shrunk = attn(x, pos, kv, valid)
    assert shrunk.abs().max() < 1e-12 * base.abs().max()


# ---------------------------------------------------------------- (d) N = 0, bf16, config errors


def test_zero_requests():
    attn = make_attention(q_norm=False)
    with torch.no_grad():
        kv = attn.context_kv(torch.zeros(0, 5, HIDDEN), torch.zeros(0, 5, dtype=torch.long))
        kv_win, valid = context_window(kv, torch.zeros(0, dtype=torch.long), 3)
        out = attn(torch.zeros(0, 4, HIDDEN), torch.zeros(0, 4, dtype=torch.long), kv_win, valid)
    assert kv.shape == (0, 5, HEAD_DIM) and kv_win.shape == (0, 3, HEAD_DIM) and out.shape == (0, 4, HIDDEN)


@pytest.mark.parametrize("q_norm", [True, False])
def test_bf16_within_drift_of_fp32(q_norm):
    fp32 = make_attention(q_norm=q_norm, seed=11)
    bf16 = make_attention(q_norm=q_norm, seed=11, dtype=torch.bfloat16)
    assert bf16.sinks.dtype == torch.float32
    gen = torch.Generator().manual_seed(12)
    ctx, x = torch.randn(3, 10, HIDDEN, generator=gen), torch.randn(3, 4, HIDDEN, generator=gen)
    lens = torch.tensor([10, 2, 6])
    ctx_pos, pos = torch.arange(10).expand(3, -1), lens.unsqueeze(1) + torch.arange(4)
    outs = []
    with torch.no_grad():
        for attn, dtype in ((fp32, torch.float32), (bf16, torch.bfloat16)):
            kv, valid = context_window(attn.context_kv(ctx.to(dtype), ctx_pos), lens, 8)
            outs.append(attn(x.to(dtype), pos, kv, valid))
    y, y16 = outs
    assert y16.dtype == torch.bfloat16
    dy = (y16.float() - y).abs()
    assert dy.max() <= 0.2 * y.abs().mean() and dy.mean() <= 0.02 * y.abs().mean()


def test_bad_shapes_raise_config_error():
    with pytest.raises(ConfigError, match="num_heads 4 must be a multiple of o_groups 3"):
        DeepseekDSparkAttention(64, 4, 16, 32, 8, 3, 16, rope_theta=THETA, rms_norm_eps=EPS, q_norm=False)
    with pytest.raises(ConfigError, match="rope_head_dim 7 must be even"):
        DeepseekDSparkAttention(64, 4, 16, 32, 7, 2, 16, rope_theta=THETA, rms_norm_eps=EPS, q_norm=False)


def test_the_fused_attention_is_taken_only_where_its_shapes_fit():
    """`fused_attention` asks for the one-launch kernel (kernels.step.sink_attention); a head whose
    width or rope slice is not a multiple of its 64-channel chunks keeps the torch path."""
    kw = dict(rope_theta=THETA, rms_norm_eps=EPS, q_norm=False, fused_attention=True)
    assert DeepseekDSparkAttention(64, 4, 16, 128, 64, 2, 16, **kw).fused_attention
    assert not DeepseekDSparkAttention(64, 4, 16, 32, 8, 2, 16, **kw).fused_attention
    assert not DeepseekDSparkAttention(64, 4, 16, 128, 64, 2, 16, **{**kw, "fused_attention": False}).fused_attention
