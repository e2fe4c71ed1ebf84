"""DraftRuntime names the step and draft layer whose hidden states went NaN, at the commit after
that step's propose (on CPU ranks the flags are there at once; on CUDA they are copied back
asynchronously and checked by the first commit that finds them arrived)."""

from __future__ import annotations

import pytest
import torch

from epdraft.errors import NonFiniteError
from tests.harness import run_ranks
from tests.runtime.test_engine_counts import PROMPTS, _runtime


def _poisoned_at_step_2(rank: int, world: int) -> str:
    runtime, target, _ = _runtime(rank, world, "alltoall", 1)
    pre = target.prefill([0], [PROMPTS[0]])
    runtime.add_request(0, pre.features)
    anchor = int(pre.first_tokens[0])
    try:
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    runtime.draft.layers[1].post_attention_layernorm.weight.fill_(float("nan"))
            drafts = runtime.propose(step, {0: anchor}).drafts[0]
            result = target.verify([0], torch.cat([torch.tensor([anchor]), drafts]).unsqueeze(0))
            try:
                runtime.commit(result)
            except NonFiniteError as e:
                return str(e)
            anchor = int(result.bonus[0])
        return "no error"
    finally:
        runtime.close()


@pytest.mark.timeout(120)
def test_a_nan_step_is_named_at_its_commit():
    message = run_ranks(1, _poisoned_at_step_2, timeout_s=100)[0]
    assert message.startswith("rank 0 at step 2: draft layer 1's hidden states went NaN or inf"), message
