"""The verify rule on the GPU as an engine calls it: `speculative_accept` over a batch of mixed
greedy / sampled requests synchronizes nothing with the host and a CUDA graph holds it (the
replay's verdict equals the eager one)."""

from __future__ import annotations

import pytest
import torch

from epdraft.config.sampling import SamplingParams
from epdraft.kernels.sample.propose import propose_sampled
from epdraft.sampling import SamplingBatch, Stream, speculative_accept

pytestmark = pytest.mark.gpu


@torch.no_grad()
@pytest.mark.parametrize("filtered", [False, True])
def test_speculative_accept_has_no_host_sync_and_replays_from_a_graph(filtered):
    gen = torch.Generator(device="cuda").manual_seed(1)
    N, K, V = 8, 15, 32000
    params = [SamplingParams(temperature=0.8, seed=n, top_p=0.9 if filtered else 1.0) if n % 3 else SamplingParams()
              for n in range(N)]  # fmt: skip
    batch = SamplingBatch.of(params, "cuda")
    draft_logits = torch.randn(N, K, V, generator=gen, device="cuda").bfloat16()
    start = torch.randint(0, 1000, (N,), generator=gen, device="cuda")
    drafts, q = propose_sampled(draft_logits, batch.temperature, batch.seed, start + 1, int(Stream.DRAFT))
    anchors = torch.randint(0, V, (N, 1), generator=gen, device="cuda")
    blocks = torch.cat([anchors, drafts], dim=1)
    # a target close to the draft, so some drafts are accepted
    target_logits = torch.cat([draft_logits.float(), draft_logits[:, -1:].float()], dim=1)
    target_logits += 0.3 * torch.randn(target_logits.shape, generator=gen, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = speculative_accept(blocks, target_logits, batch, q, start)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        speculative_accept(blocks, target_logits, batch, q, start)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = speculative_accept(blocks, target_logits, batch, q, start)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.accept_lens, eager.accept_lens)
    assert torch.equal(captured.next_tokens, eager.next_tokens)
    assert torch.equal(captured.overlap_NK, eager.overlap_NK)
    assert 0 < int(eager.accept_lens.sum()) < N * K
