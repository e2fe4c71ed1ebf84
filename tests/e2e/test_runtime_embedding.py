"""DraftRuntime driven by a minimal host loop written here, the way a serving engine embeds it.

The "engine" owns its process groups, its target (HF, replicated) and its scheduler; it builds one
DraftRuntime per DP rank and calls propose / verify / commit every step on every rank, idle ranks
included. The reference is the single-process speculative decode of the same prompts, greedy or,
with each request's own sampling and seed, sampled: the same seeds give the same tokens on one
process and on two ranks of either layout.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from epdraft.config.sampling import SamplingParams
from epdraft.errors import ParallelError
from epdraft.parallel.spawn import run_local_ranks
from epdraft.runtime import DraftRuntime
from tests.harness import run_ranks

ASSETS = Path(__file__).resolve().parents[2] / "epdraft" / "assets"
PROMPTS = [[ord(c) for c in s] for s in ("def main(argv):\n    ", "import os\nimport sys\n", "class Error(Exception", "    return ")]
NEW_TOKENS = 24
SAMPLED = [SamplingParams(temperature=1.0, seed=5), SamplingParams(), SamplingParams(temperature=0.7, top_k=5, seed=6),
           SamplingParams(temperature=0.8, top_p=0.9, seed=7)]  # fmt: skip


def _host_engine(rank: int, world: int, layout: str, ep: int, prompts_of_rank: list[list[int]],
                 sampling_of_rank: list[list[SamplingParams]] | None = None):
    from epdraft.config.parallel import parallel_config_from_dict
    from epdraft.models import read_draft_spec
    from epdraft.models.spec import check_against_target
    from epdraft.parallel.groups import Groups
    from epdraft.runtime import MoeLayout
    from epdraft.target.hf import HFTarget

    torch.manual_seed(0)
    draft_dir = ASSETS / "tiny-draft"
    spec = read_draft_spec(draft_dir)
    target = HFTarget.from_pretrained(ASSETS / "tiny-target", spec.target_layer_ids)
    check_against_target(spec, hidden_size=target.hidden_size, num_layers=target.num_layers, vocab_size=target.vocab_size)
    # The engine's own groups: one MoE group of `ep` ranks per replica, a gloo CPU group over all.
    everyone = dist.new_group(list(range(world)))
    moe = None
    for start in range(0, world, ep):
        g = dist.new_group(list(range(start, start + ep)))
        if start <= rank < start + ep:
            moe = g
    groups = Groups.from_process_groups(moe=moe, attn_dp=everyone, cpu=everyone, ep_size=ep, tp_size=1)
    # The engine states its draft layout as a ParallelConfig (a dict here, a file in epdraft run).
    pc = parallel_config_from_dict({
        "cluster": {"nnodes": 1, "nproc_per_node": world, "device": "cpu"},
        "draft": {"attn_dp": world, "moe_layout": layout, "moe_ep": ep},
        "target": {"dp": world},
    })  # fmt: skip
    runtime = DraftRuntime.build(
        draft_dir, target, groups=groups, layout=MoeLayout.resolve(pc, spec.ffn, groups), spec=spec,
        max_requests=len(prompts_of_rank[rank]), max_context=max(map(len, PROMPTS)) + NEW_TOKENS + spec.block_size,
    )  # fmt: skip
    assert runtime.layout.layout == layout and runtime.layout.ep_size == ep

    mine = {rank * 100 + i: p for i, p in enumerate(prompts_of_rank[rank])}
    sampling = {rank * 100 + i: p for i, p in enumerate(sampling_of_rank[rank])} if sampling_of_rank else {}
    tokens: dict[int, list[int]] = {}
    accepts: dict[int, list[int]] = {}
    anchors: dict[int, int] = {}
    for rid, prompt in mine.items():
        params = sampling.get(rid, SamplingParams())
        pre = target.prefill([rid], [prompt], [params])
        runtime.add_request(rid, pre.features, params)
        anchors[rid] = int(pre.first_tokens[0])
        tokens[rid], accepts[rid] = [anchors[rid]], []
    step = 0
    while True:
        running = {r: a for r, a in anchors.items() if len(tokens[r]) < NEW_TOKENS}
        proposal = runtime.propose(step, running)
        if proposal.plan.skip:
            break
        if running:
            ids = list(running)
            blocks = torch.stack([torch.cat([torch.tensor([running[r]]), proposal.drafts[r]]) for r in ids])
            probs = torch.stack([proposal.probs[r] for r in ids]) if proposal.probs else None
            result = target.verify(ids, blocks, probs)
            runtime.commit(result)
            for i, r in enumerate(ids):
                tokens[r] += result.emitted(i)
                accepts[r].append(int(result.accept_lens[i]))
                anchors[r] = int(result.bonus[i])
        step += 1
    runtime.close()
    return {r: (tokens[r][:NEW_TOKENS], accepts[r]) for r in mine}


def _reference(prompts: list[list[int]], sampling: list[SamplingParams] | None = None):
    from epdraft.models import load_draft, read_draft_spec, speculative_generate
    from epdraft.target.hf import HFTarget

    spec = read_draft_spec(ASSETS / "tiny-draft")
    target = HFTarget.from_pretrained(ASSETS / "tiny-target", spec.target_layer_ids)
    draft = load_draft(ASSETS / "tiny-draft")
    sampling = sampling or [SamplingParams()] * len(prompts)
    outs = [speculative_generate(target, draft, p, NEW_TOKENS, request_id=i, sampling=s)
            for i, (p, s) in enumerate(zip(prompts, sampling))]  # fmt: skip
    return [(o.tokens, o.accept_lens) for o in outs]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,ep", [("alltoall", 2), ("gather", 2)])
def test_host_loop_equals_single_process(layout, ep):
    # Rank 1 has one request and goes idle early; rank 0 has three.
    split = [PROMPTS[:3], PROMPTS[3:]]
    results = run_ranks(2, _host_engine, layout, ep, split, timeout_s=200)
    reference = _reference(PROMPTS)
    got = list(results[0].values()) + list(results[1].values())
    for (tokens, accepts), (ref_tokens, ref_accepts) in zip(got, reference, strict=True):
        assert tokens == ref_tokens
        assert accepts == ref_accepts
    accept_length = 1 + sum(sum(a) for _, a in got) / sum(len(a) for _, a in got)
    assert accept_length >= 2.0, f"the trained tiny pair commits only {accept_length:.2f} tokens per step"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,ep", [("alltoall", 2), ("gather", 2)])
def test_sampled_host_loop_equals_single_process(layout, ep):
    """Sampled and greedy requests in one batch: each request's tokens equal its single-process
    decode with the same seed (nothing depends on the rank, the batch or the layout)."""
    split, sampling = [PROMPTS[:3], PROMPTS[3:]], [SAMPLED[:3], SAMPLED[3:]]
    results = run_ranks(2, _host_engine, layout, ep, split, sampling, timeout_s=200)
    reference = _reference(PROMPTS, SAMPLED)
    got = list(results[0].values()) + list(results[1].values())
    for (tokens, accepts), (ref_tokens, ref_accepts) in zip(got, reference, strict=True):
        assert tokens == ref_tokens
        assert accepts == ref_accepts
    # the sampled requests really sampled: not the greedy decode of the same prompts
    greedy = _reference(PROMPTS)
    assert [g[0] for g in greedy][1] == got[1][0]  # the greedy request of the mix
    assert sum(g[0] != t for g, (t, _) in zip(greedy, got)) == 3


def _dies_mid_dispatch(rank: int, world: int, out: str) -> None:
    """The host loop above, but rank 1 is SIGKILLed inside its first MoE dispatch of step 2."""
    from epdraft.config.parallel import parallel_config_from_dict
    from epdraft.layers.moe import DraftMoE
    from epdraft.models import read_draft_spec
    from epdraft.parallel.groups import Groups
    from epdraft.runtime import MoeLayout
    from epdraft.target.hf import HFTarget

    draft_dir = ASSETS / "tiny-draft"
    spec = read_draft_spec(draft_dir)
    target = HFTarget.from_pretrained(ASSETS / "tiny-target", spec.target_layer_ids)
    everyone = dist.new_group(list(range(world)))
    groups = Groups.from_process_groups(moe=everyone, attn_dp=everyone, cpu=everyone, ep_size=world, tp_size=1)
    pc = parallel_config_from_dict({
        "cluster": {"nnodes": 1, "nproc_per_node": world, "device": "cpu"},
        "draft": {"attn_dp": world, "moe_layout": "alltoall", "moe_ep": world},
        "target": {"dp": world},
    })  # fmt: skip
    runtime = DraftRuntime.build(draft_dir, target, groups=groups, layout=MoeLayout.resolve(pc, spec.ffn, groups),
                                 spec=spec, max_requests=4, max_context=512)  # fmt: skip
    steps = {"now": 0}
    if rank == 1:
        dispatcher = next(m.dispatcher for m in runtime.draft.modules() if isinstance(m, DraftMoE))
        dispatch = dispatcher.dispatch

        def dying_dispatch(*args, **kwargs):
            if steps["now"] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return dispatch(*args, **kwargs)

        dispatcher.dispatch = dying_dispatch
    rid = rank
    pre = target.prefill([rid], [PROMPTS[rank]])
    runtime.add_request(rid, pre.features)
    anchor = int(pre.first_tokens[0])
    try:
        for step in range(NEW_TOKENS):
            steps["now"] = step
            proposal = runtime.propose(step, {rid: anchor})
            block = torch.cat([torch.tensor([anchor]), proposal.drafts[rid]]).unsqueeze(0)
            result = target.verify([rid], block)
            runtime.commit(result)
            anchor = int(result.bonus[0])
        message = "no step failed"
    except ParallelError as e:
        message = str(e)
    runtime.close()
    Path(out, f"rank{rank}").write_text(message)


@pytest.mark.timeout(240)
def test_a_rank_dying_mid_dispatch_makes_the_others_raise_a_parallel_error_naming_it(tmp_path):
    with pytest.raises(ParallelError, match="rank 1 exited with code -9 without reporting"):
        run_local_ranks(2, _dies_mid_dispatch, str(tmp_path), timeout_s=200)
    message = (tmp_path / "rank0").read_text()
    # Rank 1's last step and phase are its last beat's (up to a second old): not asserted.
    assert message.startswith("lost rank 1 (heartbeat gone, last at "), message
    assert "step 2's draft collectives failed on rank 0 at step 2, phase draft layer 0 MoE: " in message, message
