"""SamplingParams: how one request samples (temperature, top-k, top-p, seed), validated at the edge.

Semantics are those of transformers' logits processors (`TemperatureLogitsWarper`, then
`TopKLogitsWarper`, then `TopPLogitsWarper`) and vLLM's sampler: the logits are divided by the
temperature, every token below the k-th largest is dropped, then the smallest tokens whose
probabilities sum to at most 1 - top_p are dropped (the most likely token always stays).
Temperature 0 is greedy decoding (argmax; top-k and top-p then change nothing).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from epdraft.errors import ConfigError


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request's sampling. Defaults: greedy, no top-k, no top-p, no seed of its own (the
    run's stream)."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0, description="0 = greedy")] = 0.0
    top_k: Annotated[int, msgspec.Meta(ge=1, description="keep the k most likely tokens")] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0, description="keep the nucleus of this mass")] = 1.0
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1, description="the request's own random stream")] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def parse_sampling(fields: dict, where: str) -> SamplingParams:
    """`fields` (e.g. a prompts line's `temperature` / `top_k` / `top_p` / `seed`) as SamplingParams;
    ConfigError naming `where` and the field for a value outside its range or of the wrong type
    (nothing is clamped: `top_p = 1.5` is refused, not read as 1)."""
    try:
        return msgspec.convert(fields, SamplingParams, strict=True)
    except msgspec.ValidationError as e:
        expected, _, path = str(e).partition(" - at `$.")
        key = path.rstrip("`")
        if not key:  # not about one field's value (an unknown field)
            raise ConfigError(f"{where}: {expected.replace('`', '')}") from None
        expected = expected[0].lower() + expected[1:]
        raise ConfigError(f"{where}: {key} = {fields[key]!r}: {expected}") from None
