"""QuantizedSource: quantized exports load to the dequantized modules, per expert and fused, EP/TP-sharded
(a rank reads only its experts' blocks and scales), and malformed ones are refused naming the tensor."""

from __future__ import annotations

import re

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from epdraft.config.ffn import ActivationSpec, DraftMoeFFNSpec, RouterSpec
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.config.quant import QuantSpec, parse_quantization_config
from epdraft.errors import ConfigError, LoadError
from epdraft.layers import DraftMoE
from epdraft.layers.step_kernels import StepKernels, quantized_experts_reason
from epdraft.loading import QuantizedSource, load_ffn, open_checkpoint
from epdraft.loading.quant import dequantize_fp8, dequantize_weights, quantize_fp8, quantize_mxfp4
from tests.stubs import LocalIdsDispatcher, shard_layout
from tests.test_loading import CountingSource

mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

E, H, LAYER = 8, 64, 2
SIZES = {"mxfp4": 32, "fp8": 40}  # I; fp8 with 16 x 32 blocks: partial row and column blocks
SPECS = {"mxfp4": QuantSpec(method="mxfp4", block=(1, 32), not_converted=("mlp.gate",)),
         "fp8": QuantSpec(method="fp8", block=(16, 32), not_converted=("mlp.gate",))}
P = f"model.layers.{LAYER}.mlp."


def _moe_spec(I, oss=False):
    if oss:
        return DraftMoeFFNSpec(router=RouterSpec(num_experts=E, top_k=2, scoring="softmax_topk", bias="logit"),
                               intermediate_size=I, activation=ActivationSpec(kind="swigluoai", limit=7.0),
                               expert_bias=True)
    return DraftMoeFFNSpec(router=RouterSpec(num_experts=E, top_k=2), intermediate_size=I)


def _quantize(fmt, name, w):
    """{stored name: tensor} of `w` quantized, and `w` as the format's dequantization gives it back."""
    if fmt == "mxfp4":
        blocks, scales = quantize_mxfp4(w)
        lead = blocks if blocks.dim() == 4 else blocks.unsqueeze(0)
        # the independent reference: transformers' dequantizer ([E, N, G, 16] -> [E, K, N])
        deq = mxfp4.convert_moe_packed_tensors(lead, scales.reshape(lead.shape[:-1]), dtype=torch.float32)
        deq = deq.transpose(1, 2).reshape(w.shape)
        return {f"{name}_blocks": blocks, f"{name}_scales": scales}, deq
    q, scale = quantize_fp8(w, SPECS["fp8"].block)
    return {name: q, f"{name}_scale_inv": scale}, dequantize_fp8(q, scale, SPECS["fp8"].block, torch.float32)


def _checkpoint(fmt, layout, seed=0, I=None):
    """(quantized tensors, dequantized gate [E, I, H], up, down [E, H, I], router [E, H])."""
    I = I or SIZES[fmt]
    gen = torch.Generator().manual_seed(seed)
    gate, up, down = torch.randn(E, I, H, generator=gen), torch.randn(E, I, H, generator=gen), torch.randn(E, H, I,
                                                                                                          generator=gen)
    router = torch.randn(E, H, generator=gen)
    tensors = {P + "gate.weight": router}
    if layout == "fused":
        q, gate_up = _quantize(fmt, P + "experts.gate_up_proj", torch.cat([gate, up], 1))
        tensors |= q
        q, down = _quantize(fmt, P + "experts.down_proj", down)
        tensors |= q
        gate, up = gate_up[:, :I], gate_up[:, I:]
    else:
        deq = {"gate": [], "up": [], "down": []}
        for e in range(E):
            for part, w in (("gate", gate[e]), ("up", up[e]), ("down", down[e])):
                q, d = _quantize(fmt, f"{P}experts.{e}.{part}_proj.weight", w)
                tensors |= q
                deq[part].append(d)
        gate, up, down = (torch.stack(deq[p]) for p in ("gate", "up", "down"))
    return tensors, gate, up, down, router


def _save(tensors, path):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def _sharded(spec, kernels=None, **shard):
    """The DraftMoE of one rank's shard, without any process group."""
    return DraftMoE(spec, H, layer_id=LAYER, dispatcher=LocalIdsDispatcher(shard_layout(spec, H, **shard)),
                    kernels=kernels)


def _load(fmt, source, oss=False, **shard):
    module = _sharded(_moe_spec(SIZES[fmt], oss), **shard)
    load_ffn(module, QuantizedSource(source, SPECS[fmt], torch.float32, transposed_stacked=oss), LAYER)
    return module


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("ep_rank", [0, 3])
def test_ep_rank_reads_only_its_experts_blocks_and_scales(tmp_path, fmt, layout, ep_rank):
    tensors, gate, up, down, router = _checkpoint(fmt, layout)
    source = CountingSource(open_checkpoint(_save(tensors, tmp_path / "q.safetensors")))
    module = _load(fmt, source, ep_rank=ep_rank, ep_size=4)
    e = E // 4
    mine = slice(ep_rank * e, (ep_rank + 1) * e)
    assert torch.equal(module.experts.w13, torch.cat([gate[mine], up[mine]], 1))
    assert torch.equal(module.experts.w2, down[mine])
    assert torch.equal(module.router.weight, router)
    expert_reads = [(n, idx, b) for n, idx, b in source.reads if ".experts." in n]
    for name, index, _ in expert_reads:
        m = re.search(r"experts\.(\d+)\.", name)
        if m:
            assert mine.start <= int(m.group(1)) < mine.stop, name
        else:
            assert index[0] == mine, (name, index)
    # exactly this rank's share of the stored values; of the scales too, but for a block row that the
    # gate and up halves of a fused fp8 tensor share (I = 40 is not a multiple of 16): read by both
    def share(kind):
        stored = sum(t.numel() * t.element_size() for n, t in tensors.items() if ".experts." in n and _is(n, kind))
        read = sum(b for n, _, b in expert_reads if _is(n, kind))
        return read, stored // 4

    read, mine_bytes = share("values")
    assert read == mine_bytes
    read, mine_bytes = share("scales")
    shared_rows = E // 4 * 2 * 4 if (fmt, layout) == ("fp8", "fused") else 0  # e experts x 2 column blocks x fp32
    assert read == mine_bytes + shared_rows


def _is(name, kind):
    return name.endswith(("_scales", "_scale_inv")) == (kind == "scales")


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_moe_tp_slice_of_a_quantized_checkpoint(tmp_path, fmt, tp_rank):
    tensors, gate, up, down, _ = _checkpoint(fmt, "fused")
    module = _load(fmt, open_checkpoint(_save(tensors, tmp_path / "q.safetensors")), tp_rank=tp_rank, tp_size=2)
    F = SIZES[fmt] // 2
    cols = slice(tp_rank * F, (tp_rank + 1) * F)
    assert torch.equal(module.experts.w13, torch.cat([gate[:, cols], up[:, cols]], 1))
    assert torch.equal(module.experts.w2, down[:, :, cols])


def test_gpt_oss_fused_mxfp4_reads_transposed_as_transformers_dequantizes(tmp_path):
    """gate_up_proj_blocks [E, 2I, H/32, 16], gate/up interleaved: the same module as the bf16 gpt-oss export."""
    I = SIZES["mxfp4"]
    gen = torch.Generator().manual_seed(4)
    stored = {P + "router.weight": torch.randn(E, H, generator=gen), P + "router.bias": torch.randn(E, generator=gen),
              P + "experts.gate_up_proj_bias": torch.randn(E, 2 * I, generator=gen),
              P + "experts.down_proj_bias": torch.randn(E, H, generator=gen)}
    plain = dict(stored)
    for name, rows, k in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
        blocks, scales = quantize_mxfp4(torch.randn(E, rows, k, generator=gen))
        stored |= {f"{P}experts.{name}_blocks": blocks, f"{P}experts.{name}_scales": scales}
        plain[f"{P}experts.{name}"] = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    oss = QuantSpec(method="mxfp4", block=(1, 32), not_converted=("router",))
    quantized = DraftMoE(_moe_spec(I, oss=True), H, layer_id=LAYER)
    load_ffn(quantized, QuantizedSource(open_checkpoint(_save(stored, tmp_path / "q.safetensors")), oss,
                                        torch.float32, transposed_stacked=True), LAYER)
    reference = DraftMoE(_moe_spec(I, oss=True), H, layer_id=LAYER)
    load_ffn(reference, plain, LAYER)
    for (name, a), (_, b) in zip(quantized.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name


def _refused(tensors, fmt, *needles, spec=None):
    with pytest.raises(LoadError) as info:
        source = QuantizedSource(tensors, spec or SPECS[fmt], torch.float32, transposed_stacked=False)
        _load_dict(fmt, source)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def _load_dict(fmt, source):
    module = DraftMoE(_moe_spec(SIZES[fmt]), H, layer_id=LAYER)
    load_ffn(module, source, LAYER)


@pytest.fixture(scope="module")
def quantized():
    return {fmt: _checkpoint(fmt, "per-expert")[0] for fmt in SIZES}


def test_missing_scales_are_refused_naming_the_tensor(quantized):
    name = f"{P}experts.3.up_proj.weight"
    mx = {k: v for k, v in quantized["mxfp4"].items() if k != name + "_scales"}
    _refused(mx, "mxfp4", name + "_blocks", "missing scales")
    fp8 = {k: v for k, v in quantized["fp8"].items() if k != name + "_scale_inv"}
    _refused(fp8, "fp8", name, "float8_e4m3fn", "missing fp8 scales")
    orphan = {k: v for k, v in quantized["fp8"].items() if k != name}
    _refused(orphan, "fp8", name + "_scale_inv", "without their weight")


def test_bad_scales_shape_is_refused_naming_the_tensor(quantized):
    name = f"{P}experts.5.down_proj.weight"
    mx = dict(quantized["mxfp4"])
    mx[name + "_scales"] = mx[name + "_scales"][:, :-1]
    _refused(mx, "mxfp4", name + "_scales", "bad scales shape", "[64, 0]")
    fp8 = dict(quantized["fp8"])
    fp8[name + "_scale_inv"] = torch.ones(4, 1)  # K = 40 needs ceil(40 / 32) = 2 column blocks
    _refused(fp8, "fp8", name + "_scale_inv", "bad scales shape", "expected [4, 2]")


def test_modules_to_not_convert_are_honoured(quantized):
    """The router (listed) reads as stored; a listed module stored quantized is refused."""
    tensors = dict(quantized["mxfp4"])
    module = DraftMoE(_moe_spec(SIZES["mxfp4"]), H, layer_id=LAYER)
    load_ffn(module, QuantizedSource(tensors, SPECS["mxfp4"], torch.float32, transposed_stacked=False), LAYER)
    assert torch.equal(module.router.weight, tensors[P + "gate.weight"])
    blocks, scales = quantize_mxfp4(tensors.pop(P + "gate.weight"))
    tensors |= {P + "gate.weight_blocks": blocks, P + "gate.weight_scales": scales}
    _refused(tensors, "mxfp4", P + "gate.weight_blocks", "modules_to_not_convert")
    listed = QuantSpec(method="mxfp4", block=(1, 32), not_converted=("model.layers.*.mlp.experts",))
    _refused(dict(quantized["mxfp4"]), "mxfp4", "experts.0.down_proj.weight_blocks", spec=listed)


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"quant_method": "awq"}, "quantization_config.quant_method = 'awq': unknown quantization"),
        ({"quant_method": "fp8"}, "quantization_config.weight_block_size is missing"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size = [128]"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "int4"}, "expert_dtype = 'int4'"),
        ({"quant_method": "mxfp4", "group_size": 16}, "unknown key(s) ['group_size']"),
        ({"quant_method": "mxfp4", "modules_to_not_convert": "router"}, "modules_to_not_convert = 'router'"),
    ],
)
def test_quantization_config_refusals_name_the_key(raw, needle):
    with pytest.raises(ConfigError) as info:
        parse_quantization_config(raw)
    assert needle in str(info.value)


def test_quantization_config_parses_both_formats():
    fp8 = parse_quantization_config({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]})
    assert fp8 == QuantSpec(method="fp8", block=(128, 128), not_converted=("lm_head",))
    mx = parse_quantization_config({"quant_method": "mxfp4", "modules_to_not_convert":
                                    ["model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head"]})
    assert mx.block == (1, 32) and mx.bits_per_weight == 4.25
    assert not mx.converts("model.layers.7.mlp.router") and not mx.converts("layers.7.self_attn.q_proj")
    assert mx.converts("model.layers.7.mlp.experts") and mx.converts("model.layers.7.mlp.router_x")


# Layers keep their quantized experts as StepKernels resolve on CUDA with bf16 (computing here on their dequantization)
HELD = StepKernels(quantized_experts=True)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("ep_rank", [0, 1])
def test_experts_held_quantized_read_only_their_stored_blocks(tmp_path, fmt, layout, ep_rank):
    """Where the fused kernels run them, experts keep the stored values and scales (this rank's only)
    and compute what the dequantized experts compute."""
    I = 64  # fp8 16 x 32 blocks: the gate/up boundary on a scale row
    tensors, *_ = _checkpoint(fmt, layout, seed=3, I=I)
    path = _save(tensors, tmp_path / "q.safetensors")
    spec = msgspec.structs.replace(_moe_spec(I), quantization=SPECS[fmt])
    source = CountingSource(open_checkpoint(path))
    held = _sharded(spec, HELD, ep_rank=ep_rank, ep_size=2)
    load_ffn(held, QuantizedSource(source, SPECS[fmt], torch.float32, transposed_stacked=False), LAYER)
    assert held.experts.quantization == SPECS[fmt]
    assert held.experts.w13.dtype == (torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn)
    stored = sum(t.numel() * t.element_size() for n, t in tensors.items() if ".experts." in n)
    assert sum(b for n, _, b in source.reads if ".experts." in n) == stored // 2
    plain = _sharded(_moe_spec(I), ep_rank=ep_rank, ep_size=2)
    load_ffn(plain, QuantizedSource(open_checkpoint(path), SPECS[fmt], torch.float32, transposed_stacked=False), LAYER)
    w13, w2 = held.experts.weights()
    assert torch.equal(dequantize_weights(w13, torch.float32), plain.experts.w13)
    assert torch.equal(dequantize_weights(w2, torch.float32), plain.experts.w2)
    gen = torch.Generator().manual_seed(9)
    rows, ids = torch.randn(5, H, generator=gen), torch.randint(-1, E // 2, (5, 2), generator=gen)
    weights = torch.rand(5, 2, generator=gen)
    assert torch.equal(held.experts(rows, ids, weights), plain.experts(rows, ids, weights))


def test_held_quantized_experts_refuse_an_unquantized_tensor(quantized):
    tensors = dict(quantized["mxfp4"])
    name = f"{P}experts.2.gate_proj.weight"
    tensors.pop(name + "_blocks"), tensors.pop(name + "_scales")
    tensors[name] = torch.zeros(SIZES["mxfp4"], H)
    spec = msgspec.structs.replace(_moe_spec(SIZES["mxfp4"]), quantization=SPECS["mxfp4"])
    module = DraftMoE(spec, H, layer_id=LAYER, kernels=HELD)
    with pytest.raises(LoadError, match=re.escape(f"{name}: the layer's experts are mxfp4") + ".*stored unquantized"):
        load_ffn(module, QuantizedSource(tensors, SPECS["mxfp4"], torch.float32, transposed_stacked=False), LAYER)


def test_where_experts_stay_quantized():
    """CUDA + bf16 + whole experts + kernel-friendly sizes keep them; anything else dequantizes, saying why."""
    def reason(layer, hidden=1024, **kw):
        ffn = DraftMixFFNSpec(family="moe", hidden_size=hidden, layers=(layer,), quantization=layer.quantization)
        return quantized_experts_reason(ffn, **{**dict(tp_size=1, device_type="cuda", dtype=torch.bfloat16), **kw})

    spec = msgspec.structs.replace(_moe_spec(512), quantization=SPECS["mxfp4"])
    assert reason(spec) is None
    assert "here cpu, float32" in reason(spec, device_type="cpu", dtype=torch.float32)
    assert "moe_tp = 2" in reason(spec, tp_size=2)
    assert "multiples of 64" in reason(spec, hidden=1000)
    fp8 = msgspec.structs.replace(spec, quantization=QuantSpec(method="fp8", block=(128, 128)))
    assert reason(fp8) is None
    assert "I % 128" in reason(msgspec.structs.replace(fp8, intermediate_size=192))
    oss = msgspec.structs.replace(_moe_spec(512, oss=True), quantization=SPECS["mxfp4"])
    assert "gpt-oss" in reason(oss)
    assert reason(_moe_spec(512)) == "unquantized"
def test_quantized_tensors_without_a_quantization_config_are_refused(quantized):
    """No QuantizedSource (config.json without quantization_config): never read blocks or fp8 values as weights."""
    for fmt, suffix in (("mxfp4", "_blocks"), ("fp8", "_scale_inv")):
        module = DraftMoE(_moe_spec(SIZES[fmt]), H, layer_id=LAYER)
        with pytest.raises(LoadError, match=re.escape(suffix) + ": a quantized tensor, but the config has no "
                                                                  "quantization_config"):
            load_ffn(module, quantized[fmt], LAYER)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("kernels", [None, HELD], ids=["dequantized", "held"])
def test_load_weights_of_a_quantized_layer_takes_the_raw_tensors(fmt, kernels):
    """A layer built from a quantized spec takes the checkpoint's tensors as a plain dict (as an engine hands them
    over) and loads what it loads from the same tensors wrapped in a QuantizedSource."""
    I = 64
    tensors, *_ = _checkpoint(fmt, "per-expert", seed=4, I=I)
    spec = msgspec.structs.replace(_moe_spec(I), quantization=SPECS[fmt])
    raw, wrapped = _sharded(spec, kernels, ep_rank=1, ep_size=2), _sharded(spec, kernels, ep_rank=1, ep_size=2)
    consumed = raw.load_weights(tensors)
    raw.check_loaded()
    load_ffn(wrapped, QuantizedSource(tensors, SPECS[fmt], torch.float32, transposed_stacked=False), LAYER)
    assert consumed == {re.sub(r"_(blocks|scales|scale_inv)$", "", n) for n in tensors
                        if not n.endswith(("_scales", "_scale_inv"))}
    for (name, a), (_, b) in zip(raw.state_dict().items(), wrapped.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_load_weights_of_a_quantized_dense_mlp_takes_the_raw_tensors():
    """A dense layer of a quantized checkpoint (DeepSeek-V3's first layers, fp8) takes its raw tensors too."""
    from epdraft.layers import DraftMLP

    gen = torch.Generator().manual_seed(6)
    tensors, want = {}, {}
    for part, shape in (("gate_proj", (40, H)), ("up_proj", (40, H)), ("down_proj", (H, 40))):
        q, d = _quantize("fp8", f"{P}{part}.weight", torch.randn(*shape, generator=gen))
        tensors |= q
        want[part] = d
    mlp = DraftMLP(H, 40, layer_id=LAYER, dtype=torch.float32, quantization=SPECS["fp8"])
    assert mlp.load_weights(tensors) == {f"{P}{part}.weight" for part in want}
    mlp.check_loaded()
    for part, w in want.items():
        assert torch.equal(getattr(mlp, part).weight, w), part
    with pytest.raises(LoadError, match=re.escape(f"{P}gate_proj.weight_scale_inv: a quantized tensor")):
        DraftMLP(H, 40, layer_id=LAYER, dtype=torch.float32).load_weights(tensors)
