"""Mooncake transport on CUDA tensors: two engines (two processes on one GPU) on loopback, gloo control.

Rank 0 writes each step's rows from its registered CUDA staging buffer into rank 1's registered
CUDA receive buffer and rank 1 answers; every payload must arrive byte for byte (random bit
patterns, NaN payloads included), from 0 rows to 64 MiB, with buffers registered once.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from epdraft.worker.transfer import BufferSpec, StepPayload, make_transport, mooncake_unavailable_reason
from tests.harness import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        mooncake_unavailable_reason() is not None, reason=f"mooncake not importable: {mooncake_unavailable_reason()}"
    ),
]

DIM = 4096
MAX_ROWS = 8192  # bf16: 8192 x 4096 x 2 B = 64 MiB
SCHEDULE = [0, 320, MAX_ROWS, 1, 0, 64, MAX_ROWS, 17]  # 320 rows = one step's 64 rows x 5 layers of features


def _random_features(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    raw = torch.randint(0, 256, (rows * DIM * 2,), dtype=torch.uint8, generator=g, device="cuda")
    return raw.view(torch.bfloat16).view(rows, DIM)


def _cuda_loopback(rank: int, world: int, schedule: list[int]) -> list[int]:
    """Rank 0 sends, rank 1 checks on the GPU and echoes the first rows back; returns rows checked per step."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    torch.cuda.set_device(0)
    peer = 1 - rank
    spec = BufferSpec(max_rows=MAX_ROWS, feature_dim=DIM, max_requests=4, dtype="bfloat16")
    t = make_transport("mooncake", dist.group.WORLD, device="cuda", hostname="127.0.0.1")
    checked = []
    try:
        t.register({peer: spec})
        addresses = t.buffer_addresses()
        assert t.send_buffer(peer).is_cuda
        for step, rows in enumerate(schedule):
            want = _random_features(1000 * step, rows)
            echo_rows = min(rows, 5)
            if rank == 0:
                t.send(peer, StepPayload(step=step, features_RD=want, accept_lens=[step], bonus_tokens=[rows]))
                back = t.recv(peer)
                assert back.step == step and back.features_RD.is_cuda
                assert torch.equal(back.features_RD.view(torch.uint8), want[:echo_rows].view(torch.uint8))
            else:
                got = t.recv(peer)
                assert got.step == step and got.accept_lens == [step] and got.bonus_tokens == [rows]
                assert got.features_RD.is_cuda and got.features_RD.shape == (rows, DIM)
                assert torch.equal(got.features_RD.view(torch.uint8), want.view(torch.uint8)), f"step {step}"
                if rows:
                    assert got.features_RD.data_ptr() == addresses[0], "rows must land in the registered buffer"
                echo = t.send_buffer(peer)[:echo_rows]
                echo.copy_(got.features_RD[:echo_rows])
                t.send(peer, StepPayload(step=step, features_RD=echo, accept_lens=[], bonus_tokens=[]))
            assert t.buffer_addresses() == addresses, f"step {step}: buffers were reallocated"
            assert len(t.registered) == 2, f"step {step}: memory registered again"
            checked.append(rows)
    finally:
        t.close()
    return checked


@pytest.mark.timeout(240)
def test_cuda_tensors_bytes_identical_0_rows_to_64_mib():
    assert run_ranks(2, _cuda_loopback, SCHEDULE, timeout_s=200) == [SCHEDULE, SCHEDULE]
