"""`bench step`'s floor for a DeepSeek DSpark draft: the context it reads is the window's one K=V row
per position and layer, so the floor stops growing with context once the window is full; counted
here by hand from the V4.1-Flash preset's shapes (meta tensors: no weights are allocated)."""

from __future__ import annotations

import pytest
import torch

from epdraft.bench.ceilings import memory_bytes_per_s
from epdraft.bench.step import DSPARK_PRESETS, RandomHeads, floor_seconds
from epdraft.models.deepseek_dspark import DeepseekDSparkDraft
from epdraft.models.spec import DraftModelSpec


RATE = 3.0e12


def test_v41_flash_floor_reads_the_window_only():
    config = DSPARK_PRESETS["v41-flash"]
    spec = DraftModelSpec.from_config(config)
    draft = DeepseekDSparkDraft(spec, dtype=torch.bfloat16, device="meta")
    heads = RandomHeads(spec.vocab_size, spec.hidden_size, dtype=torch.bfloat16, device=torch.device("meta"))
    H, L, D, B, W = 4096, 3, 512, 5, 128
    assert (spec.hidden_size, spec.num_layers, spec.head_dim, spec.block_size, draft.window) == (H, L, D, B, W)
    _, short, _ = floor_seconds(draft, heads, 8, 100, RATE)
    _, full, _ = floor_seconds(draft, heads, 8, 1024, RATE)
    _, longer, _ = floor_seconds(draft, heads, 8, 8192, RATE)
    assert full == longer  # nothing past the window is read
    assert full - short == L * 8 * (W - 100) * D * 2  # bf16 K=V rows, once (K = V)
    # N = 1: 5 rows x top-3 touch E (1 - (1 - 1/E)^15) of the 128 experts (3 x H x 2304 bf16 each)
    touched = 128 * (1 - (1 - 1 / 128) ** 15)
    experts = L * touched * 3 * H * 2304 * 2
    non_expert = sum(p.numel() * p.element_size() for n, p in draft.named_parameters()
                     if ".experts." not in n and not n.startswith("main_proj."))  # fmt: skip
    lm_head = spec.vocab_size * H * 2
    floor_s, nbytes, _ = floor_seconds(draft, heads, 1, 1024, RATE)
    assert abs(nbytes - (experts + non_expert + lm_head + L * (W + B) * D * 2)) <= 1  # the window read, the block written
    assert abs(floor_s - nbytes / RATE) < 1e-9  # bytes, not FLOPs, bound one request


def test_each_kind_of_gpu_gets_its_own_measured_copy_rate():
    assert memory_bytes_per_s("NVIDIA H100 80GB HBM3") == (3.0e12, "H100 copy 3.0 TB/s")
    assert memory_bytes_per_s("NVIDIA H200")[0] == 4.3e12
    rate, label = memory_bytes_per_s("NVIDIA A100-SXM4-80GB")
    assert rate == 4.3e12 and label.startswith("no measurement for NVIDIA A100")


@torch.no_grad()
def test_touched_experts_counts_what_the_routers_picked():
    """A bias that makes every token pick experts 0 and 1 (top-2 of 4): each layer touched 2, and the
    floor counts 2 experts a layer, not the ~4 uniform routing would expect at this many rows."""
    from epdraft.bench.step import touched_experts
    from tests.models.test_deepseek_dspark import make_draft

    draft = make_draft()
    heads = RandomHeads(draft.spec.vocab_size, draft.spec.hidden_size, dtype=torch.float32, device=torch.device("cpu"))
    for layer in draft.layers:
        layer.mlp.router.weight.zero_()
        layer.mlp.router.bias.copy_(torch.tensor([9.0, 8.0, 0, 0]))
    pool = draft.new_pool(max_requests=4, max_context=32)
    for rid in range(4):
        pool.admit(rid)
    slots, anchors = torch.arange(4), torch.tensor([3, 5, 7, 9])
    touched = touched_experts(draft, lambda: draft.step(pool, slots, anchors, heads, None))
    assert touched == [2] * len(draft.layers)
    uniform = floor_seconds(draft, heads, 4, 8, RATE)[1]
    counted = floor_seconds(draft, heads, 4, 8, RATE, touched)[1]
    per_expert = sum(t[0].numel() * 4 for t in (draft.layers[0].mlp.experts.w13, draft.layers[0].mlp.experts.w2))
    expected = 4 * (1 - (1 - 1 / 4) ** (4 * 5 * 2))
    assert abs((uniform - counted) - len(draft.layers) * (expected - 2) * per_expert) <= 2


def test_op_floor_sums_each_ops_own_bound():
    """Kernels that run one after another cannot hide a FLOP-bound op under a byte-bound one: 3 GB
    of reads (1 ms at 3 TB/s) then 0.79 TFLOP (1 ms at the measured 790 TFLOP/s) take 2 ms, where
    the whole's max(bytes, FLOPs) says 1."""
    from epdraft.bench.step import TENSOR_FLOPS, op_floor_seconds

    assert TENSOR_FLOPS == 790e12
    assert op_floor_seconds([(3e9, 0.0), (0.0, 7.9e11)], RATE) == pytest.approx(2e-3)
    assert op_floor_seconds([(3e9, 7.9e11)], RATE) == pytest.approx(1e-3)


def test_step_costs_count_the_lm_head_as_one_flop_bound_op_at_many_rows():
    """V4.1-Flash's step at N = 128 (block 5: 4 drafting rows each, 512 rows the lm_head reads out):
    its lm_head reads 129280 x 4096 bf16 (0.35 ms at 3 TB/s) but multiplies it by 512 rows (0.69 ms
    at 790 TFLOP/s), so the op floor exceeds the floor."""
    from epdraft.bench.step import TENSOR_FLOPS, op_floor_seconds, step_costs

    spec = DraftModelSpec.from_config(DSPARK_PRESETS["v41-flash"])
    draft = DeepseekDSparkDraft(spec, dtype=torch.bfloat16, device="meta")
    heads = RandomHeads(spec.vocab_size, spec.hidden_size, dtype=torch.bfloat16, device=torch.device("meta"))
    costs = step_costs(draft, heads, 128, 1024)
    V, H, rows = 129280, 4096, 128 * 4  # the anchor row drafts nothing: not read out
    assert (V * H * 2, 2.0 * rows * V * H) in costs
    floor_s, nbytes, flops = floor_seconds(draft, heads, 128, 1024, RATE)
    assert sum(b for b, _ in costs) == pytest.approx(nbytes, abs=1)
    assert op_floor_seconds(costs, RATE) > floor_s + (2.0 * rows * V * H / TENSOR_FLOPS - V * H * 2 / RATE) * 0.99
