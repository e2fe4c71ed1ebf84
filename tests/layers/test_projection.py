"""Projections of one input held as one tensor (`share_storage`): joint after construction and
after loading (copies in place), split again by anything that replaces a weight tensor, and the
values each linear computes unchanged."""

from __future__ import annotations

import torch
from torch import nn

from epdraft.layers.mlp import DraftMLP
from epdraft.layers.projection import joint_weight, share_storage
from epdraft.models.attention import DFlashAttention


def _attention() -> DFlashAttention:
    return DFlashAttention(32, 4, 2, 8, rms_norm_eps=1e-6, rope_theta=10000.0, dtype=torch.float32, device="cpu")


def test_share_storage_keeps_each_linears_values_and_function():
    torch.manual_seed(0)
    linears = [nn.Linear(16, n, bias=False) for n in (8, 4, 4)]
    x = torch.randn(5, 16)
    before = [lin(x) for lin in linears]
    weights = [lin.weight.detach().clone() for lin in linears]
    share_storage(*linears)
    joint = joint_weight([lin.weight for lin in linears])
    assert joint is not None and joint.shape == (16, 16)
    assert torch.equal(joint, torch.cat(weights))
    for lin, w, y in zip(linears, weights, before):
        assert isinstance(lin.weight, nn.Parameter) and torch.equal(lin.weight, w) and torch.equal(lin(x), y)


def test_attention_and_mlp_hold_their_projections_joint_through_loading():
    attn = _attention()
    qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    assert joint_weight(qkv) is not None
    state = {k: torch.randn_like(v) for k, v in attn.state_dict().items()}
    attn.load_state_dict(state)  # copies into the views
    qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    assert torch.equal(joint_weight(qkv), torch.cat([state[f"{n}_proj.weight"] for n in "qkv"]))
    mlp = DraftMLP(32, 24, dtype=torch.float32, device="cpu")
    assert joint_weight([mlp.gate_proj.weight, mlp.up_proj.weight]) is not None
    assert joint_weight([mlp.gate_proj.weight, mlp.down_proj.weight]) is None  # not consecutive rows


def test_a_replaced_weight_splits_them():
    attn = _attention()
    attn.load_state_dict({k: v.clone() for k, v in attn.state_dict().items()}, assign=True)
    assert joint_weight([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is None
    attn = _attention().to(torch.float64)
    assert joint_weight([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is None
    assert joint_weight([attn.k_proj.weight, attn.q_proj.weight]) is None  # order matters


def test_adjacent_tensors_of_two_storages_are_not_joint():
    """Two tensors that merely sit end to end in memory (as the caching allocator may place two
    weights) are not one tensor's rows: a view across both would read past the first's storage."""
    memory = memoryview(bytearray(12 * 16 * 4))
    a = torch.frombuffer(memory[: 8 * 16 * 4], dtype=torch.float32).view(8, 16)
    b = torch.frombuffer(memory[8 * 16 * 4 :], dtype=torch.float32).view(4, 16)
    assert a.data_ptr() + a.numel() * 4 == b.data_ptr()  # adjacent, two storages
    assert joint_weight([a, b]) is None
    block = torch.zeros(12, 16)
    assert joint_weight([block[:8], block[8:]]) is not None
