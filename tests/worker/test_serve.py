"""The serving loop with sampled requests: each request's params reach prefill, admit and verify
(with the drafts' proposal probabilities), and its accept tests are recorded. Stub target and
drafter: only the loop is under test."""

from __future__ import annotations

import dataclasses

import torch

from epdraft.config.sampling import SamplingParams
from epdraft.errors import RequestError
from epdraft.runtime import PhaseTimers
from epdraft.target.base import PrefillResult
from epdraft.target.prompts import Prompt
from epdraft.worker.serve import Drafted, serve_requests

K, V = 3, 11  # drafts per step, vocabulary


@dataclasses.dataclass
class StubResult:
    """What the loop reads of a VerifyResult: every draft accepted, bonus token 7."""

    request_ids: tuple[int, ...]
    blocks_NB: torch.Tensor
    tested: torch.Tensor | None
    expected_accepts: torch.Tensor | None

    @property
    def accept_lens(self):
        return torch.full((len(self.request_ids),), K)

    @property
    def bonus(self):
        return torch.full((len(self.request_ids),), 7)

    def emitted(self, i):
        return self.blocks_NB[i, 1:].tolist() + [7]


class StubTarget:
    def __init__(self, report_tests: bool = True):
        self.prefills, self.verifies, self.report_tests = [], [], report_tests

    def prefill(self, request_ids, prompts, sampling=None):
        self.prefills.append((list(request_ids), list(sampling)))
        if not prompts[0]:
            raise RequestError(f"request {request_ids[0]}: empty prompt")
        n = len(prompts[0])
        return PrefillResult(tuple(request_ids), torch.tensor([5]), torch.tensor([n]), torch.zeros(n, 4))

    def verify(self, request_ids, blocks_NB, draft_probs_NKV=None):
        self.verifies.append((list(request_ids), draft_probs_NKV))
        n = len(request_ids)
        if not self.report_tests:
            return StubResult(tuple(request_ids), blocks_NB, None, None)
        return StubResult(tuple(request_ids), blocks_NB, torch.full((n,), K), torch.full((n,), 2.5))

    def release(self, request_id):
        pass


class StubDrafter:
    """Drafts 1, 2, 3; probabilities for every request when any admitted request samples."""

    def __init__(self):
        self.admitted: dict[int, SamplingParams] = {}

    def admit(self, request_id, prompt_features, sampling):
        self.admitted[request_id] = sampling

    def propose(self, step, anchors, tokens_so_far):
        if not anchors:
            return Drafted({}, stop=True)
        drafts = {r: torch.tensor([1, 2, 3]) for r in anchors}
        sampled = any(not self.admitted[r].greedy for r in anchors)
        probs = {r: torch.full((K, V), float(r)) for r in anchors} if sampled else {}
        return Drafted(drafts, probs=probs)

    def commit(self, result):
        pass

    def release(self, request_id):
        pass


def _prompt(ids, **sampling):
    return Prompt(line=1, ids=ids, sampling=SamplingParams(**sampling))


def _serve(target, prompts, max_new_tokens=9):
    drafter = StubDrafter()
    report = serve_requests(target, drafter, prompts, rank=0, max_new_tokens=max_new_tokens,
                            timers=PhaseTimers(torch.device("cpu")))  # fmt: skip
    return report, drafter


def test_each_requests_sampling_reaches_prefill_admit_and_verify():
    hot = SamplingParams(temperature=0.8, top_k=5, seed=11)
    prompts = {0: _prompt([1, 2]), 3: Prompt(line=4, ids=[3], sampling=hot), 4: _prompt([])}
    target = StubTarget()
    report, drafter = _serve(target, prompts)
    assert target.prefills == [([0], [SamplingParams()]), ([3], [hot]), ([4], [SamplingParams()])]
    assert drafter.admitted == {0: SamplingParams(), 3: hot}  # the refused request is never admitted
    ids, probs = target.verifies[0]
    assert ids == [0, 3] and probs.shape == (2, K, V)
    assert probs[:, 0, 0].tolist() == [0.0, 3.0]  # stacked in the verify's request order
    by_id = {o.request_id: o for o in report.requests}
    assert by_id[3].sampling == hot and by_id[4].sampling == SamplingParams() and by_id[4].error
    # 9 tokens: the prefill's, then two steps of 3 drafts + the bonus (the last truncated)
    assert by_id[3].tokens == [5, 1, 2, 3, 7, 1, 2, 3, 7] and by_id[3].accept_lens == [3, 3]
    assert by_id[3].tests == 6 and by_id[3].expected_accepts == 5.0


def test_an_all_greedy_step_verifies_without_probabilities():
    target = StubTarget()
    _serve(target, {0: _prompt([1]), 1: _prompt([2])}, max_new_tokens=5)
    assert [probs for _, probs in target.verifies] == [None]


def test_tests_unknown_when_the_target_does_not_report_them():
    report, _ = _serve(StubTarget(report_tests=False), {0: _prompt([1], temperature=1.0, seed=1)})
    (o,) = report.requests
    assert o.tests is None and o.expected_accepts is None and o.accept_lens == [3, 3]
