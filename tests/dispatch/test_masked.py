"""The GPU adapters' shared row helpers, on CPU: idle-rank padding and fixed-buffer rows."""

from __future__ import annotations

import torch

from epdraft.dispatch.masked import masked_rows, pad_idle


def test_pad_idle_sends_one_row_routed_nowhere():
    x, ids, w = pad_idle(torch.zeros(0, 4, dtype=torch.bfloat16), torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, 3), torch.int32)
    assert x.shape == (1, 4) and x.dtype == torch.bfloat16 and not x.any()
    assert ids.dtype == torch.int32 and ids.tolist() == [[-1, -1, -1]]
    assert w.tolist() == [[0.0, 0.0, 0.0]]


def test_pad_idle_keeps_real_rows():
    x_in, ids_in = torch.randn(2, 4), torch.tensor([[0, 5], [3, 1]])
    x, ids, w = pad_idle(x_in, ids_in, torch.rand(2, 2, dtype=torch.float64), torch.int64)
    assert x is x_in and ids.tolist() == ids_in.tolist() and w.dtype == torch.float32


def test_masked_rows_marks_unused_slots():
    recv_x = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)
    rows, ids, w = masked_rows(recv_x, torch.tensor([2, 0], dtype=torch.int32))
    assert rows.shape == (6, 2) and torch.equal(rows[4], recv_x[1, 1])
    assert ids.flatten().tolist() == [0, 0, -1, -1, -1, -1]
    assert w.flatten().tolist() == [1.0] * 6
