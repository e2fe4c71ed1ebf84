"""HFTarget: the greedy verify rule, exact KV crop, and lossless decoding against HF generate."""

import pytest
import torch

from epdraft.errors import ConfigError, RequestError
from epdraft.target.base import greedy_accept
from epdraft.target.hf import HFTarget

transformers = pytest.importorskip("transformers")

VOCAB = 48


def tiny_target(seed: int = 0) -> HFTarget:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
    )
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # a sharper model than the default init: fewer argmax near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return HFTarget(model, feature_layer_ids=[0, 2])


def hf_greedy(target: HFTarget, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_greedy_accept_hand_built():
    blocks = torch.tensor([[5, 1, 2, 3], [5, 1, 9, 3], [5, 7, 2, 3], [5, 1, 2, 3]])
    preds = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 8, 4]])
    accept, bonus = greedy_accept(blocks, preds)
    assert accept.tolist() == [3, 1, 0, 2]   # all match / stop at 9 / first draft wrong / stop at 3 vs 8
    assert bonus.tolist() == [4, 2, 1, 8]    # the target's token after the accepted prefix


def test_verify_commits_exact_rows_and_crops_kv():
    target = tiny_target()
    prompt = [3, 17, 4, 40, 8, 1]
    want = hf_greedy(target, prompt, 8)
    pre = target.prefill([7], [prompt])
    assert pre.first_tokens.tolist() == want[:1]
    assert pre.features.shape == (len(prompt), 2 * 32)
    # Two right drafts, then a wrong one: accept 2, bonus = the target's 4th token.
    wrong = (want[3] + 1) % VOCAB
    block = torch.tensor([[want[0], want[1], want[2], wrong, 0]])
    res = target.verify([7], block)
    assert res.accept_lens.tolist() == [2]
    assert res.bonus.tolist() == [want[3]]
    assert res.commit_lens.tolist() == [3]
    assert res.committed_ids.tolist() == want[:3]
    assert res.emitted(0) == want[1:4]
    assert target.seq_len(7) == len(prompt) + 3
    # Features of committed rows equal the hidden states of a plain forward over prompt + committed tokens.
    full = torch.tensor([prompt + want[:3]])
    hs = target.model(full, output_hidden_states=True).hidden_states
    ref = torch.cat([hs[1][0], hs[3][0]], dim=-1)
    torch.testing.assert_close(pre.features, ref[: len(prompt)], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.features, ref[len(prompt):], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("draft_quality", ["perfect", "noisy", "random"])
def test_speculative_loop_equals_generate(draft_quality):
    """Any drafts at all: the tokens out equal HF generate(do_sample=False)."""
    target = tiny_target(1)
    prompt, n, B = [1, 2, 3, 4, 5, 6, 7], 24, 4
    want = hf_greedy(target, prompt, n + B)
    gen = torch.Generator().manual_seed(0)
    pre = target.prefill([0], [prompt])
    out, anchor = [int(pre.first_tokens[0])], int(pre.first_tokens[0])
    while len(out) < n:
        truth = want[len(out): len(out) + B - 1]
        drafts = torch.randint(0, VOCAB, (B - 1,), generator=gen)
        if draft_quality != "random":
            drafts = torch.tensor(truth)
        if draft_quality == "noisy":
            flip = torch.rand(B - 1, generator=gen) < 0.3
            drafts = torch.where(flip, (drafts + 1) % VOCAB, drafts)
        res = target.verify([0], torch.cat([torch.tensor([anchor]), drafts]).unsqueeze(0))
        out += res.emitted(0)
        anchor = int(res.bonus[0])
        if draft_quality == "perfect":
            assert res.accept_lens.tolist() == [B - 1]
    assert out[:n] == want[:n]


def test_bad_requests_and_layers_are_refused():
    target = tiny_target()
    with pytest.raises(RequestError, match="request 3: empty prompt"):
        target.prefill([3], [[]])
    with pytest.raises(RequestError, match=r"request 4: token id 48 outside the vocabulary \[0, 48\)"):
        target.prefill([4], [[1, 48]])
    with pytest.raises(RequestError, match="request 9: verify before prefill"):
        target.verify([9], torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"target_layer_ids \[3\]"):
        HFTarget(target.model, [3])


def test_layer_types_other_than_full_and_sliding_are_refused():
    target = tiny_target()
    target.model.config.layer_types = ["full_attention", "chunked_attention", "sliding_attention"]
    with pytest.raises(ConfigError, match="layer 1 is 'chunked_attention'"):
        HFTarget(target.model, [0, 2])
    target.model.config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    for window in (0, None):
        target.model.config.sliding_window = window
        with pytest.raises(ConfigError, match=f"target sliding_window = {window} must be a positive integer"):
            HFTarget(target.model, [0, 2])
