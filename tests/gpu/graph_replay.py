"""The graph-vs-eager check the draft-step GPU tests share: replay a draft's step from a CUDA graph
and run it eagerly on the same padded batch, step after step of a growing context."""

from __future__ import annotations

import torch

from epdraft.config.sampling import SamplingParams
from epdraft.dispatch import StepPlan
from epdraft.runtime.graphs import StepGraphs


@torch.no_grad()
def graph_vs_eager(draft, heads, *, requests: int, bucket: int, buckets: tuple[int, ...], steps: int,
                   first_rows: list[int], seed: int, sampling: str = "greedy") -> tuple[int, bool]:  # fmt: skip
    """(steps whose replayed drafts, finite flags or confidence differ from eager, whether every step stayed
    finite) over `steps` steps of `requests` requests padded to `bucket`; each replay runs under
    `torch.cuda.set_sync_debug_mode("error")` (a host sync inside it raises).

    Eager runs on the graph's padded batch (pad rows on the pad slot): a GEMM's result in bf16
    depends on its row count, so only the same shapes can be asked to agree bit for bit. Each step
    commits 1..B rows per request (as verify would), so the context grows every step.

    sampling: "greedy" (every request), "sample" (requests cycle through greedy, T = 0.8, T = 1.2:
    the one-launch sampled readout) or "filtered" (greedy, T = 0.8, T = 0.7 with top-k 50 and top-p
    0.9: the sorted one); sampled readouts must replay their proposal probabilities bit for bit too.
    """
    spec, B, n = draft.spec, draft.block_size, requests
    width = spec.num_target_features * spec.hidden_size
    pool = draft.new_pool(max_requests=bucket, max_context=sum(first_rows) + steps * B + 64)
    rids = list(range(n))
    settings = {
        "greedy": [SamplingParams()],
        "sample": [SamplingParams(), SamplingParams(temperature=0.8, seed=seed), SamplingParams(temperature=1.2, seed=9)],
        "filtered": [SamplingParams(), SamplingParams(temperature=0.8, seed=seed),
                     SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=seed + 1)],
    }[sampling]  # fmt: skip
    for rid in rids:
        pool.admit(rid, settings[rid % len(settings)])
    readout = pool.readout(rids)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    draft.extend(pool, rids, [torch.randn(r, width, generator=gen, device="cuda").bfloat16() for r in first_rows])
    graphs = StepGraphs(
        lambda s, a, plan, readout: draft.step(pool, s, a, heads, plan, readout=readout), pad_slot=pool.pad_slot,
        buckets=buckets, block_size=B, device=torch.device("cuda"),
    )  # fmt: skip
    slots = [pool.slot(r) for r in rids]
    slots_N = torch.tensor(slots + [pool.pad_slot] * (bucket - n), device="cuda")
    anchors = torch.randint(0, spec.vocab_size - 1, (n,), generator=gen, device="cuda")
    mismatches, all_finite = 0, True
    for step in range(steps):
        plan = StepPlan(step=step, ranks=(0,), counts=(n * B,))
        out = draft.step(pool, slots_N, torch.cat([anchors, anchors.new_zeros(bucket - n)]), heads, plan, readout=readout)
        eager, finite = out.drafts_NK, out.finite_L
        anchor_list = anchors.tolist()
        torch.cuda.set_sync_debug_mode("error")
        try:
            replay = graphs.run(slots, anchor_list, plan, readout=readout)
            replayed, replayed_finite = replay.drafts_NK, replay.finite_L
        finally:
            torch.cuda.set_sync_debug_mode("default")
        mismatches += int(not torch.equal(replayed, eager[:n])) + int(not torch.equal(replayed_finite, finite))
        if out.confidence_NK is not None:  # a DSpark confidence head: the graph holds its scores too
            mismatches += int(not torch.equal(replay.confidence_NK, out.confidence_NK[:n]))
        if out.probs_NKV is not None:
            mismatches += int(not torch.equal(replay.probs_NKV, out.probs_NKV[:n]))
        all_finite &= bool(finite.all())
        commit = [1 + (step + i) % B for i in rids]
        draft.extend(pool, rids, [torch.randn(c, width, generator=gen, device="cuda").bfloat16() for c in commit])
        anchors = eager[:n, 0]
    return mismatches, all_finite
