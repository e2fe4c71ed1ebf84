"""HFTarget.verify batches requests of different lengths in one forward: same result as one at a time.

Three references per step: the same model verifying each request alone (its own target), and a plain
full forward (no KV cache) over each request's prompt + committed tokens + block. Requests join and
finish between steps, so the padded batch changes shape every step. Targets with sliding-window
layers (Qwen3 mixing full and sliding layers, Mistral all sliding) run the same steps, with windows
shorter than the block and than the contexts: their full forward applies transformers' own window.
"""

import pytest
import torch

from epdraft.errors import RequestError
from epdraft.target.base import greedy_accept
from epdraft.target.hf import HFTarget
from tests.target.test_hf_target import VOCAB, tiny_target

transformers = pytest.importorskip("transformers")

B = 5


@torch.no_grad()
def full_forward_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ids, each from a fresh full forward (no cache involved)."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


@torch.no_grad()
def full_forward_verify(target, history: list[int], block: list[int]) -> tuple[int, int, torch.Tensor]:
    """(accept_len, bonus, features of all B block rows) of one block, from a full uncached forward."""
    out = target.model(torch.tensor([history + block]), output_hidden_states=True)
    preds = out.logits[0, -len(block):].argmax(-1)
    accept, bonus = greedy_accept(torch.tensor([block]), preds.unsqueeze(0))
    hs = out.hidden_states
    feats = torch.cat([hs[j + 1][0, -len(block):] for j in target.feature_layer_ids], dim=-1)
    return int(accept[0]), int(bonus[0]), feats


def sliding_target(family: str, window: int, seed: int = 2) -> HFTarget:
    """A random tiny target whose layers slide over `window` positions: Qwen3 or gpt-oss [sliding, full,
    sliding] (gpt-oss with attention sinks and MoE), or Mistral (all)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
                  sliding_window=window)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**common, use_sliding_window=True,
                                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        model = transformers.Qwen3ForCausalLM(cfg)
    elif family == "gpt_oss":
        common |= {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**common))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return HFTarget(model, feature_layer_ids=[0, 2])


TARGETS = {
    "full": lambda: tiny_target(2),
    "qwen3-sliding-3": lambda: sliding_target("qwen3", 3),   # window < block
    "qwen3-sliding-7": lambda: sliding_target("qwen3", 7),   # block < window < contexts
    "mistral-sliding-4": lambda: sliding_target("mistral", 4),
    "gpt-oss-sliding-2": lambda: sliding_target("gpt_oss", 2),
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_batched_verify_equals_per_request_verify(target):
    batched, alone = TARGETS[target](), TARGETS[target]()
    windows = batched.layer_windows
    assert (windows == (None,) * 3) == (target == "full")
    prompts = {0: [3, 9, 1], 1: [5, 6, 7, 8, 9, 10, 11, 12, 13], 2: [40, 2, 2, 7, 30], 3: list(range(20, 32))}
    history: dict[int, list[int]] = {}
    anchor: dict[int, int] = {}

    def join(rid: int) -> None:
        pre = batched.prefill([rid], [prompts[rid]])
        ref = alone.prefill([rid], [prompts[rid]])
        assert pre.first_tokens.tolist() == ref.first_tokens.tolist()
        history[rid], anchor[rid] = list(prompts[rid]), int(pre.first_tokens[0])

    def step(rids: list[int], wrong_at: list[int]) -> None:
        blocks = []
        for rid, k in zip(rids, wrong_at):
            drafts = full_forward_greedy(batched.model, history[rid] + [anchor[rid]], B - 1)
            if k < B - 1:  # the draft at index k is wrong: k drafts accepted
                drafts[k] = (drafts[k] + 1) % VOCAB
            blocks.append([anchor[rid]] + drafts)
        res = batched.verify(rids, torch.tensor(blocks))
        assert res.accept_lens.tolist() == wrong_at
        for i, rid in enumerate(rids):
            one = alone.verify([rid], torch.tensor([blocks[i]]))
            accept, bonus, feats = full_forward_verify(batched, history[rid], blocks[i])
            n = accept + 1
            assert int(res.accept_lens[i]) == int(one.accept_lens[0]) == accept
            assert int(res.bonus[i]) == int(one.bonus[0]) == bonus
            assert int(res.commit_lens[i]) == n
            assert res.committed_ids[res.rows(i)].tolist() == one.committed_ids.tolist() == blocks[i][:n]
            torch.testing.assert_close(res.features[res.rows(i)], one.features, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(res.features[res.rows(i)], feats[:n], rtol=1e-4, atol=1e-5)
            history[rid] += blocks[i][:n]
            anchor[rid] = bonus
            assert batched.seq_len(rid) == alone.seq_len(rid) == len(history[rid])
            # Each layer keeps what transformers' cache keeps: all rows, or the last W-1 on a sliding layer.
            for (k, v), w in zip(batched._kv[rid].layers, windows):
                assert k.shape[1] == v.shape[1] == (len(history[rid]) if w is None else min(len(history[rid]), w - 1))

    for rid in (0, 1, 2):
        join(rid)
    step([0, 1, 2], wrong_at=[B - 1, 0, 2])
    join(3)  # joins later, and is the longest
    step([2, 3, 0, 1], wrong_at=[1, 3, 0, B - 1])
    batched.release(1)  # finishes
    alone.release(1)
    step([3, 0, 2], wrong_at=[0, 2, B - 1])
    step([0], wrong_at=[1])


def test_verify_refuses_a_repeated_or_released_request():
    target = tiny_target()
    target.prefill([1, 2], [[4, 5], [6]])
    with pytest.raises(RequestError, match=r"request id more than once: \[1, 1\]"):
        target.verify([1, 1], torch.zeros(2, 3, dtype=torch.long))
    target.release(2)
    with pytest.raises(RequestError, match="request 2: verify before prefill"):
        target.verify([1, 2], torch.zeros(2, 3, dtype=torch.long))
    assert target.verify([], torch.zeros(0, 3, dtype=torch.long)).committed_ids.shape == (0,)


def test_the_window_changes_the_model():
    """The sliding targets are not full-attention ones in disguise: on a long prompt the logits differ."""
    sliding = sliding_target("qwen3", 3)
    full = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{
        **sliding.model.config.to_dict(), "layer_types": ["full_attention"] * 3, "use_sliding_window": False}))
    full.load_state_dict(sliding.model.state_dict())
    ids = torch.tensor([list(range(3, 15))])
    with torch.no_grad():
        assert not torch.allclose(sliding.model(ids).logits, full(ids).logits, atol=1e-3)


@pytest.mark.parametrize("target", ["qwen3-sliding-3", "mistral-sliding-4", "gpt-oss-sliding-2"])
def test_batched_speculative_decoding_is_lossless_on_sliding_targets(target):
    """Three requests decoded together with a random draft, every verify batched: each equals HF generate."""
    from epdraft.models import DFlashDraft, DraftModelSpec
    from tests.models.helpers import draft_config, randomize

    tgt = TARGETS[target]()
    cfg = draft_config(moe=False)
    cfg["vocab_size"], cfg["dflash_config"]["mask_token_id"] = VOCAB, VOCAB - 1
    draft = DFlashDraft(DraftModelSpec.from_config(cfg))
    randomize(draft, 3)
    prompts, n = {0: [3, 9, 27, 1, 40, 12, 5, 5, 8], 1: [7, 7], 2: list(range(10, 24))}, 18
    pre = tgt.prefill(list(prompts), list(prompts.values()))
    pool = draft.new_pool(max_requests=len(prompts), max_context=64)
    anchors, out = {}, {}
    for i, rid in enumerate(prompts):
        pool.admit(rid)
        draft.extend(pool, [rid], [pre.features[pre.rows(i)]])
        anchors[rid], out[rid] = int(pre.first_tokens[i]), [int(pre.first_tokens[i])]
    while any(len(t) < n for t in out.values()):
        rids = [r for r in prompts if len(out[r]) < n]
        slots = torch.tensor([pool.slot(r) for r in rids])
        drafts = draft.step(pool, slots, torch.tensor([anchors[r] for r in rids]), tgt, None).drafts_NK
        blocks = torch.cat([torch.tensor([[anchors[r]] for r in rids]), drafts], dim=1)
        res = tgt.verify(rids, blocks)
        draft.extend(pool, rids, [res.features[res.rows(i)] for i in range(len(rids))])
        for i, r in enumerate(rids):
            out[r] += res.emitted(i)
            anchors[r] = int(res.bonus[i])
    for rid, prompt in prompts.items():
        ids = torch.tensor([prompt])
        want = tgt.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        assert out[rid][:n] == want, rid
