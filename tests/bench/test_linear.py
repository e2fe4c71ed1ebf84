"""`bench linear`'s pure parts on CPU: the linears read from the preset's layers, their bytes and floors,
the activation quantizer against a plain per-group loop, cuBLAS's scale layouts, and the errors it
raises before any GPU work (the timings themselves need CUDA)."""

from __future__ import annotations

import argparse

import pytest
import torch

from epdraft.bench import linear
from epdraft.bench.linear import (LinearShape, blockwise_weight_scale, draft_linears, floor_us, fp8_weight,
                                  quantize_activation_groups, select_linears, step_sums)  # fmt: skip
from epdraft.bench.step import DSPARK_PRESETS, preset_draft_config
from epdraft.errors import ConfigError
from epdraft.models.spec import DraftModelSpec


def v41_spec() -> DraftModelSpec:
    return DraftModelSpec.from_config(DSPARK_PRESETS["v41-flash"])


def test_v41_flash_linears_come_from_the_built_layers():
    shapes = {lin.name: (lin.out_features, lin.in_features, lin.groups, lin.per_step)
              for lin in draft_linears(v41_spec())}
    # H 4096, 64 heads of 512, q_lora 1280, 8 output groups of rank 1024, shared expert 2304, 3 target layers, 3 layers
    assert shapes == {
        "q_a_proj": (1280, 4096, 1, 3), "q_b_proj": (64 * 512, 1280, 1, 3), "kv_proj": (512, 4096, 1, 3),
        "o_a_proj": (1024, 64 * 512 // 8, 8, 3), "o_b_proj": (4096, 8 * 1024, 1, 3),
        "shared.w1": (2304, 4096, 1, 3), "shared.w3": (2304, 4096, 1, 3), "shared.w2": (4096, 2304, 1, 3),
        "main_proj": (4096, 3 * 4096, 1, 0),
    }  # fmt: skip


def test_bytes_and_floor_arithmetic():
    o_a = LinearShape(name="o_a_proj", out_features=1024, in_features=4096, groups=8, per_step=3)
    assert o_a.bf16_bytes == 2 * 8 * 1024 * 4096
    assert o_a.fp8_bytes == 8 * (1024 * 4096 + 4 * 8 * 32)  # e4m3 values + an fp32 scale per 128 x 128 block
    w2 = LinearShape(name="shared.w2", out_features=4096, in_features=2304, per_step=3)
    assert w2.fp8_bytes == 4096 * 2304 + 4 * 32 * 18
    assert floor_us(3_000_000, 3.0e12) == pytest.approx(1.0)


def test_step_sums_count_each_linear_per_layer():
    rows = [dict(T=5, per_step=3, bf16_us=2.0, fp8_us=1.0, floor_bf16_us=1.5, floor_fp8_us=0.75),
            dict(T=5, per_step=0, bf16_us=9.0, fp8_us=9.0, floor_bf16_us=9.0, floor_fp8_us=9.0),
            dict(T=40, per_step=3, bf16_us=4.0, fp8_us=3.0, floor_bf16_us=1.5, floor_fp8_us=0.75)]  # fmt: skip
    assert step_sums(rows) == {5: (6.0, 3.0, 4.5, 2.25), 40: (12.0, 9.0, 4.5, 2.25)}


def _reference_quantize(x: torch.Tensor, group: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One group at a time, in plain float arithmetic."""
    T, K = x.shape
    q = torch.empty(T, K, dtype=torch.float8_e4m3fn)
    s = torch.empty(T, K // group)
    for t in range(T):
        for g in range(K // group):
            chunk = x[t, g * group:(g + 1) * group].float()
            scale = max(chunk.abs().max().item(), 1e-4) / 448.0
            if ue8m0:
                scale = 2.0 ** torch.ceil(torch.log2(torch.tensor(scale))).item()
            s[t, g] = scale
            q[t, g * group:(g + 1) * group] = (chunk / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("group", [128, 256])
def test_activation_quantizer_equals_a_plain_loop(ue8m0, group):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 512, generator=gen) * torch.logspace(-3, 2, 512)).bfloat16()
    x[2, :128] = 0  # an all-zero group: the floored amax, zeros out
    q, s_GT = quantize_activation_groups(x, group, ue8m0)
    want_q, want_s = _reference_quantize(x, group, ue8m0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s_GT.t(), want_s)
    assert s_GT.t().stride() == (1, 5)  # outer-dim-major, as cuBLAS's BlockWise1x128 takes it
    deq = (q.float().view(5, -1, group) * s_GT.t().unsqueeze(-1)).view(5, 512)
    assert ((deq - x.float()).norm() / x.float().norm()).item() < 0.1


def test_blockwise_weight_scale_pads_to_four_and_is_k_major():
    s = torch.arange(32 * 18, dtype=torch.float32).view(32, 18)  # a 4096 x 2304 weight's blocks
    b = blockwise_weight_scale(s)
    assert b.shape == (20, 32) and b.stride() == (1, 20)
    assert torch.equal(b[:18], s.t()) and not b[18:].any()


def test_fp8_weight_holds_the_release_blocks_or_a_rowwise_requantization():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(2, 256, 384, generator=gen) / 20
    blockwise = fp8_weight(w, "blockwise")
    assert blockwise.dequantized.dtype == torch.bfloat16 and blockwise.dequantized.shape == w.shape
    assert len(blockwise.values) == 2 and blockwise.scale_b[0].shape == (4, 2)  # 3 K blocks padded to 4, 2 N blocks
    assert ((blockwise.dequantized.float() - w).norm() / w.norm()).item() < 0.05
    rowwise = fp8_weight(w, "rowwise")
    assert torch.equal(rowwise.dequantized, blockwise.dequantized)
    assert rowwise.scale_b[1].shape == (1, 256)
    again = rowwise.values[1].float() * rowwise.scale_b[1].t()
    assert ((again - rowwise.dequantized[1].float()).norm() / w[1].norm()).item() < 0.05


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    linear.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only error")
def test_without_cuda_a_clear_config_error():
    with pytest.raises(ConfigError, match="bench linear times GPU GEMMs .* needs CUDA"):
        linear.main(_args())


def test_unknown_linear_and_a_draft_without_fp8_linears_are_refused():
    with pytest.raises(ConfigError, match=r"--linears: unknown \['wq'\]; this draft's: \['q_a_proj'"):
        select_linears(v41_spec(), "q_a_proj,wq")
    with pytest.raises(ConfigError, match="expected a DeepSeek DSpark .* --preset v41-flash"):
        draft_linears(DraftModelSpec.from_config(preset_draft_config("issue13")))
    with pytest.raises(ConfigError, match="--rows '5,x'"):
        linear.main(_args(rows="5,x"))


def test_bench_lists_linear():
    from epdraft.bench import SUBCOMMANDS

    assert "linear" in SUBCOMMANDS
