"""The shipped tiny pair (epdraft/assets): loads through the real loaders, decodes losslessly, accepts >= 2."""

import json
from pathlib import Path

import pytest

import epdraft
from epdraft.models import DFlashDraft, check_against_target, load_draft, speculative_generate
from tests.models.helpers import hf_greedy

transformers = pytest.importorskip("transformers")

ASSETS = Path(epdraft.__file__).parent / "assets"


@pytest.mark.timeout(240)
def test_tiny_pair_is_lossless_and_accepts_at_least_two():
    from epdraft.target.hf import HFTarget

    draft = load_draft(ASSETS / "tiny-draft")
    assert isinstance(draft, DFlashDraft) and draft.block_size == 8
    assert all(draft.layers[i].mlp.spec.num_experts == 8 for i in range(2))
    target = HFTarget.from_pretrained(ASSETS / "tiny-target", draft.spec.target_layer_ids)
    check_against_target(draft.spec, hidden_size=target.hidden_size, num_layers=target.num_layers,
                         vocab_size=target.vocab_size)
    prompts = [json.loads(line)["input_ids"] for line in (ASSETS / "prompts.jsonl").read_text().splitlines()[:3]]
    accepts = []
    for i, prompt in enumerate(prompts):
        out = speculative_generate(target, draft, prompt, 40, request_id=i)
        want = hf_greedy(target, prompt, 40)
        assert out.tokens == want, f"prompt {i}: speculative output differs from the target's greedy decode"
        accepts += out.accept_lens
    assert sum(accepts) / len(accepts) >= 2.0
