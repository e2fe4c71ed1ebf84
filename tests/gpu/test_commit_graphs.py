"""The commit on the GPU program (issue 33): the context commit replayed from its CUDA graph leaves
the pool bit for bit as the same `write_context` run eagerly on the same padded shapes, for a
DFlash draft's K/V pool and a DeepSeek V4.1 DSpark draft's ring (past its window), with no host
sync inside a replay; and an embedded DraftRuntime's whole iteration (propose with the engine's
counts, then commit) under graphs never synchronizes the host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epdraft.bench.step import RandomHeads
from epdraft.models import load_draft
from epdraft.runtime.graphs import CommitGraphs, bucket_for
from tests.gpu.test_draft_step import _draft, kernels_of
from tests.harness import run_ranks

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


def _deepseek_draft(tmp_path: Path):
    made = subprocess.run([sys.executable, str(REPO / "tools" / "make_deepseek_dspark_draft.py"), str(tmp_path / "draft"),
                           "--v41"], capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert made.returncode == 0, made.stderr
    return load_draft(tmp_path / "draft", dtype=torch.bfloat16, device="cuda").eval()


@torch.no_grad()
@pytest.mark.parametrize("family", ["dflash", "dspark_v4"])
def test_commit_graph_equals_eager_write_context_without_host_sync(family, tmp_path):
    draft = _draft()[1] if family == "dflash" else _deepseek_draft(tmp_path)
    spec, R, bucket, n = draft.spec, draft.num_drafts + 1, 4, 3
    width = spec.num_target_features * spec.hidden_size
    eager, graphed = (draft.new_pool(max_requests=bucket, max_context=40 * R + 64) for _ in range(2))
    gen = torch.Generator(device="cuda").manual_seed(3)
    prompts = [torch.randn(r, width, generator=gen, device="cuda").bfloat16() for r in (2, 9, 33)]
    for pool in (eager, graphed):
        for rid in range(n):
            pool.admit(rid)
        draft.extend(pool, list(range(n)), prompts)
    graphs = CommitGraphs(lambda s, c, f: draft.write_context(graphed, s, c, f), pad_slot=graphed.pad_slot,
                          buckets=(1, 2, 4), rows_per_request=R, width=width, dtype=graphed.dtype,
                          device=torch.device("cuda"))  # fmt: skip
    for step in range(40):  # 3, 1, 2, 3, ... requests: the buckets 4, 1, 2 share one static rows buffer
        m = 1 + (step + 2) % n
        slots = [graphed.slot(r) for r in range(m)]
        counts = [1 + (step * 7 + 3 * i) % R for i in range(m)]
        rows = torch.randn(sum(counts), width, generator=gen, device="cuda").bfloat16()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graphs.run(slots, counts, rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        b = bucket_for(graphs.buckets, m)  # the same padded shapes: the GEMMs' results depend on their rows
        padded = torch.zeros(b * R, width, dtype=rows.dtype, device="cuda")
        padded[: rows.shape[0]] = rows
        draft.write_context(eager, torch.tensor(slots + [eager.pad_slot] * (b - m), device="cuda"),
                            torch.tensor(counts + [0] * (b - m), device="cuda"), padded)  # fmt: skip
        for rid, c in zip(range(m), counts):
            eager.book(rid, c)
            graphed.book(rid, c)
    assert torch.equal(graphed.lengths, eager.lengths)
    assert graphed.lengths[:n].tolist() == [graphed.length(r) for r in range(n)]
    for got, want in zip(graphed.buffers, eager.buffers):
        assert torch.equal(got[:n], want[:n])


def _two_pools(draft):
    """Two empty pools with requests 0-2 admitted, the slots and counts of a commit to both (a full
    request, one row, five, and a padding slot with none), and the rows' feature width."""
    R = draft.num_drafts + 1
    pools = [draft.new_pool(max_requests=4, max_context=200) for _ in range(2)]
    for pool in pools:
        for rid in range(3):
            pool.admit(rid)
    slots, counts = torch.tensor([0, 1, 2, 4], device="cuda"), torch.tensor([R, 1, 5, 0], device="cuda")
    return pools, slots, counts, draft.spec.num_target_features * draft.spec.hidden_size


@torch.no_grad()
def test_triton_write_context_equals_the_torch_chain():
    """The commit's K/V launches (projections + `kv_norm_rope_store`) write what the torch chain
    writes (the CPU path), within one bf16 rounding."""
    from epdraft.layers.step_kernels import StepKernels

    draft = _draft()[1]
    assert draft.kernels.step_ops == "triton"
    pools, slots, counts, width = _two_pools(draft)
    rows = torch.randn(4 * (draft.num_drafts + 1), width, device="cuda").bfloat16()
    draft.write_context(pools[0], slots, counts, rows)
    with kernels_of(draft, StepKernels.reference()):
        draft.write_context(pools[1], slots, counts, rows)
    assert torch.equal(pools[0].lengths, pools[1].lengths)
    for got, want in zip(pools[0].buffers, pools[1].buffers):
        torch.testing.assert_close(got[:3].float(), want[:3].float(), rtol=2**-7, atol=1e-2)


@torch.no_grad()
def test_commit_with_odd_layers_on_the_side_stream_equals_it_in_line():
    """`kernels.side_stream`'s commit (odd layers' K/V forked onto `launch.Fork`'s second stream)
    writes the in-line commit's bits, with its rows written on the main stream behind a sleep (a
    fork that did not wait would read them stale) and the side stream held busy by a sleep before
    (without the join the odd layers' writes would still be pending when the next commit or the
    comparison reads the pool)."""
    import msgspec

    from epdraft.kernels.launch import Fork

    draft = _draft()[1]
    assert draft.kernels.side_stream and draft.kernels.step_ops == "triton" and len(draft.layers) > 1
    pools, slots, counts, width = _two_pools(draft)
    gen = torch.Generator(device="cuda").manual_seed(11)
    rows = [torch.randn(4 * (draft.num_drafts + 1), width, generator=gen, device="cuda").bfloat16() for _ in range(3)]
    static = torch.empty_like(rows[0])
    side = Fork(torch.device("cuda")).other
    for r in rows:
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)
        torch.cuda._sleep(2_000_000)
        static.copy_(r)
        draft.write_context(pools[0], slots, counts, static)
    with kernels_of(draft, msgspec.structs.replace(draft.kernels, side_stream=False)):
        for r in rows:
            draft.write_context(pools[1], slots, counts, r)
    assert torch.equal(pools[0].lengths, pools[1].lengths)
    for got, want in zip(pools[0].buffers, pools[1].buffers, strict=True):
        assert torch.equal(got[:3], want[:3])


def _iteration_without_sync(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from epdraft.config.parallel import parallel_config_from_dict
    from epdraft.parallel.groups import Groups
    from epdraft.runtime import DraftRuntime, MoeLayout
    from epdraft.target.base import VerifyResult

    from epdraft.models import read_draft_spec

    path = REPO / "epdraft" / "assets" / "tiny-draft"
    spec = read_draft_spec(path)
    heads = RandomHeads(spec.vocab_size, spec.hidden_size, dtype=torch.bfloat16, device=torch.device("cuda"))
    everyone = dist.new_group([0])
    groups = Groups.from_process_groups(moe=everyone, attn_dp=everyone, cpu=everyone, ep_size=1, tp_size=1)
    pc = parallel_config_from_dict({"cluster": {"nnodes": 1, "nproc_per_node": 1, "device": "cuda"},
                                    "draft": {"attn_dp": 1, "moe_layout": "replicated"}, "target": {"dp": 1}})  # fmt: skip
    runtime = DraftRuntime.build(path, heads, groups=groups, layout=MoeLayout.resolve(pc, spec.ffn, groups), spec=spec,
                                 max_requests=8, max_context=2048, device="cuda", graphs=True)  # fmt: skip
    try:
        runtime.warm_up()
        gen = torch.Generator(device="cuda").manual_seed(0)
        width, B = spec.num_target_features * spec.hidden_size, spec.block_size
        ids = list(range(5))
        for rid in ids:
            runtime.add_request(rid, torch.randn(40 + rid, width, generator=gen, device="cuda").bfloat16())
        anchors = {r: 7 * r + 1 for r in ids}
        for step in range(20):
            lens = [1 + (step + r) % B for r in ids]
            result = VerifyResult(
                request_ids=tuple(ids), accept_lens=torch.tensor(lens) - 1, bonus=torch.ones(len(ids), dtype=torch.long),
                commit_lens=torch.tensor(lens), committed_ids=torch.zeros(sum(lens), dtype=torch.long),
                features=torch.randn(sum(lens), width, generator=gen, device="cuda").bfloat16(),
            )  # fmt: skip
            torch.cuda.set_sync_debug_mode("error")
            try:
                proposal = runtime.propose(step, anchors, counts=[len(ids) * B])
                runtime.commit(result)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert sorted(proposal.drafts) == ids
        torch.cuda.synchronize()
        expected = [40 + r + sum(1 + (s + r) % B for s in range(20)) for r in ids]
        report = {"host": [runtime.pool.length(r) for r in ids], "device": runtime.pool.lengths[: len(ids)].tolist(),
                  "expected": expected}
        torch.cuda.set_sync_debug_mode("error")
        try:  # a finished request's slot goes back without waiting for the device (sampled: its params reset)
            runtime.release(ids[-1])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return report
    finally:
        runtime.close()


def test_embedded_iteration_under_graphs_never_syncs_the_host():
    lengths = run_ranks(1, _iteration_without_sync, timeout_s=300)[0]
    assert lengths["host"] == lengths["device"] == lengths["expected"]


def _captures_with_a_communicating_layout(rank: int, world: int) -> dict:
    """A 1-rank NCCL group with the `gather` layout (its MoE layers enter collectives; the step
    sync's CPU group gloo): whether a
    runtime that skipped warm_up refuses the step, which graphs warm_up captured, and whether a
    sampled and a filtered request then step without a capture of their own."""
    import torch.distributed as dist

    from epdraft.config.parallel import parallel_config_from_dict
    from epdraft.config.sampling import SamplingParams
    from epdraft.errors import EpdraftError
    from epdraft.models import read_draft_spec
    from epdraft.parallel.groups import Groups
    from epdraft.runtime import DraftRuntime, MoeLayout

    path = REPO / "epdraft" / "assets" / "tiny-draft"
    spec = read_draft_spec(path)
    heads = RandomHeads(spec.vocab_size, spec.hidden_size, dtype=torch.bfloat16, device=torch.device("cuda"))
    torch.cuda.set_device(0)
    nccl = dist.new_group([0], backend="nccl")
    groups = Groups.from_process_groups(moe=nccl, attn_dp=nccl, cpu=dist.new_group([0]), ep_size=1, tp_size=1)
    pc = parallel_config_from_dict({"cluster": {"nnodes": 1, "nproc_per_node": 1, "device": "cuda"},
                                    "draft": {"attn_dp": 1, "moe_layout": "gather"}, "target": {"dp": 1}})  # fmt: skip
    layout = MoeLayout.resolve(pc, spec.ffn, groups)

    def build():
        return DraftRuntime.build(path, heads, groups=groups, layout=layout, spec=spec, max_requests=4,
                                  max_context=512, device="cuda", graphs=True)  # fmt: skip

    width = spec.num_target_features * spec.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = {"layout": layout.layout}
    cold = build()
    try:
        cold.add_request(0, torch.randn(20, width, generator=gen, device="cuda").bfloat16())
        try:
            cold.propose(0, {0: 5}, counts=[spec.block_size])
            report["cold"] = "stepped"
        except EpdraftError as e:
            report["cold"] = str(e)
    finally:
        cold.close()
    runtime = build()
    try:
        runtime.warm_up()
        report["first_use"] = runtime.graphs.capture_on_first_use
        captured = sorted((b, r.value) for b, r in runtime.graphs._captured)
        report["captured"] = captured
        sampled = SamplingParams(temperature=0.7, seed=1)
        filtered = SamplingParams(temperature=0.7, top_k=20, seed=2)
        for rid, sampling in ((0, sampled), (1, filtered), (2, None)):
            runtime.add_request(rid, torch.randn(20, width, generator=gen, device="cuda").bfloat16(), sampling)
        proposal = runtime.propose(0, {0: 5, 1: 6, 2: 7}, counts=[3 * spec.block_size])
        report["drafts"] = sorted(proposal.drafts)
        report["captured_after"] = sorted((b, r.value) for b, r in runtime.graphs._captured)
    finally:
        runtime.close()
    return report


def test_a_communicating_layout_captures_every_readout_at_start_up():
    """Where the MoE layers communicate, a rank must not capture alone (its capture's eager run
    enters collectives its peers do not): warm_up captures every readout's step graph of every
    bucket, a step after it captures nothing, and a step without it is refused, not captured."""
    (report,) = run_ranks(1, _captures_with_a_communicating_layout, timeout_s=300)
    assert report["layout"] == "gather" and report["first_use"] is False
    assert "call DraftRuntime.warm_up on every rank before the first step" in report["cold"]
    buckets = sorted({b for b, _ in report["captured"]})
    assert report["captured"] == sorted((b, r) for b in buckets for r in ("argmax", "sample", "filtered"))
    assert report["captured_after"] == report["captured"] and report["drafts"] == [0, 1, 2]
