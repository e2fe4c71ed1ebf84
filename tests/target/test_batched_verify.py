"""HFTarget.verify batches requests of different lengths in one forward: same result as one at a time.

Three references per step: the same model verifying each request alone (its own target), and a plain
full forward (no KV cache) over each request's prompt + committed tokens + block. Requests join and
finish between steps, so the padded batch changes shape every step.
"""

import pytest
import torch

from epdraft.errors import RequestError
from epdraft.target.base import greedy_accept
from tests.target.test_hf_target import VOCAB, tiny_target

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


def test_batched_verify_equals_per_request_verify():
    batched, alone = tiny_target(2), tiny_target(2)
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
