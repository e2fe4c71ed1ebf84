"""The skinny projections' host side: the shared-memory clamp of a launch config, and the CPU
fallback of `epdraft.layers.projection` (the launches themselves: tests/gpu/test_step_ops.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from epdraft.config.ffn import ActivationSpec
from epdraft.errors import ConfigError
from epdraft.kernels.step import skinny
from epdraft.layers.activations import gated_act
from epdraft.layers.projection import gate_up, project
from epdraft.layers.step_kernels import StepKernels


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
    kernels = StepKernels.resolve("cpu", torch.float32)
    assert kernels.projections == "torch"
    assert skinny.unsupported_reason("cpu", torch.bfloat16).startswith("the Triton kernels run on CUDA")
    got_q, got_k = project(kernels, x, q, k)
    assert torch.equal(got_q, q(x)) and torch.equal(got_k, k(x))
    up = nn.Linear(64, 32, bias=False)
    act = ActivationSpec()
    assert torch.equal(gate_up(kernels, x, q, up, act), gated_act(q(x), up(x), act).to(x.dtype))


def test_skinny_fits_only_rows_it_beats_cublas_on():
    """The per-call rule left to the family: 1..MAX_ROWS rows with unit-stride weight rows of x's width."""
    w = torch.empty(32, 64)
    assert skinny.fits(torch.empty(skinny.MAX_ROWS, 64), [w])
    assert not skinny.fits(torch.empty(skinny.MAX_ROWS + 1, 64), [w])
    assert not skinny.fits(torch.empty(0, 64), [w])
    assert not skinny.fits(torch.empty(4, 64), [torch.empty(64, 32).t()])


@pytest.mark.parametrize("tiles,K,block_k,split", [
    (48, 4096, 128, 8),    # a 1536-wide gate/up pair at BLOCK_N 32: 384 programs on 132 SMs
    (72, 5120, 128, 4),    # 2304 wide: 8 would be 576 programs, past 3 a SM
    (128, 4096, 128, 1),   # an o projection: its tiles already give most SMs a program
    (192, 4096, 128, 1),   # q/k/v
    (48, 512, 128, 2),     # 4 K tiles: splits keep >= 2 tiles each
    (48, 128, 128, 1),     # one K tile: nothing to split
])  # fmt: skip
def test_choose_split_splits_only_launches_that_leave_sms_idle(tiles, K, block_k, split):
    assert skinny.choose_split(tiles, K, block_k, torch.device("cpu")) == split  # CPU: an H200's 132 SMs


def test_prefetch_bytes_stay_inside_every_split_and_need_16_byte_rows():
    w = torch.empty(64, 4096, dtype=torch.bfloat16)
    assert skinny._prefetch_bytes([w], 4096, 128, 1) == skinny._PREFETCH_BYTES
    assert skinny._prefetch_bytes([w], 4096, 128, 8) == skinny._PREFETCH_BYTES // 8
    # K = 300 in 64-wide tiles, 4 splits of 2 tiles: the last split's slice is empty
    assert skinny._prefetch_bytes([torch.empty(8, 304, dtype=torch.bfloat16)[:, :300]], 300, 64, 4) == 0
    # K = 1000 in 3 splits of 384: the last slice holds 232 elements = 464 bytes, read whole rows at most
    assert skinny._prefetch_bytes([torch.empty(8, 1000, dtype=torch.bfloat16)], 1000, 128, 3) == 464 // 16 * 16
    odd_rows = torch.empty(8, 1001, dtype=torch.bfloat16)[:, :1000]  # 2002-byte rows: not 16-byte aligned
    assert skinny._prefetch_bytes([odd_rows], 1000, 128, 1) == 0
    assert skinny._prefetch_bytes([w[:, 1:]], 4095, 128, 1) == 0  # base 2 bytes past an aligned one


def test_pdl_is_off_on_the_cpu_and_inside_pdl_off():
    from epdraft.kernels import launch

    assert launch.kwargs(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    with launch.pdl_off():
        assert not launch.pdl(torch.device("cuda", 0))  # decided before any CUDA query
    assert launch._enabled


def test_the_step_kernels_refuse_a_call_that_needs_gradients():
    """Their launches have no backward: asked for gradients they stop, naming the way to train."""
    from epdraft.errors import ConfigError
    from epdraft.kernels.step import ops

    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(ConfigError, match=r"rms_norm: the Triton step kernels have no backward.*StepKernels\.reference"):
        ops.rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(ConfigError, match=r"skinny projection: .*no backward"):
        skinny.linear(x, [torch.randn(4, 8)])
    from epdraft.kernels import launch

    with torch.no_grad():
        launch.refuse_autograd("rms_norm", x)  # inference on a leaf that wants gradients: nothing to drop
    launch.refuse_autograd("rms_norm", x.detach(), None)


@pytest.mark.parametrize(
    "name,kind", [("NVIDIA H200", "H200"), ("NVIDIA B200", "B200"), ("NVIDIA A100-SXM4-80GB", None)]
)
def test_each_gpu_kind_gets_the_tile_config_measured_on_it(monkeypatch, caplog, name, kind):
    """A config measured on one kind of GPU is not another's: a kind with its own runs it, a GPU
    none was measured on runs the H200's and says so."""
    monkeypatch.setitem(skinny.DEVICE_CONFIGS, "B200", (16, 256, 8, 3))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    skinny._device_config.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="epdraft.kernels.step.skinny"):
            config = skinny._device_config(torch.device("cuda", 0))
    finally:
        skinny._device_config.cache_clear()
    assert config == (skinny.DEVICE_CONFIGS[kind] if kind else skinny.DEFAULT_CONFIG)
    assert ("no tile config measured on " + name in caplog.text) == (kind is None)


def test_zeroed_counts_are_one_buffer_per_owner_made_once():
    """The arrival counts a split launch finds its last program by: made zeroed on first use and
    then the same buffer (its launches leave it zeroed), one per owner, never more than made."""
    from epdraft.kernels import launch

    cpu = torch.device("cpu")
    counts = launch.zeroed_counts("test owner", cpu, 8)
    assert counts.dtype == torch.int32 and counts.shape == (8,) and not counts.any()
    counts[3] = 1
    assert launch.zeroed_counts("test owner", cpu, 4) is counts
    assert not launch.zeroed_counts("another owner", cpu, 8).any()
    with pytest.raises(ConfigError, match="test owner: 9 arrival counts asked for, 8 made on cpu"):
        launch.zeroed_counts("test owner", cpu, 9)
