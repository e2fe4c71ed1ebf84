"""The skinny projections' host side: the shared-memory clamp of a launch config, and the CPU
fallback of `epdraft.layers.projection` (the launches themselves: tests/gpu/test_step_ops.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from epdraft.config.ffn import ActivationSpec
from epdraft.kernels import skinny
from epdraft.layers.activations import gated_act
from epdraft.layers.projection import gate_up, project


@pytest.mark.parametrize("block_m,tiles", [(16, 1), (32, 2), (128, 1), (128, 2)])
def test_launch_config_fits_its_tiles_in_the_shared_memory_budget(block_m, tiles):
    block_n, block_k, warps, stages = skinny._launch_config((32, 512, 4, 5), block_m, tiles)
    assert (block_n, warps, stages) == (32, 4, 5)
    footprint = lambda k: (block_m + tiles * block_n) * k * 2 * stages  # noqa: E731
    assert footprint(block_k) <= skinny._SMEM_BYTES
    assert block_k == 512 or footprint(2 * block_k) > skinny._SMEM_BYTES  # halved no further than needed


def test_cpu_projections_are_the_linear_layers():
    torch.manual_seed(0)
    x = torch.randn(5, 64)
    q, k = nn.Linear(64, 32, bias=False), nn.Linear(64, 16, bias=False)
    assert not skinny.fits(x, [q.weight, k.weight])  # CPU: never the Triton launches
    got_q, got_k = project(x, q, k)
    assert torch.equal(got_q, q(x)) and torch.equal(got_k, k(x))
    up = nn.Linear(64, 32, bias=False)
    act = ActivationSpec()
    assert torch.equal(gate_up(x, q, up, act), gated_act(q(x), up(x), act).to(x.dtype))
