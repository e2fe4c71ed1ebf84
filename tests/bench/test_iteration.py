"""`epdraft bench iteration` without a GPU: what the commit adds to the step's floor, counted from a
tiny draft's tensors independently of the bench's arithmetic; the plot of saved iteration rows;
the refusal to time without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from epdraft.bench.iteration import commit_cost
from epdraft.cli import main
from tests.models.test_deepseek_dspark import make_draft
from tests.models.test_write_context import _tiny_dflash


@pytest.mark.parametrize("family", ["dflash", "dspark_v4"])
def test_commit_cost_counts_the_projection_the_rows_and_their_pool_writes(family):
    draft = _tiny_dflash() if family == "dflash" else make_draft()
    pool = draft.new_pool(max_requests=2, max_context=16)
    spec, rows = draft.spec, 7
    fc = draft.main_proj if family == "dspark_v4" else draft.fc
    width = spec.num_target_features * spec.hidden_size
    if family == "dflash":
        kv = [w for layer in draft.layers for w in (layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight)]
        written = sum(2 * k.shape[1] * k.shape[3] for k in pool.k) * 4  # K and V rows of every layer, fp32
    else:
        kv = [layer.attn.kv_proj.weight for layer in draft.layers]
        written = spec.num_layers * spec.head_dim * 4
    # What a commit of 7 rows moves: fc's weight (+ its norm's), the features read, the K/V rows written.
    fc_bytes = sum(p.numel() * 4 for p in fc.parameters())
    nbytes, flops = commit_cost(draft, pool, rows)
    assert nbytes == fc_bytes + rows * (width * 4 + written)
    assert flops == 2 * rows * (fc.weight.numel() + sum(w.numel() for w in kv))


def test_iteration_plot_from_saved_rows(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [dict(kind="iteration", preset="issue13", requests=n, context=1024, graph_ms=1.0 + n / 64, floor_ms=0.5,
                 device="NVIDIA H200") for n in (1, 8, 64)]  # fmt: skip
    rows.append(dict(kind="step", preset="issue13", requests=1, context=1024, graph_ms=9.0, floor_ms=0.4))
    saved, out = tmp_path / "iteration.jsonl", tmp_path / "iteration.png"
    saved.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["bench", "iteration", "--from-json", str(saved), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved.write_text(json.dumps(rows[-1]) + "\n")  # step rows only: nothing of this bench to draw
    assert main(["bench", "iteration", "--from-json", str(saved), "--plot", str(out)]) == 2
    assert "no iteration results to draw" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_iteration_needs_cuda(capsys):
    assert main(["bench", "iteration", "--requests", "1"]) == 2
    assert "epdraft bench iteration times the GPU iteration: it needs CUDA" in capsys.readouterr().err
