"""DraftRuntime.propose given the engine's DP metadata (every rank's row counts, agreed for its
target forward): the draft step issues no collective but its MoE dispatch and combine, drafts the
same tokens as with the coordinator's sync, and refuses counts that contradict the rank or group.

The collectives are counted at the c10d operator level (a TorchDispatchMode sees every
`torch.ops.c10d.*` call of this thread, whichever torch.distributed function issued it), each
tagged by whether it was issued inside the dispatcher's dispatch / combine; the coordinator's
exchange (through the rendezvous store on CPU ranks) is counted at `coordinator.sync`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from epdraft.errors import ParallelError, RequestError, StepMismatch
from tests.harness import run_ranks

ASSETS = Path(__file__).resolve().parents[2] / "epdraft" / "assets"
PROMPTS = [[ord(c) for c in s] for s in ("def main(argv):\n    ", "import os\nimport sys\n", "class Error(Exception")]
NEW_TOKENS = 16


class _Collectives(TorchDispatchMode):
    """Records every c10d op as (name, issued inside the MoE dispatcher)."""

    def __init__(self, inside: list[bool]):
        super().__init__()
        self.inside = inside
        self.ops: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.ops.append((func.__name__, self.inside[0]))
        return func(*args, **(kwargs or {}))


def _tag_dispatcher(runtime, inside: list[bool]) -> None:
    from epdraft.layers.moe import DraftMoE

    for m in runtime.draft.modules():
        if isinstance(m, DraftMoE) and not hasattr(m.dispatcher, "_tagged"):
            d = m.dispatcher

            def tagged(fn):
                def call(*args, **kwargs):
                    inside[0] = True
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        inside[0] = False

                return call

            d.dispatch, d.combine, d._tagged = tagged(d.dispatch), tagged(d.combine), True


def _runtime(rank: int, world: int, layout: str, max_requests: int):
    from epdraft.config.parallel import parallel_config_from_dict
    from epdraft.models import read_draft_spec
    from epdraft.parallel.groups import Groups
    from epdraft.runtime import DraftRuntime, MoeLayout
    from epdraft.target.hf import HFTarget

    torch.manual_seed(0)
    spec = read_draft_spec(ASSETS / "tiny-draft")
    target = HFTarget.from_pretrained(ASSETS / "tiny-target", spec.target_layer_ids)
    everyone = dist.new_group(list(range(world)))
    groups = Groups.from_process_groups(moe=everyone, attn_dp=everyone, cpu=everyone, ep_size=world, tp_size=1)
    pc = parallel_config_from_dict({
        "cluster": {"nnodes": 1, "nproc_per_node": world, "device": "cpu"},
        "draft": {"attn_dp": world, "moe_layout": layout, "moe_ep": world},
        "target": {"dp": world},
    })  # fmt: skip
    runtime = DraftRuntime.build(
        ASSETS / "tiny-draft", target, groups=groups, layout=MoeLayout.resolve(pc, spec.ffn, groups), spec=spec,
        max_requests=max_requests, max_context=64 + NEW_TOKENS + spec.block_size,
    )  # fmt: skip
    return runtime, target, everyone


def _decode(rank: int, world: int, layout: str, use_counts: bool) -> dict:
    """The host loop of an engine; rank 1 has one request and goes idle early. Returns each step's
    drafts and the collectives its propose issued (outside / inside the dispatcher)."""
    split = [PROMPTS[:2], PROMPTS[2:]]
    runtime, target, engine_group = _runtime(rank, world, layout, len(split[rank]))
    inside = [False]
    _tag_dispatcher(runtime, inside)
    syncs = []  # the coordinator's exchanges (through the store on CPU ranks: no c10d op to see)
    sync = runtime.coordinator.sync
    runtime.coordinator.sync = lambda *args, **kwargs: syncs.append(args[0]) or sync(*args, **kwargs)
    anchors, tokens = {}, {}
    for i, prompt in enumerate(split[rank]):
        rid = 10 * rank + i
        pre = target.prefill([rid], [prompt])
        runtime.add_request(rid, pre.features)
        anchors[rid], tokens[rid] = int(pre.first_tokens[0]), [int(pre.first_tokens[0])]
    steps = []
    step = 0
    while True:
        running = {r: a for r, a in anchors.items() if len(tokens[r]) < NEW_TOKENS}
        counts = None
        if use_counts:  # what the engine agreed for its target forward, outside the draft's step
            agreed = [None] * world
            dist.all_gather_object(agreed, len(running) * runtime.block_size, group=engine_group)
            counts = agreed
        before = len(syncs)
        with _Collectives(inside) as seen:
            proposal = runtime.propose(step, running, counts=counts)
        steps.append({
            "syncs": len(syncs) - before,
            "outside": [name for name, in_dispatch in seen.ops if not in_dispatch],
            "inside": sum(1 for _, in_dispatch in seen.ops if in_dispatch),
            "drafts": {r: d.tolist() for r, d in proposal.drafts.items()},
            "skip": proposal.plan.skip,
        })  # fmt: skip
        if proposal.plan.skip:
            break
        if running:
            ids = list(running)
            blocks = torch.stack([torch.cat([torch.tensor([running[r]]), proposal.drafts[r]]) for r in ids])
            result = target.verify(ids, blocks)
            runtime.commit(result)
            for i, r in enumerate(ids):
                tokens[r] += result.emitted(i)
                anchors[r] = int(result.bonus[i])
        step += 1
    runtime.close()
    return {"steps": steps, "tokens": {r: t[:NEW_TOKENS] for r, t in tokens.items()}}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["alltoall", "gather"])
def test_engine_counts_leave_only_the_moe_collectives_and_change_no_draft(layout):
    with_counts = run_ranks(2, _decode, layout, True, timeout_s=200)
    with_sync = run_ranks(2, _decode, layout, False, timeout_s=200)
    for rank in range(2):
        a, b = with_counts[rank], with_sync[rank]
        assert len(a["steps"]) == len(b["steps"]) > 3
        for s, (x, y) in enumerate(zip(a["steps"], b["steps"])):
            assert x["drafts"] == y["drafts"], f"rank {rank} step {s}"
            assert x["outside"] == [], f"rank {rank} step {s}: {x['outside']} beside the MoE dispatch"
            assert x["syncs"] == 0 and y["syncs"] == 1  # the coordinator's exchange, only without counts
            assert y["outside"] == [], y["outside"]  # which goes through the store on CPU ranks
            assert x["inside"] == y["inside"]
            assert x["inside"] > 0 or x["skip"]  # an idle rank still enters every MoE collective
        assert a["steps"][-1]["skip"] and a["steps"][-1]["inside"] == 0
        assert a["tokens"] == b["tokens"]
    assert with_counts[1]["steps"][-2]["drafts"] == {}  # rank 1 was idle while rank 0 still drafted


def _bad_counts(rank: int, world: int) -> dict:
    runtime, target, _ = _runtime(rank, world, "alltoall", 1)
    B = runtime.block_size
    rid = rank
    pre = target.prefill([rid], [PROMPTS[rank]])
    runtime.add_request(rid, pre.features)
    anchors = {rid: int(pre.first_tokens[0])}
    out = {}
    # Every rank passes the same kind of bad input: each raises before any collective.
    for key, counts, error in [
        ("length", [B, B, B], ParallelError),
        ("mine", [2 * B, 2 * B], RequestError),
        ("partial", [B, B + 1], RequestError),
        ("negative", [-B, B] if rank == 1 else [B, -B], RequestError),
    ]:
        with pytest.raises(error) as e:
            runtime.propose(0, anchors, counts=counts)
        out[key] = str(e.value)
    with pytest.raises(RequestError) as e:
        runtime.propose(0, anchors, extras=(1,), counts=[B, B])
    out["extras"] = str(e.value)
    # check_counts: the coordinator's sync runs too and the engine's counts must equal it.
    plan = runtime.propose(0, anchors, counts=[B, B], check_counts=True).plan
    out["checked"] = plan.counts
    for step, counts in [(1, [B, 0] if rank == 0 else [0, B]), (2, [B, 0] if rank == 0 else [B, B])]:
        try:  # both engines wrong; then rank 0's alone: rank 1 must not step into the dispatch
            runtime.propose(step, anchors, counts=counts, check_counts=True)
            out[f"mismatch {step}"] = None
        except StepMismatch as e:
            out[f"mismatch {step}"] = str(e)
    runtime.close()
    return out


@pytest.mark.timeout(120)
def test_engine_counts_that_contradict_the_rank_or_group_are_refused_naming_the_rank():
    results = run_ranks(2, _bad_counts, timeout_s=100)  # the tiny draft's block_size is 8
    for rank, out in enumerate(results):
        assert out["length"].startswith(
            f"rank {rank}, step 0: the engine passed 3 row counts; the draft's DP group has 2 ranks [0, 1]"
        )
        assert out["mine"] == (f"rank {rank}, step 0: the engine's count for this rank is 16 rows, but it passed "
                               "1 anchors = 8 rows (block_size 8)")  # fmt: skip
        assert out["partial"].startswith(f"rank {rank}, step 0: the engine's count for rank 1 is 9 rows")
        assert out["negative"].startswith(f"rank {rank}, step 0: the engine's count for rank {1 - rank} is -8 rows")
        assert "extras travel in the coordinator's sync" in out["extras"]
        assert out["checked"] == (8, 8)
        assert out["mismatch 1"] == (f"rank {rank}, step 1: the engine's counts on ranks [0, 1] differ from the "
                                     "gathered [8, 8] (ranks [0, 1]); this rank's engine passed "
                                     f"{[8, 0] if rank == 0 else [0, 8]}")  # fmt: skip
        assert out["mismatch 2"] == (f"rank {rank}, step 2: the engine's counts on ranks [0] differ from the "
                                     "gathered [8, 8] (ranks [0, 1])" + ("; this rank's engine passed [8, 0]"
                                                                         if rank == 0 else ""))  # fmt: skip


def _group_faults(rank: int, world: int) -> dict:
    """Rank 0 names a request it never added, then passes counts wrong about itself; rank 1 is idle."""
    runtime, target, group = _runtime(rank, world, "alltoall", 1)
    B = runtime.block_size
    anchors = {}
    if rank == 0:
        pre = target.prefill([0], [PROMPTS[0]])
        runtime.add_request(0, pre.features)
        anchors = {0: int(pre.first_tokens[0]), 7: 5}  # 7 was never added
    out = {"drafted": []}
    for step in range(3):  # every rank still enters every MoE collective: the steps stay paired
        counts = [2 * B, 0]
        try:
            proposal = runtime.propose(step, anchors, counts=counts)
            out["drafted"].append(sorted(proposal.drafts))
        except RequestError as e:
            out["missing"] = str(e)
            out["drafted"].append("raised")
    out["idle_flags"] = len(runtime._flags)
    if rank == 0:
        with pytest.raises(RequestError):
            runtime.propose(3, anchors, counts=[B, 0])  # 2 anchors: fatal, told to the peers
    dist.barrier(group)
    if rank == 1:
        lost = runtime.watchdog.lost_error(RuntimeError("Connection reset by peer"), what="the next collective")
        out["named"] = str(lost)
    dist.barrier(group)
    runtime.close()
    return out


@pytest.mark.timeout(120)
def test_a_rank_with_a_bad_request_keeps_the_group_in_step_and_bad_counts_are_told_to_the_peers():
    """A request never added on one rank: its rows run as padding and the error comes after the
    step, so the ranks' MoE collectives stay paired step after step (rank 1, idle, would else pair
    its step s with rank 0's s + 1). Counts that contradict the rank are fatal, and the peers name
    the rank and its reason. An idle rank keeps no finite flags (it drafts nothing to check)."""
    zero, one = run_ranks(2, _group_faults, timeout_s=100)
    assert zero["drafted"] == ["raised"] * 3 and one["drafted"] == [[], [], []]
    assert zero["missing"] == ("propose, step 2: requests [7] were never added on this rank (their rows ran as "
                               "padding, so the group's collectives stayed in step)")  # fmt: skip
    assert one["idle_flags"] == 0 and zero["idle_flags"] == 3
    # named with the last step and phase rank 0 reported, and its reason
    assert one["named"].startswith("rank 0 failed at step 2, phase draft layer 1 MoE: rank 0, step 3: the engine's "
                                   "count for this rank is 8 rows, but it passed 2 anchors = 16 rows")  # fmt: skip


def _short_commit(rank: int, world: int) -> tuple[str, int, int]:
    import dataclasses

    runtime, target, _ = _runtime(rank, world, "alltoall", 1)
    pre = target.prefill([0], [PROMPTS[0]])
    runtime.add_request(0, pre.features)
    proposal = runtime.propose(0, {0: int(pre.first_tokens[0])})
    result = target.verify([0], torch.cat([pre.first_tokens[:1], proposal.drafts[0]]).unsqueeze(0))
    before = runtime.pool.length(0)
    with pytest.raises(RequestError) as e:
        runtime.commit(dataclasses.replace(result, features=result.features[1:]))
    after = runtime.pool.length(0)
    runtime.close()
    return str(e.value), before, after


def test_a_commit_whose_rows_are_not_its_commit_lens_is_refused_before_writing():
    """The feature rows must be sum(commit_lens), packed: fewer would put stale rows into a
    request's context under graphs (the commit's static rows) and split wrongly without."""
    message, before, after = run_ranks(1, _short_commit, timeout_s=100)[0]
    assert message.startswith("commit: ") and "feature rows for commit_lens [" in message
    assert after == before
