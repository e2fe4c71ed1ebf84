"""SamplingParams: the defaults are greedy; a bad value is refused naming where, the field and the
value, and nothing is clamped."""

from __future__ import annotations

import pytest

from epdraft.config.sampling import SamplingParams, parse_sampling
from epdraft.errors import ConfigError


def test_defaults_are_greedy_without_a_seed():
    params = parse_sampling({}, "prompts.jsonl:1")
    assert params == SamplingParams() and params.greedy and params.seed is None
    sampled = parse_sampling({"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3}, "x")
    assert (sampled.temperature, sampled.top_k, sampled.top_p, sampled.seed, sampled.greedy) == (0.7, 5, 0.9, 3, False)


@pytest.mark.parametrize("fields, message", [
    ({"temperature": -0.5}, "prompts.jsonl:3: temperature = -0.5: expected `float` >= 0.0"),
    ({"top_p": 1.5}, "prompts.jsonl:3: top_p = 1.5: expected `float` <= 1.0"),
    ({"top_p": 0}, "prompts.jsonl:3: top_p = 0: expected `float` > 0.0"),
    ({"top_k": 0}, "prompts.jsonl:3: top_k = 0: expected `int` >= 1"),
    ({"seed": 1.5}, "prompts.jsonl:3: seed = 1.5: expected `int | null`, got `float`"),
    ({"seed": True}, "prompts.jsonl:3: seed = True: expected `int | null`, got `bool`"),
    ({"seed": -1}, "prompts.jsonl:3: seed = -1: expected `int` >= 0"),
    ({"temperature": "hot"}, "prompts.jsonl:3: temperature = 'hot': expected `float`, got `str`"),
    ({"topk": 5}, "prompts.jsonl:3: Object contains unknown field topk"),
])  # fmt: skip
def test_bad_values_are_refused_naming_the_field(fields, message):
    with pytest.raises(ConfigError) as e:
        parse_sampling(fields, "prompts.jsonl:3")
    assert str(e.value) == message
