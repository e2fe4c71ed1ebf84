"""Copy checkpoint tensors into FFN modules: only this rank's experts and slice, strictly checked.

The loader sees a module through three things: `named_parameters()` with canonical names (see
`epdraft.loading.names`), `expert_shard` (None for a dense MLP) and a `loaded_pieces` set it fills.
A piece is (slot, global expert or None, part); `check_ffn_loaded` compares the pieces filled with
the pieces the module needs, so a missing expert is named even when other experts came stacked.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from epdraft.errors import LoadError
from epdraft.loading.names import MLP_RULES, MOE_RULES, display_name, match, relative_name
from epdraft.loading.quant import E8M0_DTYPES, e8m0_to_float
from epdraft.loading.quantized import QuantizedSource, check_e8m0_scales, check_fp4_values, check_fp8_scale_dtype
from epdraft.loading.shard import ExpertShard
from epdraft.loading.source import TensorSource, as_source


Piece = tuple[str, int | None, str]

_QUANTIZED_SUFFIXES = ("_blocks", "_scales", "_scale_inv")
_SCALE = ".scale"

_ALL = slice(None)


def _expected_shape(form: str, part: str, shard: ExpertShard | None, param: torch.Tensor) -> tuple[int, ...]:
    if form == "whole":
        return tuple(param.shape)
    E, I, H = shard.num_experts, shard.intermediate_size, shard.hidden_size
    return {
        "expert": (H, I) if part == "down" else (I, H),
        "stacked": (E, H, I) if part == "down" else (E, I, H),
        "fused_gate_up": (E, 2 * I, H),
        "oss_gate_up": (E, H, 2 * I),
        "oss_down": (E, I, H),
        "oss_gate_up_bias": (E, 2 * I),
        "down_bias": (E, H),
    }[form]


def _copy(
    source: TensorSource,
    name: str,
    form: str,
    part: str,
    expert: int | None,
    param: torch.Tensor,
    shard: ExpertShard | None,
) -> list[tuple[int | None, str]] | None:
    """Read this rank's share of `name` into `param`; the (expert, part) pieces filled, None if none are ours."""
    if form == "whole":
        param.copy_(source.get(name))
        return [(None, "")]
    s = shard
    rows = slice(s.first, s.first + s.count)
    F_, f0 = s.slice_size, s.slice_start
    cols = slice(f0, f0 + F_)
    local = range(s.first, s.first + s.count)
    half = 0 if part in ("gate", "down") else F_  # gate rows then up rows in w13
    if form == "expert":
        if expert >= s.num_experts:
            raise LoadError(f"{name}: expert {expert} out of range, the layer has {s.num_experts} experts")
        if not s.holds(expert):
            return None
        dest = param[expert - s.first]
        if part == "down":
            dest.copy_(source.get(name, (_ALL, cols)))
        else:
            dest[half : half + F_].copy_(source.get(name, (cols,)))
        return [(expert, part)]
    if form == "stacked":
        if part == "down":
            param.copy_(source.get(name, (rows, _ALL, cols)))
        else:
            param[:, half : half + F_].copy_(source.get(name, (rows, cols)))
        return [(g, part) for g in local]
    if form == "fused_gate_up":
        I = s.intermediate_size
        param[:, :F_].copy_(source.get(name, (rows, cols)))
        param[:, F_:].copy_(source.get(name, (rows, slice(I + f0, I + f0 + F_))))
        return [(g, p) for g in local for p in ("gate", "up")]
    if form == "oss_gate_up":
        x_eHN = source.get(name, (rows, _ALL, slice(2 * f0, 2 * (f0 + F_))))
        param[:, :F_].copy_(x_eHN[..., 0::2].transpose(1, 2))
        param[:, F_:].copy_(x_eHN[..., 1::2].transpose(1, 2))
        return [(g, p) for g in local for p in ("gate", "up")]
    if form == "oss_down":
        param.copy_(source.get(name, (rows, cols)).transpose(1, 2))
        return [(g, "down") for g in local]
    if form == "oss_gate_up_bias":
        x_eN = source.get(name, (rows, slice(2 * f0, 2 * (f0 + F_))))
        param[:, :F_].copy_(x_eN[:, 0::2])
        param[:, F_:].copy_(x_eN[:, 1::2])
        return [(g, "") for g in local]
    if form == "down_bias":
        # Only TP rank 0 adds the down bias: the TP ranks' partial outputs are summed.
        if s.tp_rank == 0:
            param.copy_(source.get(name, (rows,)))
        else:
            param.zero_()
        return [(g, "") for g in local]
    raise AssertionError(f"unknown form {form!r}")


def _check_token_table(table: torch.Tensor, name: str, num_experts: int) -> None:
    """A hash layer's `tid2eid [vocab, K]` must be integer expert ids in [0, E): anything else routes
    tokens to experts that do not exist (an out-of-range gather, or a hang in the dispatch)."""
    if table.dtype.is_floating_point or table.dtype == torch.bool:
        raise LoadError(f"{name}: expected integer expert ids, found dtype {table.dtype}")
    if table.numel() and not table.is_meta and (int(table.min()) < 0 or int(table.max()) >= num_experts):
        raise LoadError(
            f"{name}: expert ids must lie in [0, {num_experts}), found [{int(table.min())}, {int(table.max())}]"
        )


def _copy_stored(
    source: TensorSource,
    name: str,
    form: str,
    part: str,
    expert: int | None,
    params: dict[str, torch.Tensor],
    slot: str,
    shard: ExpertShard,
    method: str,
    block: tuple[int, int],
) -> list[tuple[int | None, str]] | None:
    """Copy the stored (quantized) values and scales of `name` into `slot` and `slot`_scale, this rank's experts only.

    Quantized experts are held whole (moe_tp = 1) in gate-rows-first order; FP8 scale rows are
    per 128 rows, so gate and up (I % 128 == 0, checked at build) fill whole scale rows.
    """
    stored = source.stored_names(name) if getattr(source, "dequantizes", False) else None
    if stored is None:
        raise LoadError(f"{name}: the layer's experts are {method} (quantization_config) but this tensor is "
                        "stored unquantized")
    values_name, scales_name = stored
    values, scales = params[slot], params[slot + "_scale"]
    s = shard
    bn = block[0] if method == "fp8" else 1
    rows = slice(s.first, s.first + s.count)
    I = s.intermediate_size

    # gpt-oss's blocks [.., N, K/32, 16] uint8 or DeepSeek's fp4 [.., N, K/2] int8: the same bytes, low nibble first
    kind = "mxfp4" if values_name.endswith("_blocks") else "fp4"

    def read(tensor_name: str, index: tuple) -> torch.Tensor:
        t = source.get_stored(tensor_name, index)
        if method == "mxfp4":
            if tensor_name == values_name:
                check_fp4_values(values_name, t, kind)
                return t.flatten(-2) if kind == "mxfp4" else t.view(torch.uint8)  # -> [.., N, K/2] bytes
            check_e8m0_scales(scales_name, t, kind)
            return t.view(torch.uint8)  # e8m0 exponents as the kernels read them
        if tensor_name == values_name:
            if t.dtype != values.dtype:
                raise LoadError(f"{tensor_name}: {method} values stored as {t.dtype}, expected {values.dtype}")
            return t
        check_fp8_scale_dtype(tensor_name, t)
        return e8m0_to_float(t) if t.dtype in E8M0_DTYPES else t.float()  # fp32 scales for the kernels

    half = 0 if part in ("gate", "down") else I
    if form == "expert":
        if expert >= s.num_experts:
            raise LoadError(f"{name}: expert {expert} out of range, the layer has {s.num_experts} experts")
        if not s.holds(expert):
            return None
        local = expert - s.first
        if part == "down":
            values[local].copy_(read(values_name, ()))
            scales[local].copy_(read(scales_name, ()))
        else:
            values[local, half : half + I].copy_(read(values_name, ()))
            scales[local, half // bn : (half + I) // bn].copy_(read(scales_name, ()))
        return [(expert, part)]
    if form == "stacked" and part != "down":
        values[:, half : half + I].copy_(read(values_name, (rows,)))
        scales[:, half // bn : (half + I) // bn].copy_(read(scales_name, (rows,)))
        return [(g, part) for g in range(s.first, s.first + s.count)]
    if form in ("stacked", "fused_gate_up"):
        values.copy_(read(values_name, (rows,)))
        scales.copy_(read(scales_name, (rows,)))
        parts = ("down",) if part == "down" else ("gate", "up")
        return [(g, p) for g in range(s.first, s.first + s.count) for p in parts]
    raise LoadError(f"{name}: form {form!r} cannot be held {method}")


def load_into(module: nn.Module, tensors: Mapping[str, torch.Tensor] | TensorSource, layer_id: int | None) -> set[str]:
    """Copy every tensor of `tensors` that belongs to `module` (FFN of layer `layer_id`).

    Returns the names accounted for: copied here, or belonging to experts / intermediate slices
    that other ranks hold (read by them, never here). Names of other layers and unknown names are
    ignored. Raises LoadError on a shape mismatch, naming the tensor, the expected and the found
    shape, and on a known name the spec has no place for (e.g. `gate.bias` when the config declares
    no router bias): dropping it would silently change the routing the draft was trained with.

    A module built from a quantized spec (`module.quantization`) takes the checkpoint's raw
    tensors as they are stored (an engine hands them over as a plain mapping): they are read through
    a `QuantizedSource` here. A source that dequantizes already (`dequantizes`) is read as it is.
    """
    source = as_source(tensors)
    quantization = getattr(module, "quantization", None)
    if quantization is not None and not getattr(source, "dequantizes", False):
        experts = module.expert_shard
        source = QuantizedSource(source, quantization, _compute_dtype(module),
                                 transposed_stacked=experts is not None and experts.transposed_interleaved)
    if not getattr(source, "dequantizes", False):
        names = list(source.keys())  # in the source's order: the first offending tensor is named, every run
        known = set(names)
        for name in names:
            relative = relative_name(name, layer_id)
            # DeepSeek's `.scale` only beside its `.weight` (an mHC `attn_hc.scale` is a plain tensor)
            deepseek_pair = name.endswith(_SCALE) and name.removesuffix(_SCALE) + ".weight" in known
            if relative is not None and (relative.endswith(_QUANTIZED_SUFFIXES) or deepseek_pair):
                # read as unquantized, a quantized export would load wrong values (or miss them all)
                raise LoadError(f"{name}: a quantized tensor, but the config has no quantization_config "
                                "(mxfp4 blocks/scales, fp8 weight_scale_inv or DeepSeek .scale need one)")
    params = dict(module.named_parameters())
    shard: ExpertShard | None = module.expert_shard
    rules = MLP_RULES if shard is None else MOE_RULES
    consumed: set[str] = set()
    unused: list[str] = []
    with torch.no_grad():
        for name in source.keys():
            relative = relative_name(name, layer_id)
            hit = match(relative, rules) if relative is not None else None
            if hit is None:
                continue
            rule, expert = hit
            param = params.get(rule.slot)
            if param is None:
                unused.append(name)
                continue
            form = rule.oss_form if shard is not None and shard.transposed_interleaved and rule.oss_form else rule.form
            expected = _expected_shape(form, rule.part, shard, param)
            found = tuple(source.shape(name))
            if found != expected:
                raise LoadError(
                    f"{name}: expected shape {list(expected)}, found {list(found)} (layer {layer_id}, slot {rule.slot})"
                )
            if rule.slot == "router.tid2eid":
                _check_token_table(source.get(name), name, shard.num_experts)
            quantized = getattr(getattr(module, "experts", None), "quantization", None)
            if quantized is not None and rule.slot in ("experts.w13", "experts.w2"):
                pieces = _copy_stored(source, name, form, rule.part, expert, params, rule.slot, shard,
                                      quantized.method, quantized.block)
            else:
                pieces = _copy(source, name, form, rule.part, expert, param, shard)
            if pieces is not None:
                module.loaded_pieces.update((rule.slot, g, p) for g, p in pieces)
            consumed.add(name)
    if unused:
        raise LoadError(
            f"layer {layer_id}: the checkpoint has {', '.join(sorted(unused))} but the config declares no place "
            "for it (router bias: topk_method = 'noaux_tc' or moe_router_bias = true; expert biases: gpt-oss)"
        )
    return consumed


def _compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype dequantized tensors are read in: the module's first floating weight wider than one
    byte outside the (always fp32) router, i.e. the dtype it was built in."""
    for name, p in module.named_parameters():
        if p.dtype.is_floating_point and p.element_size() > 1 and not name.startswith("router."):
            return p.dtype
    return torch.get_default_dtype()


def _required(module: nn.Module) -> list[Piece]:
    shard: ExpertShard | None = module.expert_shard
    local = range(shard.first, shard.first + shard.count) if shard is not None else range(0)
    parts = {"experts.w13": ("gate", "up"), "experts.w2": ("down",), "experts.b13": ("",), "experts.b2": ("",)}
    pieces: list[Piece] = []
    for slot, _ in module.named_parameters():
        if slot.endswith("_scale"):  # filled with its values (quantized experts)
            continue
        if slot in parts:
            pieces.extend((slot, g, p) for g in local for p in parts[slot])
        else:
            pieces.append((slot, None, ""))
    return pieces


def check_ffn_loaded(module: nn.Module, layer_id: int | None) -> None:
    """Raise LoadError listing every tensor `module` still lacks (names in SpecForge/HF convention)."""
    missing = [p for p in _required(module) if p not in module.loaded_pieces]
    if missing:
        names = ", ".join(display_name(slot, g, part, layer_id) for slot, g, part in missing)
        aliases = "DeepSeek names w1/w3/w2"
        if module.expert_shard is not None:
            aliases += ", stacked experts.w1|w2|w3 and fused experts.gate_up_proj"
        raise LoadError(f"layer {layer_id}: {len(missing)} tensor(s) missing: {names} ({aliases} are accepted too)")


def load_ffn(module: nn.Module, source: Mapping[str, torch.Tensor] | TensorSource, layer_id: int | None) -> set[str]:
    """Load the FFN of layer `layer_id` from a whole checkpoint and check nothing is missing.

    Returns the names consumed. Raises LoadError for a missing tensor or a wrong shape.
    """
    consumed = load_into(module, source, layer_id)
    check_ffn_loaded(module, layer_id)
    return consumed
