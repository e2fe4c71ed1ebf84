"""epdraft.loading: every export naming loads to the same module; strict errors; EP/TP reads only their share."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from epdraft.config.ffn import ActivationSpec, DraftMoeFFNSpec, RouterSpec
from epdraft.errors import LoadError
from epdraft.layers import DraftMLP, DraftMoE
from epdraft.loading import load_ffn, open_checkpoint
from tests.stubs import LocalIdsDispatcher, shard_layout

E, I, H, S, LAYER = 8, 16, 32, 24, 3

SPEC = DraftMoeFFNSpec(
    router=RouterSpec(num_experts=E, top_k=2, scoring="sigmoid", bias="selection", renorm_eps=1e-20),
    intermediate_size=I,
    shared_intermediate_size=S,
    shared_gate=True,
)
OSS_SPEC = DraftMoeFFNSpec(
    router=RouterSpec(num_experts=E, top_k=2, scoring="softmax_topk", bias="logit"),
    intermediate_size=I,
    activation=ActivationSpec(kind="swigluoai", limit=7.0),
    expert_bias=True,
)


@pytest.fixture(scope="module")
def weights():
    """One set of random weights in plain per-part form: gate/up [E, I, H], down [E, H, I]."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return {
        "router": rand(E, H), "router_bias": rand(E), "gate": rand(E, I, H), "up": rand(E, I, H), "down": rand(E, H, I),
        "b13_gate": rand(E, I), "b13_up": rand(E, I), "b2": rand(E, H),
        "s_gate": rand(S, H), "s_up": rand(S, H), "s_down": rand(H, S), "s_out": rand(1, H),
    }


def _per_expert(w, prefix, names):
    g, u, d = names
    out = {}
    for e in range(E):
        out |= {f"{prefix}experts.{e}.{g}.weight": w["gate"][e], f"{prefix}experts.{e}.{u}.weight": w["up"][e],
                f"{prefix}experts.{e}.{d}.weight": w["down"][e]}
    return out


def _shared(w, prefix, block, names, gate_name):
    g, u, d = names
    return {f"{prefix}{block}.{g}.weight": w["s_gate"], f"{prefix}{block}.{u}.weight": w["s_up"],
            f"{prefix}{block}.{d}.weight": w["s_down"], f"{prefix}{gate_name}": w["s_out"]}


def _router(w, prefix, bias_name):
    return {f"{prefix}gate.weight": w["router"], f"{prefix}{bias_name}": w["router_bias"]}


def _fused(w, prefix, gate_up, down):
    return {f"{prefix}experts.{gate_up}": torch.cat([w["gate"], w["up"]], dim=1), f"{prefix}experts.{down}": w["down"]}


def namings(w):
    """The same weights under every accepted naming (name -> tensors)."""
    qwen, ds = ("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")
    p = f"layers.{LAYER}.mlp."
    mp = "model." + p
    mixtral = f"model.layers.{LAYER}.block_sparse_moe."
    stacked = {"experts.w1": w["gate"], "experts.w3": w["up"], "experts.w2": w["down"]}
    return {
        "specforge_qwen": {
            **_router(w, p, "gate.bias"),
            **_per_expert(w, p, qwen),
            **_shared(w, p, "shared_expert", qwen, "shared_expert_gate.weight"),
        },
        "deepseek": {
            **_router(w, mp, "gate.e_score_correction_bias"),
            **_per_expert(w, mp, ds),
            **_shared(w, mp, "shared_experts", ds, "shared_experts.gate.weight"),
        },
        "mixtral": {
            **_router(w, mixtral, "gate.bias"),
            **_per_expert(w, mixtral, ds),
            **_shared(w, mixtral, "shared_experts", ds, "shared_expert_gate.weight"),
        },
        "stacked_relative": {
            **_router(w, "", "gate.balance.bias"),
            **stacked,
            **_shared(w, "", "shared_experts", ds, "shared_experts.gate.weight"),
        },
        "hf_v5_fused": {
            **_router(w, p, "gate.e_score_correction_bias"),
            **_fused(w, p, "gate_up_proj", "down_proj"),
            **_shared(w, p, "shared_experts", qwen, "shared_expert_gate.weight"),
        },
        "sglang_fused": {
            **_router(w, p, "gate.bias"),
            **_fused(w, p, "w13_weight", "w2_weight"),
            **_shared(w, p, "shared_expert", qwen, "shared_expert_gate.weight"),
        },
    }


def _interleave(a, b, dim):
    return torch.stack([a, b], dim=dim + 1).flatten(dim, dim + 1)


def oss_naming(w):
    p = f"model.layers.{LAYER}.mlp."
    return {p + "router.weight": w["router"], p + "router.bias": w["router_bias"],
            p + "experts.gate_up_proj": _interleave(w["gate"], w["up"], 1).transpose(1, 2).contiguous(),
            p + "experts.gate_up_proj_bias": _interleave(w["b13_gate"], w["b13_up"], 1),
            p + "experts.down_proj": w["down"].transpose(1, 2).contiguous(), p + "experts.down_proj_bias": w["b2"]}


def _save(tensors, path):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def _save_sharded(tensors, directory):
    """Two shards plus a model.safetensors.index.json, with an unrelated tensor that must be ignored."""
    directory.mkdir()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    shards["model-00001-of-00002.safetensors"].append("lm_head.weight")
    extra = {"lm_head.weight": torch.zeros(4, H)}
    weight_map = {}
    for file, keys in shards.items():
        _save({k: tensors.get(k, extra.get(k)) for k in keys}, directory / file)
        weight_map |= dict.fromkeys(keys, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def _build(spec=SPEC, **shard):
    return DraftMoE(spec, H, layer_id=LAYER, dispatcher=LocalIdsDispatcher(shard_layout(spec, H, **shard)))


def _state(module):
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def _expected_state(w, first=0, count=E, f0=0, F=I):
    ex = slice(first, first + count)
    cols = slice(f0, f0 + F)
    return {
        "router.weight": w["router"], "router.bias": w["router_bias"],
        "experts.w13": torch.cat([w["gate"][ex, cols], w["up"][ex, cols]], dim=1), "experts.w2": w["down"][ex, :, cols],
        "shared.gate_proj.weight": w["s_gate"],
        "shared.up_proj.weight": w["s_up"],
        "shared.down_proj.weight": w["s_down"],
        "shared.output_gate.weight": w["s_out"],
    }


def _assert_state(module, expected):
    state = _state(module)
    assert state.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(state[k], v), k


def test_every_naming_loads_identical_modules(weights, tmp_path):
    expected = _expected_state(weights)
    for naming, tensors in namings(weights).items():
        for kind, path in (("file", _save(tensors, tmp_path / f"{naming}.safetensors")),
                           ("sharded", _save_sharded(tensors, tmp_path / f"{naming}_sharded"))):
            module = _build()
            consumed = load_ffn(module, open_checkpoint(path), LAYER)
            assert consumed == set(tensors), (naming, kind)
            _assert_state(module, expected)
        module = _build()
        assert module.load_weights(tensors) == set(tensors)  # a plain dict works too
        module.check_loaded()
        _assert_state(module, expected)


def test_other_layers_are_ignored(weights):
    tensors = namings(weights)["specforge_qwen"]
    module = DraftMoE(SPEC, H, layer_id=LAYER + 1)
    assert module.load_weights(tensors) == set()
    with pytest.raises(LoadError, match=rf"layers\.{LAYER + 1}\.mlp\.gate\.weight"):
        module.check_loaded()


def test_gpt_oss_layout_equals_per_expert_names(weights, tmp_path):
    oss = _build(OSS_SPEC)
    load_ffn(oss, open_checkpoint(_save(oss_naming(weights), tmp_path / "oss.safetensors")), LAYER)
    plain = _build(OSS_SPEC)
    biases = {k: v for k, v in oss_naming(weights).items() if "bias" in k}
    per_expert = _per_expert(weights, "", ("w1", "w3", "w2"))
    load_ffn(plain, {**per_expert, "router.weight": weights["router"], **biases}, LAYER)
    for k, v in _state(plain).items():
        assert torch.equal(_state(oss)[k], v), k
    assert torch.equal(_state(oss)["experts.b13"], torch.cat([weights["b13_gate"], weights["b13_up"]], dim=1))


def test_missing_expert_tensors_are_all_named(weights):
    tensors = dict(namings(weights)["deepseek"])
    del tensors[f"model.layers.{LAYER}.mlp.experts.5.w3.weight"]
    del tensors[f"model.layers.{LAYER}.mlp.shared_experts.gate.weight"]
    module = _build()
    module.load_weights(tensors)
    with pytest.raises(LoadError) as err:
        module.check_loaded()
    message = str(err.value)
    assert "2 tensor(s) missing" in message
    assert f"layers.{LAYER}.mlp.experts.5.up_proj.weight" in message
    assert f"layers.{LAYER}.mlp.shared_expert_gate.weight" in message


def test_wrong_shape_names_tensor_and_both_shapes(weights, tmp_path):
    tensors = dict(namings(weights)["deepseek"])
    name = f"model.layers.{LAYER}.mlp.experts.3.w1.weight"
    tensors[name] = torch.zeros(I + 1, H)
    with pytest.raises(LoadError) as err:
        load_ffn(_build(), open_checkpoint(_save(tensors, tmp_path / "bad.safetensors")), LAYER)
    assert name in str(err.value) and f"[{I}, {H}]" in str(err.value) and f"[{I + 1}, {H}]" in str(err.value)


class CountingSource:
    """Wraps a TensorSource and records every read: (name, index, bytes)."""

    def __init__(self, inner):
        self.inner, self.reads = inner, []

    def keys(self):
        return self.inner.keys()

    def shape(self, name):
        return self.inner.shape(name)

    def get(self, name, index=()):
        tensor = self.inner.get(name, index)
        self.reads.append((name, index, tensor.numel() * tensor.element_size()))
        return tensor


@pytest.mark.parametrize("naming", ["specforge_qwen", "hf_v5_fused", "stacked_relative"])
@pytest.mark.parametrize("ep_rank", range(4))
def test_ep_rank_holds_and_reads_only_its_experts(weights, tmp_path, naming, ep_rank):
    e = E // 4
    path = _save(namings(weights)[naming], tmp_path / "ckpt.safetensors")
    source = CountingSource(open_checkpoint(path))
    module = _build(ep_rank=ep_rank, ep_size=4)
    load_ffn(module, source, LAYER)
    assert module.experts.w13.shape == (e, 2 * I, H) and module.experts.w2.shape == (e, H, I)
    _assert_state(module, _expected_state(weights, first=ep_rank * e, count=e))
    expert_reads = [(n, idx, b) for n, idx, b in source.reads if re.search(r"(^|\.)experts\.", n)]
    for name, index, _ in expert_reads:
        per_expert = re.search(r"experts\.(\d+)\.", name)
        if per_expert:
            assert ep_rank * e <= int(per_expert.group(1)) < (ep_rank + 1) * e, name
        else:
            assert index[0] == slice(ep_rank * e, (ep_rank + 1) * e), (name, index)
    assert sum(b for *_, b in expert_reads) == e * 3 * I * H * 4


@pytest.mark.parametrize("tp_rank", range(2))
def test_moe_tp_holds_and_reads_its_intermediate_slice(weights, tmp_path, tp_rank):
    F = I // 2
    source = CountingSource(open_checkpoint(_save(namings(weights)["hf_v5_fused"], tmp_path / "ckpt.safetensors")))
    module = _build(tp_rank=tp_rank, tp_size=2)
    load_ffn(module, source, LAYER)
    assert module.experts.w13.shape == (E, 2 * F, H) and module.experts.w2.shape == (E, H, F)
    _assert_state(module, _expected_state(weights, f0=tp_rank * F, F=F))
    assert sum(b for n, _, b in source.reads if ".experts." in n) == E * 3 * F * H * 4


def test_moe_tp_gpt_oss_slices_sum_to_the_full_experts(weights, tmp_path):
    """Summing the TP ranks' partial outputs (b2 only on tp_rank 0) gives the unsharded experts' output."""
    source = open_checkpoint(_save(oss_naming(weights), tmp_path / "oss.safetensors"))
    full = _build(OSS_SPEC)
    load_ffn(full, source, LAYER)
    parts = []
    for tp_rank in range(2):
        module = _build(OSS_SPEC, tp_rank=tp_rank, tp_size=2)
        load_ffn(module, source, LAYER)
        parts.append(module)
    assert not parts[1].experts.b2.any()
    gen = torch.Generator().manual_seed(1)
    x_TH = torch.randn(6, H, generator=gen)
    ids_TK = torch.randint(0, E, (6, 2), generator=gen)
    weights_TK = torch.rand(6, 2, generator=gen)
    with torch.no_grad():
        ref = full.experts(x_TH, ids_TK, weights_TK)
        summed = sum(m.experts(x_TH, ids_TK, weights_TK) for m in parts)
    torch.testing.assert_close(summed, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_dense_mlp_loads_both_namings_with_bias(names):
    gen = torch.Generator().manual_seed(2)
    g, u, d = names
    p = f"model.layers.{LAYER}.mlp."
    tensors = {p + f"{g}.weight": torch.randn(I, H, generator=gen), p + f"{u}.weight": torch.randn(I, H, generator=gen),
               p + f"{d}.weight": torch.randn(H, I, generator=gen), p + f"{g}.bias": torch.randn(I, generator=gen),
               p + f"{u}.bias": torch.randn(I, generator=gen), p + f"{d}.bias": torch.randn(H, generator=gen),
               f"model.layers.{LAYER}.self_attn.q_proj.weight": torch.zeros(H, H)}
    mlp = DraftMLP(H, I, bias=True, layer_id=LAYER)
    assert len(load_ffn(mlp, tensors, LAYER)) == 6
    assert torch.equal(mlp.gate_proj.weight, tensors[p + f"{g}.weight"])
    assert torch.equal(mlp.down_proj.bias, tensors[p + f"{d}.bias"])
    missing = DraftMLP(H, I, bias=True, layer_id=LAYER)
    missing.load_weights({k: v for k, v in tensors.items() if not k.endswith(f"{d}.bias")})
    with pytest.raises(LoadError, match=rf"layers\.{LAYER}\.mlp\.down_proj\.bias"):
        missing.check_loaded()


def test_open_checkpoint_refuses_missing_shard(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(LoadError, match="gone.safetensors"):
        open_checkpoint(tmp_path)


def test_router_bias_the_config_does_not_declare_is_refused():
    """A checkpoint's `gate.bias` with a spec that has no router bias would silently change routing."""
    from epdraft.loading import load_into

    spec = DraftMoeFFNSpec(router=RouterSpec(num_experts=4, top_k=2), intermediate_size=8)
    moe = DraftMoE(spec, 16)
    with pytest.raises(LoadError, match=r"layer 0: the checkpoint has layers\.0\.mlp\.gate\.bias"):
        load_into(moe, {"layers.0.mlp.gate.bias": torch.zeros(4)}, 0)
