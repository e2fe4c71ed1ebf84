"""Mooncake EP dispatcher (`alltoall` layout, `mooncake` backend) on a one-rank NCCL group, one GPU.

The same DraftMoE weights run twice on the same bf16 rows: replicated (the single-process
reference, no collective) and through Mooncake EP's dispatch -> experts -> combine. Mooncake's
fixed [e, R*T, H] receive buffer, its slot counts and its weighted combine are what is checked;
the tolerance is DESIGN.md's bf16 drift (max |dy| <= 0.2 mean|y|, mean |dy| <= 0.02 mean|y|).
More ranks need a multi-GPU machine.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from epdraft.config.ffn import DraftMoeFFNSpec, RouterSpec
from epdraft.dispatch import Dispatcher, MoeLayout, StepPlan, make_dispatcher
from epdraft.layers.moe import DraftMoE
from tests.harness import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None or importlib.util.find_spec("mooncake.mooncake_ep_buffer") is None,
        reason="mooncake EP (a CUDA build of mooncake-transfer-engine) is not installed",
    ),
]

HIDDEN = 256  # Mooncake EP needs H % 128 == 0
MAX_TOKENS = 64
ROUTERS = {
    "softmax_top2": RouterSpec(num_experts=8, top_k=2, scoring="softmax"),
    "sigmoid_grouped_top3": RouterSpec(
        num_experts=8, top_k=3, scoring="sigmoid", n_group=4, topk_group=2, bias="selection",
        routed_scaling_factor=2.5, renorm_eps=1e-20,
    ),
}  # fmt: skip
ROWS = [1, 7, MAX_TOKENS, 0, 33, 2]


@pytest.fixture(scope="module")
def one_rank_nccl():
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _random_moe(spec: DraftMoeFFNSpec, dispatcher: Dispatcher | None, seed: int) -> DraftMoE:
    moe = DraftMoE(spec, HIDDEN, dispatcher=dispatcher, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * p.shape[-1] ** -0.5)
    return moe


@pytest.mark.timeout(180)
@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_mooncake_ep_matches_single_process_draft_moe(one_rank_nccl, router):
    from epdraft.dispatch.mooncake import MooncakeDispatcher

    spec = DraftMoeFFNSpec(router=ROUTERS[router], intermediate_size=192, shared_intermediate_size=128)
    layout = MoeLayout(
        layout="alltoall", backend="mooncake", num_experts=spec.num_experts, hidden_size=HIDDEN, top_k=spec.top_k,
        max_rows_per_rank=MAX_TOKENS, device_type="cuda",
    )  # fmt: skip
    dispatcher = make_dispatcher(layout, one_rank_nccl)
    assert isinstance(dispatcher, MooncakeDispatcher)
    reference = _random_moe(spec, None, seed=7)
    moe = _random_moe(spec, dispatcher, seed=0)
    moe.load_state_dict(reference.state_dict())
    try:
        for step, rows in enumerate(ROWS):
            plan = StepPlan(step=step, ranks=(0,), counts=(rows,))
            gen = torch.Generator(device="cuda").manual_seed(100 + step)
            x = torch.randn(rows, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
            with torch.no_grad():
                y, ref = moe(x, plan), reference(x)
            assert y.shape == ref.shape == (rows, HIDDEN) and y.dtype == ref.dtype
            if not rows:
                continue
            assert torch.isfinite(y).all(), f"step {step}"
            dy = (y.float() - ref.float()).abs()
            scale = ref.float().abs().mean()
            assert dy.max() <= 0.2 * scale, f"step {step} ({rows} rows): max |dy| {dy.max():.4g} vs mean |y| {scale:.4g}"
            assert dy.mean() <= 0.02 * scale, f"step {step} ({rows} rows): mean |dy| {dy.mean():.4g} vs {scale:.4g}"
    finally:
        dispatcher.close()
