"""Transport tests on CPU loopback: both transports move the exact bytes, reuse their buffers, fail by name."""

from __future__ import annotations

import json
import sys

import msgspec
import pytest
import torch
import torch.distributed as dist

from epdraft.errors import ConfigError, ParallelError
from epdraft.worker.transfer import BufferSpec, StepPayload, make_transport, mooncake_unavailable_reason
from epdraft.worker.transfer.base import StepPayloadMeta
from tests.harness import run_ranks

MOONCAKE_MISSING = mooncake_unavailable_reason()
KINDS = [
    "torch",
    pytest.param(
        "mooncake",
        marks=pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=f"mooncake not importable: {MOONCAKE_MISSING}"),
    ),
]

DIM = 4096  # bf16: 8 KiB a row, so 8192 rows = 64 MiB
MAX_ROWS = 8192
SCHEDULE = [0, 1, 3, MAX_ROWS, 0, 64, 17, MAX_ROWS, 2, 0, 128, 1, 5, 0]


@pytest.fixture(autouse=True)
def _quiet_mooncake(monkeypatch):
    """Spawned ranks inherit this: Mooncake's glog then prints warnings and errors only."""
    monkeypatch.setenv("MC_LOG_LEVEL", "WARNING")


def _random_features(seed: int, rows: int, spec: BufferSpec) -> torch.Tensor:
    """Random bit patterns (NaN payloads included), so equality below is byte equality."""
    g = torch.Generator().manual_seed(seed)
    nbytes = rows * spec.feature_dim * spec.torch_dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(spec.torch_dtype).view(rows, spec.feature_dim)


def _payload(step: int, rows: int, spec: BufferSpec, direction: int) -> StepPayload:
    n = (step + direction) % (spec.max_requests + 1)
    return StepPayload(
        step=step,
        features_RD=_random_features(1000 * step + direction, rows, spec),
        accept_lens=[(step * 7 + i) % 5 for i in range(n)],
        bonus_tokens=[151_000 + step * 13 + i + direction for i in range(n)],
    )


def _assert_same(got: StepPayload, want: StepPayload) -> None:
    assert got.step == want.step
    assert got.accept_lens == want.accept_lens and got.bonus_tokens == want.bonus_tokens
    assert got.features_RD.shape == want.features_RD.shape and got.features_RD.dtype == want.features_RD.dtype
    assert torch.equal(got.features_RD.view(torch.uint8), want.features_RD.view(torch.uint8))


def _loopback(rank: int, world: int, kind: str, spec: BufferSpec, schedule: list[int]) -> int:
    """Rank 0 sends each step's rows to rank 1, which checks them and answers with a smaller payload.

    Odd steps send from `send_buffer` (no staging copy), even steps from a tensor of the caller's.
    """
    peer = 1 - rank
    t = make_transport(kind, dist.group.WORLD)
    try:
        t.register({peer: spec})
        addresses = t.buffer_addresses()
        send_buffer_ptr = t.send_buffer(peer).data_ptr()
        registered = list(getattr(t, "registered", []))
        for step, rows in enumerate(schedule):
            forward, reply = _payload(step, rows, spec, 0), _payload(step, rows % 7, spec, 1)
            if rank == 0:
                if step % 2:  # zero-copy path: rows written straight into the transport's send buffer
                    staged_RD = t.send_buffer(peer)[:rows]
                    staged_RD.copy_(forward.features_RD)
                    assert t.send_buffer(peer).data_ptr() == send_buffer_ptr
                    t.send(peer, msgspec.structs.replace(forward, features_RD=staged_RD))
                else:
                    t.send(peer, forward)
                got, want = t.recv(peer), reply
            else:
                got, want = t.recv(peer), forward
                _assert_same(got, want)
                t.send(peer, reply)
            _assert_same(got, want)
            if want.features_RD.shape[0]:
                assert got.features_RD.data_ptr() == addresses[0], "received rows must land in the registered buffer"
            assert t.buffer_addresses() == addresses, f"step {step}: buffers were reallocated"
            assert list(getattr(t, "registered", [])) == registered, f"step {step}: memory registered again"
        if kind == "mooncake":
            assert len(registered) == 2, registered  # one receive and one staging buffer, registered once
        with pytest.raises(ParallelError, match="called twice"):
            t.register({peer: spec})
    finally:
        t.close()
    return len(schedule)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", KINDS)
def test_loopback_bytes_identical_0_rows_to_64_mib(kind):
    spec = BufferSpec(max_rows=MAX_ROWS, feature_dim=DIM, max_requests=6, dtype="bfloat16")
    assert spec.max_feature_bytes == 64 << 20
    assert run_ranks(2, _loopback, kind, spec, SCHEDULE, timeout_s=360) == [len(SCHEDULE)] * 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_loopback_float32_many_small_steps(kind):
    spec = BufferSpec(max_rows=9, feature_dim=33, max_requests=3, dtype="float32")
    schedule = [(3 * s) % 10 for s in range(60)]
    assert run_ranks(2, _loopback, kind, spec, schedule, timeout_s=100) == [60, 60]


def _one_way(rank: int, world: int, kind: str, spec: BufferSpec, schedule: list[int]) -> dict:
    """Rank 0 only sends (a target), rank 1 only receives (its draft): each keeps one buffer, and
    the way not registered is refused by name."""
    peer, direction = 1 - rank, ("send", "recv")[rank]
    t = make_transport(kind, dist.group.WORLD)
    out = {}
    try:
        t.register({peer: spec}, direction)
        out["buffers"] = len(t.buffer_addresses())
        out["registered"] = len(getattr(t, "registered", []))
        for step, rows in enumerate(schedule):
            payload = _payload(step, rows, spec, 0)
            if rank == 0:
                staged_RD = t.send_buffer(peer)[:rows]
                staged_RD.copy_(payload.features_RD)
                t.send(peer, msgspec.structs.replace(payload, features_RD=staged_RD))
            else:
                got = t.recv(peer)
                _assert_same(got, payload)
                if rows:
                    assert got.features_RD.data_ptr() == t.buffer_addresses()[0]
        wrong_way = (lambda: t.recv(peer)) if rank == 0 else (lambda: t.send(peer, _payload(0, 1, spec, 0)))
        with pytest.raises(ParallelError) as err:
            wrong_way()
        out["wrong way"] = str(err.value)
    finally:
        t.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_one_way_pair_keeps_one_buffer_a_side_and_refuses_the_other_way(kind):
    spec = BufferSpec(max_rows=64, feature_dim=24, max_requests=3, dtype="bfloat16")
    sender, receiver = run_ranks(2, _one_way, kind, spec, [5, 0, 64, 1, 33], timeout_s=100)
    assert receiver["buffers"] == 1  # its receive buffer, and no staging buffer
    # Mooncake's sender registers its staging buffer; torch's needs none at register (isend reads in place)
    assert sender["buffers"] == (1 if kind == "mooncake" else 0)
    if kind == "mooncake":
        assert sender["registered"] == receiver["registered"] == 1
    assert sender["wrong way"] == "rank 0 registered to send features with rank 1 only; it cannot receive them"
    assert receiver["wrong way"] == "rank 1 registered to receive features with rank 0 only; it cannot send them"


def _bad_direction(rank: int, world: int, kind: str) -> tuple[str, int]:
    """A direction that is not one is refused before anything is allocated or sent."""
    t = make_transport(kind, dist.group.WORLD)
    try:
        with pytest.raises(ConfigError) as err:
            t.register({1 - rank: BufferSpec(max_rows=4, feature_dim=8, max_requests=2)}, "recieve")
        return str(err.value), len(getattr(t, "registered", []))
    finally:
        t.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_register_refuses_an_unknown_direction_before_any_buffer(kind):
    for rank, (message, registered) in enumerate(run_ranks(2, _bad_direction, kind, timeout_s=100)):
        assert message == f"rank {rank}: transfer direction 'recieve' must be one of ['both', 'recv', 'send']"
        assert registered == 0


def _both_send(rank: int, world: int, kind: str) -> str:
    """Both ranks register to send only: neither would receive, so both refuse at register, naming the other."""
    t = make_transport(kind, dist.group.WORLD)
    try:
        with pytest.raises(ParallelError) as err:
            t.register({1 - rank: BufferSpec(max_rows=4, feature_dim=8, max_requests=2)}, "send")
        return str(err.value)
    finally:
        t.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_register_direction_mismatch_names_peer(kind):
    for rank, message in enumerate(run_ranks(2, _both_send, kind, timeout_s=100)):
        assert message == (f"rank {rank} registered direction 'send' with rank {1 - rank}, which registered 'send' "
                           "(one side sends and the other receives, or both do both)")  # fmt: skip


def _misuse(rank: int, world: int, kind: str) -> str:
    """Rank 1 registers a different spec: both ranks must refuse, naming the other."""
    t = make_transport(kind, dist.group.WORLD)
    try:
        with pytest.raises(ParallelError, match=f"for rank {1 - rank}") as err:
            t.register({1 - rank: BufferSpec(max_rows=4 + rank, feature_dim=8, max_requests=2)})
        return str(err.value)
    finally:
        t.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_register_spec_mismatch_names_peer(kind):
    messages = run_ranks(2, _misuse, kind, timeout_s=100)
    assert "max_rows=4" in messages[0] and "max_rows=5" in messages[0]


def _oversized_and_lost_peer(rank: int, world: int, kind: str) -> str:
    """A payload over max_rows is refused before any traffic; a peer that leaves fails recv naming it."""
    spec = BufferSpec(max_rows=4, feature_dim=8, max_requests=2)
    t = make_transport(kind, dist.group.WORLD)
    try:
        t.register({1 - rank: spec})
        if rank == 1:
            return "left"
        rows_5 = torch.zeros(5, 8, dtype=torch.bfloat16)
        too_big = StepPayload(step=3, features_RD=rows_5, accept_lens=[], bonus_tokens=[])
        with pytest.raises(ParallelError, match="5 rows exceed max_rows = 4"):
            t.send(1, too_big)
        with pytest.raises(ParallelError, match="not a registered transfer peer"):
            t.recv(0)
        with pytest.raises(ParallelError, match="rank 1") as err:
            t.recv(1)
        return str(err.value)
    finally:
        t.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_oversized_payload_and_lost_peer_raise_naming_rank(kind):
    results = run_ranks(2, _oversized_and_lost_peer, kind, timeout_s=100, pg_timeout_s=30)
    assert results[1] == "left" and "from rank 1" in results[0]


def test_buffer_spec_validates_at_the_edge():
    with pytest.raises(ConfigError, match="max_rows = -1"):
        BufferSpec(max_rows=-1, feature_dim=8, max_requests=1)
    with pytest.raises(ConfigError, match="dtype = 'int3'"):
        BufferSpec(max_rows=1, feature_dim=8, max_requests=1, dtype="int3")
    with pytest.raises(ConfigError, match="transfer = 'nccl'"):
        make_transport("nccl", None)


def test_meta_frame_holds_the_largest_metadata():
    spec = BufferSpec(max_rows=1 << 20, feature_dim=1 << 20, max_requests=257, dtype="float8_e4m3fn")
    big = 2**63 - 1
    meta = StepPayloadMeta(
        step=big, num_rows=big, feature_dim=big, dtype=spec.dtype, accept_lens=[big] * 257, bonus_tokens=[-big] * 257
    )
    assert len(msgspec.msgpack.encode(meta)) + 4 <= spec.meta_frame_bytes


def test_mooncake_missing_is_a_config_error_saying_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(ConfigError, match=r"pip install 'epdraft\[mooncake\]'"):
        make_transport("mooncake", None)


@pytest.mark.timeout(200)
def test_bench_transfer_reports_every_transport_and_size(tmp_path, capsys):
    import argparse

    from epdraft.bench import transfer

    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    kinds = "torch" if MOONCAKE_MISSING else "torch,mooncake"
    out = tmp_path / "transfer.json"
    args = parser.parse_args(["--transports", kinds, "--sizes", "0x64,3x64,64KiB", "--iters", "3", "--json", str(out)])
    assert transfer.main(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["transport"], r["payload"]) for r in rows] == [
        (k, p) for k in kinds.split(",") for p in ("0x64", "3x64", "64KiB")
    ]
    assert [r["bytes"] for r in rows[:3]] == [0, 3 * 64 * 2, 64 << 10]
    assert all(r["median_us"] > 0 for r in rows)
    assert "median" in capsys.readouterr().out


def test_a_peer_gone_before_the_post_is_named(monkeypatch):
    """gloo refuses the irecv / isend itself when the peer already closed (not only its wait): that
    race, which a 2-rank test hit under load, must still be a ParallelError naming the peer."""
    from epdraft.worker.transfer.control import ControlChannel

    def closed(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:63210")

    monkeypatch.setattr(dist, "irecv", closed)
    monkeypatch.setattr(dist, "isend", closed)
    channel = ControlChannel(None, torch.device("cpu"), use_tags=False)
    with pytest.raises(ParallelError, match="control message from rank 1 failed: .*Connection closed by peer"):
        channel.recv(1, StepPayloadMeta, 64)
    with pytest.raises(ParallelError, match="control message to rank 1 failed"):
        channel.post(1, StepPayloadMeta(step=0, num_rows=0, feature_dim=8, dtype="bfloat16", accept_lens=[], bonus_tokens=[]), 64)


class _Probe:
    """A datagram socket whose route to each destination is the test's (`routes`: address, or an OSError)."""

    routes: dict = {}

    def __init__(self, *args):
        self.destination = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def connect(self, address):
        route = self.routes[address[0]]
        if isinstance(route, OSError):
            raise route
        self.destination = address[0]

    def getsockname(self):
        return (self.routes[self.destination], 0)


@pytest.mark.parametrize("routes,expected", [
    ({"10.0.0.5": "10.0.0.7"}, "10.0.0.7"),  # this host's address on its route to the master
    # the master's own host, its name resolving to 127.0.1.1 there: the default route's address
    ({"node0": "127.0.0.1", "10.255.255.255": "10.0.0.5"}, "10.0.0.5"),
    ({"node0": OSError("unreachable"), "10.255.255.255": "127.0.0.1"}, None),
])  # fmt: skip
def test_the_mooncake_endpoint_is_an_address_other_hosts_can_dial(monkeypatch, routes, expected):
    """Not the hostname's address (stock Debian / Ubuntu map it to 127.0.1.1): the peers on the
    other host would dial their own loopback at step 0."""
    from epdraft.errors import ConfigError
    from epdraft.worker import disagg_job

    monkeypatch.setattr(_Probe, "routes", routes)
    monkeypatch.setattr(disagg_job.socket, "socket", _Probe)
    master = next(iter(routes))
    assert disagg_job.this_host("127.0.0.1") == "127.0.0.1"
    if expected is not None:
        assert disagg_job.this_host(master) == expected
        return
    with pytest.raises(ConfigError, match=r"--master-addr node0: no address of this host that paired ranks on other "
                                          r"hosts can dial \(routes to node0: unreachable; to 10.255.255.255: "
                                          r"loopback 127.0.0.1\)"):  # fmt: skip
        disagg_job.this_host(master)
