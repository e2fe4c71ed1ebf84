"""The commit on the GPU program (issue 33): the context commit replayed from its CUDA graph leaves
the pool bit for bit as the same `write_context` run eagerly on the same padded shapes, for a
DFlash draft's K/V pool and a DeepSeek V4.1 DSpark draft's ring (past its window), with no host
sync inside a replay; a commit staged and written by the next step's graph leaves the pool and
the drafts bit for bit as the eager commit and step on that step's padded shapes; and an
embedded DraftRuntime's whole iteration (propose with the engine's counts, then commit, a release
and a second commit in between) under graphs never synchronizes the host and keeps every length."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epdraft.bench.step import RandomHeads
from epdraft.models import load_draft
from epdraft.dispatch import StepPlan
from epdraft.runtime.graphs import CommitGraphs, StepGraphs, bucket_for
from tests.gpu.test_draft_step import _draft
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


@torch.no_grad()
@pytest.mark.parametrize("family", ["dflash", "dspark_v4"])
def test_commit_riding_in_the_step_graph_equals_eager(family, tmp_path):
    """Each step: a commit of the first m_c requests staged, then the step over the first m_s
    (m_c <= the step's bucket: the same, fewer -- a request joining -- or more within the bucket),
    replayed as one graph; eager: write_context and step on the step bucket's padded shapes."""
    draft = _draft()[1] if family == "dflash" else _deepseek_draft(tmp_path)
    spec, R, B, n = draft.spec, draft.num_drafts + 1, draft.block_size, 4
    heads = RandomHeads(spec.vocab_size, spec.hidden_size, dtype=torch.bfloat16, device=torch.device("cuda"))
    width = spec.num_target_features * spec.hidden_size
    buckets = (1, 2, 4)
    eager, graphed = (draft.new_pool(max_requests=n, max_context=30 * R + 64) for _ in range(2))
    gen = torch.Generator(device="cuda").manual_seed(5)
    prompts = [torch.randn(r, width, generator=gen, device="cuda").bfloat16() for r in (3, 11, 40, 7)]
    for pool in (eager, graphed):
        for rid in range(n):
            pool.admit(rid)
        draft.extend(pool, list(range(n)), prompts)
    commits = CommitGraphs(lambda s, c, f: draft.write_context(graphed, s, c, f), pad_slot=graphed.pad_slot,
                           buckets=buckets, rows_per_request=R, width=width, dtype=graphed.dtype,
                           device=torch.device("cuda"))  # fmt: skip
    steps = StepGraphs(lambda s, a, plan, readout: draft.step(graphed, s, a, heads, plan, readout=readout),
                       pad_slot=graphed.pad_slot, buckets=buckets, block_size=B, device=torch.device("cuda"),
                       commits=commits)  # fmt: skip
    shapes = [(4, 4), (3, 4), (2, 1), (2, 2), (1, 2), (4, 3), (3, 3)]  # (m_c, m_s)
    mismatches = 0
    for step in range(3 * len(shapes)):
        m_c, m_s = shapes[step % len(shapes)]
        b = bucket_for(buckets, m_s)
        counts = [1 + (step * 5 + 3 * i) % R for i in range(m_c)]
        rows = torch.randn(sum(counts), width, generator=gen, device="cuda").bfloat16()
        anchors = torch.randint(0, spec.vocab_size - 1, (m_s,), generator=gen, device="cuda")
        plan = StepPlan(step=step, ranks=(0,), counts=(m_s * B,))
        slots = [graphed.slot(r) for r in range(n)]
        anchor_list = anchors.tolist()
        commits.stage(counts, rows)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = steps.run(slots[:m_s], anchor_list, plan, commit=(slots[:m_c], counts))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        padded = torch.zeros(b * R, width, dtype=rows.dtype, device="cuda")
        padded[: rows.shape[0]] = rows
        pad = eager.pad_slot
        draft.write_context(eager, torch.tensor(slots[:m_c] + [pad] * (b - m_c), device="cuda"),
                            torch.tensor(counts + [0] * (b - m_c), device="cuda"), padded)  # fmt: skip
        want = draft.step(eager, torch.tensor(slots[:m_s] + [pad] * (b - m_s), device="cuda"),
                          torch.cat([anchors, anchors.new_zeros(b - m_s)]), heads, plan)  # fmt: skip
        mismatches += int(not torch.equal(got.drafts_NK, want.drafts_NK[:m_s]))
        mismatches += int(not torch.equal(got.finite_L, want.finite_L))
        if want.confidence_NK is not None:
            mismatches += int(not torch.equal(got.confidence_NK, want.confidence_NK[:m_s]))
        for rid, c in zip(range(m_c), counts):
            eager.book(rid, c)
            graphed.book(rid, c)
    assert mismatches == 0
    assert torch.equal(graphed.lengths, eager.lengths)
    assert graphed.lengths[:n].tolist() == [graphed.length(r) for r in range(n)]
    for got, want in zip(graphed.buffers, eager.buffers):
        assert torch.equal(got[:n], want[:n])


@torch.no_grad()
def test_triton_write_context_equals_the_torch_chain():
    """The commit's K/V launches (projections + `kv_norm_rope_store`) write what the torch chain
    writes (the CPU path), within one bf16 rounding."""
    from epdraft.layers.step_kernels import StepKernels

    draft = _draft()[1]
    assert draft.kernels.step_ops == "triton"
    spec, R = draft.spec, draft.num_drafts + 1
    width = spec.num_target_features * spec.hidden_size
    pools = [draft.new_pool(max_requests=4, max_context=200) for _ in range(2)]
    for pool in pools:
        for rid in range(3):
            pool.admit(rid)
    slots, counts = torch.tensor([0, 1, 2, 4], device="cuda"), torch.tensor([R, 1, 5, 0], device="cuda")
    rows = torch.randn(4 * R, width, device="cuda").bfloat16()
    draft.write_context(pools[0], slots, counts, rows)
    saved = [(m, m.kernels) for m in draft.modules() if hasattr(m, "kernels")]
    try:
        for m, _ in saved:
            m.kernels = StepKernels.reference()
        draft.write_context(pools[1], slots, counts, rows)
    finally:
        for m, kernels in saved:
            m.kernels = kernels
    assert torch.equal(pools[0].lengths, pools[1].lengths)
    for got, want in zip(pools[0].buffers, pools[1].buffers):
        torch.testing.assert_close(got[:3].float(), want[:3].float(), rtol=2**-7, atol=1e-2)


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
        expected = {}
        for rid in ids:
            runtime.add_request(rid, torch.randn(40 + rid, width, generator=gen, device="cuda").bfloat16())
            expected[rid] = 40 + rid

        def result_of(rids: list[int], step: int) -> VerifyResult:
            lens = [1 + (step + r) % B for r in rids]
            for r, n in zip(rids, lens):
                expected[r] += n
            return VerifyResult(
                request_ids=tuple(rids), accept_lens=torch.tensor(lens) - 1, bonus=torch.ones(len(rids), dtype=torch.long),
                commit_lens=torch.tensor(lens), committed_ids=torch.zeros(sum(lens), dtype=torch.long),
                features=torch.randn(sum(lens), width, generator=gen, device="cuda").bfloat16(),
            )  # fmt: skip

        for step in range(20):
            if step == 8:  # request 6 joins beside the staged commit; 4 finishes (its staged rows are
                # written first) and 5 takes its slot
                runtime.add_request(6, torch.randn(23, width, generator=gen, device="cuda").bfloat16())
                runtime.release(4)
                runtime.add_request(5, torch.randn(9, width, generator=gen, device="cuda").bfloat16())
                del expected[4]
                expected.update({5: 9, 6: 23})
                ids = [0, 1, 2, 3, 5, 6]
            anchors = {r: 7 * r + 1 for r in ids}
            result = result_of(ids, step)
            torch.cuda.set_sync_debug_mode("error")
            try:
                proposal = runtime.propose(step, anchors, counts=[len(ids) * B])
                runtime.commit(result)
                if step == 12:  # a second commit before the next propose: the first is written first
                    runtime.commit(result_of(ids[:2], step + 1))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert sorted(proposal.drafts) == sorted(ids)
        host = [runtime.pool.length(r) for r in ids]
        runtime.flush()  # the last commit is staged until the next propose
        torch.cuda.synchronize()
        return {"host": host, "device": runtime.pool.lengths[[runtime.pool.slot(r) for r in ids]].tolist(),
                "expected": [expected[r] for r in ids]}
    finally:
        runtime.close()


def test_embedded_iteration_under_graphs_never_syncs_the_host():
    lengths = run_ranks(1, _iteration_without_sync, timeout_s=300)[0]
    assert lengths["host"] == lengths["device"] == lengths["expected"]
