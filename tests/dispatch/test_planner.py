"""choose_layout picks from its estimates, respects the memory budget; `epdraft plan` prints the choice."""

from __future__ import annotations

import pytest

from epdraft.cli import main as cli_main
from epdraft.config.ffn import DraftMoeFFNSpec, RouterSpec
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.dispatch.planner import GIB, LINKS, choose_layout
from epdraft.errors import ConfigError

FIXTURES = "tests/fixtures/configs"


def _draft(num_experts: int, intermediate: int, hidden: int, layers: int = 2) -> DraftMixFFNSpec:
    moe = DraftMoeFFNSpec(router=RouterSpec(num_experts=num_experts, top_k=2), intermediate_size=intermediate)
    return DraftMixFFNSpec(family="test", hidden_size=hidden, layers=(moe,) * layers)


def test_small_experts_over_tcp_stay_replicated():
    choice = choose_layout(
        _draft(8, 256, 512), ep=4, tp=1, rows_per_rank=8, link=LINKS["tcp"], mem_bw_gbps=4800, memory_budget_bytes=GIB
    )
    assert choice.layout == "replicated"
    assert choice.estimates[0].comm_us == 0 and choice.reason.startswith("replicated: ")
    assert {e.label for e in choice.estimates} == {"replicated", "alltoall", "gather (max_len)", "gather (sum_len)"}


def test_large_experts_on_nvlink_are_sharded_and_memory_rules_out_replicated():
    draft = _draft(256, 2048, 4096)
    budget = 4 * GIB  # 256 x 3 x 2048 x 4096 x 2 B = 12 GiB per layer replicated
    choice = choose_layout(draft, ep=8, tp=1, rows_per_rank=64, link=LINKS["nvlink"], mem_bw_gbps=4800, memory_budget_bytes=budget)
    assert choice.layout in ("alltoall", "gather")
    replicated = next(e for e in choice.estimates if e.layout == "replicated")
    assert not replicated.fits and replicated.expert_bytes_per_rank == 2 * 12 * GIB
    assert "replicated over the 4.0 GiB expert budget" in choice.reason
    assert choice.estimates[0].expert_bytes_per_rank == 2 * 12 * GIB // 8


def test_alltoall_is_not_a_candidate_under_moe_tp():
    choice = choose_layout(
        _draft(8, 512, 256), ep=1, tp=2, rows_per_rank=4, link=LINKS["tcp"], mem_bw_gbps=20, memory_budget_bytes=GIB
    )
    assert "alltoall" not in {e.layout for e in choice.estimates}


def test_nothing_fits_names_the_split_and_budget():
    with pytest.raises(ConfigError, match=r"draft.moe_ep = 2, draft.moe_tp = 1: the smallest expert shard needs 0.4 GiB per rank, over the 0.2 GiB budget"):
        choose_layout(
            _draft(8, 4096, 4096, layers=1), ep=2, tp=1, rows_per_rank=4, link=LINKS["ib"], mem_bw_gbps=4800,
            memory_budget_bytes=GIB // 4,
        )


def test_plan_command_prints_choice_and_estimates(capsys):
    rc = cli_main(["plan", "configs/h200x8-dp8-ep8.toml", f"{FIXTURES}/deepseek-v4-flash-dspark-moe.json"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "link nvlink: 370 GB/s, 25 us per collective" in out
    assert "\nchoice: " in out and "\nwhy: " in out
    for label in ("replicated", "alltoall", "gather (max_len)", "gather (sum_len)"):
        assert f"\n{label}" in out


def test_plan_says_why_it_disagrees_with_the_config(capsys):
    assert cli_main(["plan", "configs/local-cpu-2.toml", "epdraft/assets/tiny-draft"]) == 0
    note = capsys.readouterr().out.strip().splitlines()[-1]
    assert note.startswith("note: the config asks for 'alltoall'; the estimates favour 'replicated': "
                           "alltoall spends "), note
    assert "us/step moving rows, replicated 0.0 us, more than its sharded experts save" in note, note


def _fp4_draft(layers: int = 2) -> DraftMixFFNSpec:
    from epdraft.config.quant import QuantSpec

    q = QuantSpec(method="fp8", block=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4")  # DeepSeek-V4's release
    moe = DraftMoeFFNSpec(router=RouterSpec(num_experts=256, top_k=2), intermediate_size=2048, quantization=q)
    return DraftMixFFNSpec(family="test", hidden_size=4096, layers=(moe,) * layers, quantization=q)


def test_quantized_experts_count_their_stored_bytes_where_the_kernels_keep_them():
    weights = 256 * 3 * 2048 * 4096  # one layer's routed expert weights
    kw = dict(rows_per_rank=64, link=LINKS["nvlink"], mem_bw_gbps=4800, memory_budget_bytes=64 * GIB)

    def replicated(choice):
        return next(e for e in choice.estimates if e.layout == "replicated")

    on_gpu = replicated(choose_layout(_fp4_draft(), ep=8, tp=1, device="cuda", **kw))
    assert on_gpu.expert_bytes_per_rank == 2 * int(weights * 4.25 / 8)  # e2m1 + an e8m0 scale per 32, not bf16
    on_cpu = replicated(choose_layout(_fp4_draft(), ep=8, tp=1, device="cpu", **kw))
    assert on_cpu.expert_bytes_per_rank == 2 * weights * 2  # dequantized at load on CPU
    assert on_cpu.experts_us == pytest.approx(on_gpu.experts_us * 2 / (4.25 / 8))
    sliced = choose_layout(_fp4_draft(), ep=4, tp=2, device="cuda", **kw)
    gather = next(e for e in sliced.estimates if e.layout == "gather")
    assert gather.expert_bytes_per_rank == 2 * (weights // 8) * 2  # moe_tp slices are dequantized at load
    assert replicated(sliced).expert_bytes_per_rank == on_gpu.expert_bytes_per_rank  # whole experts stay FP4


def test_plan_names_how_quantized_experts_are_counted(capsys):
    assert cli_main(["plan", "configs/h200x8-dp8-ep8.toml", f"{FIXTURES}/deepseek-v4-flash.json",
                     "--memory-gib", "64"]) == 0  # fmt: skip
    assert "experts: quantized experts held as stored: 4.25 bits a weight (mxfp4)" in capsys.readouterr().out


@pytest.mark.parametrize("device,tp,swiglu_oai,intermediate", [
    ("cuda", 1, False, 2048), ("cpu", 1, False, 2048), ("cuda", 2, False, 2048), ("cuda", 1, True, 2048),
    ("cuda", 1, False, 2080),
])  # fmt: skip
def test_the_planner_keeps_quantized_experts_where_the_runtime_does(device, tp, swiglu_oai, intermediate):
    import msgspec
    import torch

    from epdraft.config.ffn import ActivationSpec
    from epdraft.dispatch.planner import expert_weight_bytes
    from epdraft.layers.step_kernels import quantized_experts_reason

    spec = _fp4_draft()
    moe = spec.layers[0]
    moe = msgspec.structs.replace(moe, intermediate_size=intermediate,
                                  activation=ActivationSpec(kind="swigluoai") if swiglu_oai else moe.activation)
    spec = msgspec.structs.replace(spec, layers=(moe, moe))
    kept = quantized_experts_reason(spec, tp_size=tp, device_type=device, dtype=torch.bfloat16) is None
    assert (expert_weight_bytes(spec, tp=tp, device=device, dtype_bytes=2)[0] < 2) == kept
