"""`--output FILE.jsonl`: every prompt's generated tokens, one JSON line per prompt, in the prompts
file's order (whichever rank served it), so a caller can zip the file with its prompts."""

from __future__ import annotations

from pathlib import Path

import msgspec

from epdraft.target.prompts import Prompt, saved_tokenizer
from epdraft.worker.summary import RequestOutcome


class OutputLine(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One prompt's result.

    id: the prompts line's `id` (null when it has none); index: the prompt's 0-based index (its
    request id); text: the tokens decoded with the target's tokenizer (null when the target has
    none); verify_steps / accepted_drafts: its speculative steps and the drafts they accepted;
    temperature / top_k / top_p / seed: the sampling it ran with, seed resolved, so one line can
    be re-run alone; error: why it was refused (only on a refused prompt, whose output_ids is empty).
    """

    id: str | int | float | bool | None
    index: int
    output_ids: list[int]
    text: str | None
    verify_steps: int
    accepted_drafts: int
    temperature: float
    top_k: int | None
    top_p: float
    seed: int | None
    error: str | None = None


def output_lines(prompts: list[Prompt], outcomes: list[RequestOutcome], tokenizer=None) -> list[OutputLine]:
    """One line per prompt in `prompts`' order; `outcomes` (every rank's, any order) hold one per
    prompt, request id = prompt index. `tokenizer`: decodes the text when given."""
    by_id = {o.request_id: o for o in outcomes}
    assert sorted(by_id) == list(range(len(prompts))), "every prompt is served or refused exactly once"
    lines = []
    for index, prompt in enumerate(prompts):
        o = by_id[index]
        served = o.error is None
        lines.append(OutputLine(
            id=prompt.id,
            index=index,
            output_ids=o.tokens,
            text=tokenizer.decode(o.tokens) if tokenizer is not None and served else None,
            verify_steps=len(o.accept_lens),
            accepted_drafts=sum(o.accept_lens),
            temperature=o.sampling.temperature,
            top_k=o.sampling.top_k,
            top_p=o.sampling.top_p,
            seed=o.sampling.seed,
            error=o.error,
        ))  # fmt: skip
    return lines


def write_outputs(path: str | Path, prompts: list[Prompt], outcomes: list[RequestOutcome], *,
                  tokenizer_dir: str | Path) -> None:  # fmt: skip
    """Write `output_lines` to `path` as JSON lines, text decoded with the tokenizer saved in
    `tokenizer_dir` (the target's) when it has one."""
    lines = output_lines(prompts, outcomes, saved_tokenizer(tokenizer_dir, "--output"))
    Path(path).write_bytes(b"".join(msgspec.json.encode(line) + b"\n" for line in lines))
