"""The fused experts' tuner: its candidates fit the chip, its search order, its random routing (CPU only)."""

from __future__ import annotations

import torch

from epdraft.bench import tune
from epdraft.cli import main
from epdraft.kernels.experts.tables import UpConfig


def test_block_m_candidates():
    assert tune.block_m_candidates(16, 1, 8) == [16]
    assert tune.block_m_candidates(128, 1, 8) == [16, 32]
    assert tune.block_m_candidates(2048, 10, 512) == [32, 64]
    assert tune.block_m_candidates(2048, 2, 8) == [64, 128]


def test_candidates_fit_shared_memory():
    for block_m in (16, 32, 64, 128):
        for c in tune.up_candidates(block_m, 128, 8, 4096):
            assert c.num_stages * (block_m + 2 * c.block_n) * c.block_k * 2 <= 200 * 1024
        for c in tune.down_candidates(block_m, 128, 8, 1536):
            assert c.num_stages * (block_m + c.block_n) * c.block_k * 2 <= 200 * 1024


def test_quantized_candidates_fit_at_their_stored_bytes():
    """MXFP4 / FP8 weight tiles are staged as stored: the tuner offers them tiles bf16 cannot fit
    (64 x 256 up, 128 x 256 down), each within shared memory at the format's bytes."""
    for weights, per_weight in (("fp8", 1.0), ("mxfp4", 17 / 32)):
        ups = tune.up_candidates(16, 48, 128, 4096, weights)
        downs = tune.down_candidates(16, 48, 128, 2304, weights)
        for c in ups:
            assert c.num_stages * (16 * c.block_k * 2 + 2 * c.block_n * c.block_k * per_weight) <= 200 * 1024
        for c in downs:
            assert c.num_stages * (16 * c.block_k * 2 + c.block_n * c.block_k * per_weight) <= 200 * 1024
        assert {(c.block_n, c.block_k) for c in ups} - {(c.block_n, c.block_k) for c in tune.up_candidates(16, 48, 128, 4096)}
        assert (64, 256) in {(c.block_n, c.block_k) for c in ups}
        assert (128, 256) in {(c.block_n, c.block_k) for c in downs}
    assert (64, 256) not in {(c.block_n, c.block_k) for c in tune.up_candidates(16, 48, 128, 4096)}


def test_split_k_candidates():
    """Split-K only for short GEMMs (<= 64 rows per expert), and never more splits than K tiles."""
    short = tune.down_candidates(16, 128, 8, 512)
    assert {c.split_k for c in short} == {1, 2, 4}
    assert all(c.split_k * c.block_k <= 512 for c in short)
    assert {c.split_k for c in tune.up_candidates(64, 4096, 8, 4096)} == {1}


def test_best_order_tries_program_orders_then_tma_on_the_best():
    """The tuner's last step: group_m from the tiles' own config, then TMA weight copies on the fastest of those."""
    base = UpConfig(block_n=64, block_k=128)
    times = {(0, False): 10.0, (1, False): 9.0, (4, False): 9.5, (1, True): 8.0, (0, True): 7.0}
    timed = []

    def time_us(c):
        timed.append((c.group_m, c.weight_tma))
        return times[(c.group_m, c.weight_tma)]

    best, us = tune._best_order(base, time_us, 10.0)
    assert timed == [(1, False), (4, False), (1, True)]
    assert (best.group_m, best.weight_tma, us) == (1, True, 8.0)


def test_uniform_routing_draws_distinct_experts_evenly():
    gen = torch.Generator().manual_seed(0)
    ids, weights = tune.random_routing(100_000, 8, 2, torch.device("cpu"), gen)
    assert ids.shape == weights.shape == (100_000, 2)
    assert bool((ids[:, 0] != ids[:, 1]).all())
    share = torch.bincount(ids.view(-1), minlength=8) / ids.numel()
    assert torch.allclose(share, torch.full((8,), 1 / 8), atol=0.005)
    assert torch.allclose(weights.sum(-1), torch.ones(100_000))


def test_skewed_routing_follows_the_popularity_ratio():
    """skew^rank popularity over a random expert order: a token's one expert is drawn in proportion to
    it exactly (Gumbel max), so the sorted shares are 8 / 4 / 2 / 1 of 15 at skew 0.5 over 4 experts."""
    gen = torch.Generator().manual_seed(1)
    ids, _ = tune.random_routing(200_000, 4, 1, torch.device("cpu"), gen, skew=0.5)
    share = torch.bincount(ids.view(-1), minlength=4).sort(descending=True).values / ids.numel()
    assert torch.allclose(share, torch.tensor([8, 4, 2, 1]) / 15, atol=0.005)
    ids, _ = tune.random_routing(10_000, 8, 3, torch.device("cpu"), gen, skew=0.75)
    assert all(len(set(row)) == 3 for row in ids.tolist())


def test_bench_kernel_refuses_a_skew_outside_0_to_1(capsys):
    for skew in ("0", "1.5", "-0.5"):
        assert main(["bench", "kernel", "--skew", skew]) == 2
        assert f"--skew {float(skew)}: the expert popularity ratio must be in (0, 1]" in capsys.readouterr().err
