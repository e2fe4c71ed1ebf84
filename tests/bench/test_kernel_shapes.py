"""`bench kernel`'s V41F shape is DeepSeek-V4.1-Flash's draft experts as the step bench's preset has them."""

from __future__ import annotations

from epdraft.bench.kernel import SHAPES
from epdraft.bench.step import DSPARK_PRESETS


def test_v41f_shape_is_the_v41_flash_preset_experts():
    preset = DSPARK_PRESETS["v41-flash"]
    expected = (preset["n_routed_experts"], preset["moe_intermediate_size"], preset["hidden_size"],
                preset["num_experts_per_tok"])
    assert SHAPES["V41F"] == expected == (128, 2304, 4096, 3)
