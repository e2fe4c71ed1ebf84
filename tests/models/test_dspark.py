"""DSparkDraft: the Markov head against its formula, the confidence head, loading and refusals."""

import pytest
import torch

from epdraft.errors import ConfigError, LoadError
from epdraft.models import DraftModelSpec, DSparkDraft, load_draft
from tests.models.helpers import H, VOCAB, draft_config, randomize, write_export
from tests.models.test_dflash import Heads


def make_dspark(seed=0) -> DSparkDraft:
    draft = DSparkDraft(DraftModelSpec.from_config(draft_config(dspark=True, block_size=5)))
    randomize(draft, seed, scale=0.5)
    return draft.eval()


def test_markov_readout_matches_formula():
    """prev_0 = anchor; logits_k = base[:, k] + W2 @ W1[prev_k]; prev_{k+1} = argmax, per request."""
    draft, heads = make_dspark(1), Heads()
    gen = torch.Generator().manual_seed(2)
    caches = []
    for n in (4, 6):
        c = draft.new_cache()
        draft.extend_context(c, torch.randn(n, 2 * H, generator=gen))
        caches.append(c)
    anchors = torch.tensor([7, 33])
    drafts = draft.propose(caches, anchors, heads)

    with torch.no_grad():
        base = heads.lm_head(draft.block_hidden(caches, anchors, heads)[:, 1:])
    W1, W2 = draft.markov_head.markov_w1.weight.detach(), draft.markov_head.markov_w2.weight.detach()
    for i in range(2):
        prev, want = int(anchors[i]), []
        for k in range(draft.block_size - 1):
            logits = [float(base[i, k, v]) + sum(float(W2[v, j]) * float(W1[prev, j]) for j in range(W1.shape[1]))
                      for v in range(VOCAB)]
            prev = max(range(VOCAB), key=logits.__getitem__)
            want.append(prev)
        assert drafts[i].tolist() == want
    # The Markov term changes the drafts here: the plain DFlash readout would differ.
    assert not torch.equal(drafts, base.argmax(-1))


def test_zero_row_dspark_propose():
    assert make_dspark().propose([], torch.zeros(0, dtype=torch.long), Heads()).shape == (0, 4)


def test_confidence_head_loads_and_scores(tmp_path):
    cfg, draft = draft_config(dspark=True, block_size=5), make_dspark(3)
    loaded = load_draft(write_export(draft, cfg, tmp_path / "dspark"))
    assert isinstance(loaded, DSparkDraft)
    hidden, prev = torch.randn(2, 4, H), torch.randint(0, VOCAB, (2, 4))
    x = torch.cat([hidden, draft.markov_head.markov_w1(prev)], dim=-1)
    want = torch.sigmoid(x @ draft.confidence_head.proj.weight.T + draft.confidence_head.proj.bias).squeeze(-1)
    torch.testing.assert_close(loaded.confidence(hidden, prev), want, rtol=1e-5, atol=1e-6)
    partial = write_export(draft, cfg, tmp_path / "no-conf", drop=("confidence_head.proj.weight",))
    with pytest.raises(LoadError, match=r"confidence_head\.proj\.weight"):
        load_draft(partial)


def test_unsupported_markov_heads_are_refused():
    cfg = draft_config(dspark=True)
    cfg["dflash_config"]["markov_head_type"] = "gated"
    with pytest.raises(ConfigError, match="markov_head_type = 'gated'"):
        DSparkDraft(DraftModelSpec.from_config(cfg))
    cfg["dflash_config"] |= {"markov_head_type": "vanilla", "markov_rank": 0}
    with pytest.raises(ConfigError, match="markov_rank = 0"):
        DraftModelSpec.from_config(cfg)
