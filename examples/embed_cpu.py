"""A serving engine's loop around epdraft's DraftRuntime, runnable on 2 CPU ranks (gloo):

    torchrun --standalone --nproc_per_node 2 examples/embed_cpu.py

Each rank plays one DP rank of an engine: it owns its process groups and its target (the tiny
trained target shipped in the package, through transformers), admits its own requests, and every
step calls propose -> verify -> commit, an idle rank included (it proposes for no request and still
enters every MoE collective of the step). The draft's MoE layers are sharded over both ranks with
all-to-all dispatch (`local-cpu-2`, a config shipped in the package). At the end each rank checks its
requests against the target's own greedy decode and prints one line; docs/embedding.md explains
each call.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import epdraft
from epdraft.config.parallel import load_parallel_config
from epdraft.models import read_draft_spec
from epdraft.parallel.groups import Groups
from epdraft.runtime import DraftRuntime
from epdraft.target.hf import HFTarget

ASSETS = Path(epdraft.__file__).parent / "assets"
PROMPTS = ["def main(argv):\n    ", "import os\nimport sys\n", "class Error(Exception", "    return "]
NEW_TOKENS = 24


def serve(runtime: DraftRuntime, target: HFTarget, prompts: dict[int, list[int]]) -> dict[int, list[int]]:
    """The engine's loop: prefill, then propose / verify / commit until every request has NEW_TOKENS."""
    tokens: dict[int, list[int]] = {}
    anchors: dict[int, int] = {}
    for rid, prompt in prompts.items():
        prefill = target.prefill([rid], [prompt])
        runtime.add_request(rid, prefill.features)  # [prompt length, K*H]: the prompt rows' target features
        anchors[rid] = int(prefill.first_tokens[0])
        tokens[rid] = [anchors[rid]]
    step = 0
    while True:
        running = {rid: anchor for rid, anchor in anchors.items() if len(tokens[rid]) < NEW_TOKENS}
        proposal = runtime.propose(step, running)  # every rank, every step; {} when this rank is idle
        if proposal.plan.skip:  # no rank had a request: every rank stops together
            break
        if running:
            ids = list(running)
            blocks = torch.stack([torch.cat([torch.tensor([running[r]]), proposal.drafts[r]]) for r in ids])
            result = target.verify(ids, blocks)  # the engine's own verify (greedy here)
            runtime.commit(result)  # the committed rows' features extend each request's draft context
            for i, rid in enumerate(ids):
                tokens[rid] += result.emitted(i)
                anchors[rid] = int(result.bonus[i])
        step += 1
    for rid in prompts:
        runtime.release(rid)
        target.release(rid)
    return {rid: t[:NEW_TOKENS] for rid, t in tokens.items()}


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    pc = load_parallel_config("local-cpu-2")  # the draft's layout: experts over both ranks, all-to-all
    if world != pc.world_size:
        raise SystemExit(f"run me with --nproc_per_node {pc.world_size} (this world has {world} ranks)")
    spec = read_draft_spec(ASSETS / "tiny-draft")
    target = HFTarget.from_pretrained(ASSETS / "tiny-target", spec.target_layer_ids)
    # The engine's groups: here one group of both ranks for the experts, the DP step and the CPU sync.
    everyone = dist.new_group(list(range(world)), backend="gloo")
    groups = Groups.from_process_groups(moe=everyone, attn_dp=everyone, cpu=everyone, ep_size=world, tp_size=1)
    # Rank 0 serves three requests, rank 1 one (it goes idle early and keeps stepping).
    mine = [0, 1, 2] if rank == 0 else [3]
    prompts = {rid: list(PROMPTS[rid].encode()) for rid in mine}
    runtime = DraftRuntime.from_config(
        pc, ASSETS / "tiny-draft", target, groups=groups, spec=spec,
        max_requests=len(mine), max_context=max(map(len, prompts.values())) + NEW_TOKENS + spec.block_size,
    )  # fmt: skip
    try:
        outputs = serve(runtime, target, prompts)
    finally:
        runtime.close()  # stops the runtime's watchdog before the world is torn down
    same = all(outputs[rid] == greedy(target, prompts[rid]) for rid in mine)
    print(f"rank {rank}: {len(mine)} requests, {'lossless: OK' if same else 'lossless: MISMATCH'}", flush=True)
    dist.destroy_process_group()
    return 0 if same else 1


def greedy(target: HFTarget, prompt: list[int]) -> list[int]:
    """The target's own greedy decode of NEW_TOKENS tokens (transformers' generate)."""
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt):].tolist()


if __name__ == "__main__":
    raise SystemExit(main())
