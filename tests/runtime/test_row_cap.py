"""A layout whose dispatch buffers are sized once (DeepEP low-latency, Mooncake EP:
`draft.max_rows_per_rank`) is refused when the runtime built on it can send more rows per step:
at build, naming the key, not at the first step that overflows (every rank at once, on a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from epdraft.dispatch import MoeLayout
from epdraft.errors import ConfigError
from epdraft.runtime import DraftRuntime
from epdraft.runtime.draft import _check_row_cap

TINY = Path(__file__).resolve().parents[2] / "epdraft" / "assets" / "tiny-draft"  # block size 8


def _layout(backend: str, rows: int, low_latency: bool = False) -> MoeLayout:
    return MoeLayout(layout="alltoall", backend=backend, low_latency=low_latency, max_rows_per_rank=rows, ep_size=2,
                     num_experts=8, hidden_size=128, top_k=2)  # fmt: skip


def test_build_refuses_more_requests_than_the_buffers_take():
    with pytest.raises(ConfigError, match=r"draft.max_rows_per_rank = 32: a step can send 5 requests x 8 block rows = "
                                          r"40 rows from one rank, more than the mooncake buffers take"):  # fmt: skip
        DraftRuntime.build(TINY, heads=None, groups=None, layout=_layout("mooncake", 32), max_requests=5,
                           max_context=64)  # fmt: skip


def test_under_graphs_the_largest_bucket_counts():
    """9 requests pad to the 16-request bucket: 128 rows, past a cap that 9 x 8 = 72 fits."""
    _check_row_cap(_layout("deepep", 72, low_latency=True), 9, 8, graphs=False)
    with pytest.raises(ConfigError, match=r"16 requests \(the largest CUDA-graph bucket of draft.max_requests = 9\)"):
        _check_row_cap(_layout("deepep", 72, low_latency=True), 9, 8, graphs=True)
    _check_row_cap(_layout("deepep", 128, low_latency=True), 9, 8, graphs=True)


@pytest.mark.parametrize("layout", [_layout("deepep", 8), _layout("torch_fixed", 8), _layout("torch", 8),
                                    MoeLayout.local(8, 128, 2)])  # fmt: skip
def test_layouts_without_fixed_buffers_take_any_count(layout):
    assert layout.row_cap is None
    _check_row_cap(layout, 64, 8, graphs=True)


def test_only_fixed_buffer_backends_cap_a_steps_rows():
    assert _layout("deepep", 0).row_cap is None  # normal kernels: any count, in chunks
    assert _layout("deepep", 64, low_latency=True).row_cap == 64
    assert _layout("mooncake", 64).row_cap == 64
    assert _layout("torch", 64).row_cap is None
