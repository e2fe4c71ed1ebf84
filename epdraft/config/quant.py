"""`quantization_config` -> `QuantSpec`: which checkpoint weights are quantized, and how.

Three layouts are understood:
- `mxfp4` (OCP MX, gpt-oss's layout as transformers writes it): e2m1 values packed two per byte, low
  nibble first, in `NAME_blocks [..., N, K/32, 16]` uint8, and one e8m0 exponent per 32 values in
  `NAME_scales [..., N, K/32]` uint8 (value = e2m1 * 2**(scale - 127)).
- `fp8` (DeepSeek-V3 style): `NAME.weight [N, K]` float8_e4m3fn and one scale per
  `weight_block_size` block in `NAME.weight_scale_inv [ceil(N/bn), ceil(K/bk)]` (value = fp8 * scale),
  fp32 or, with `scale_fmt: ue8m0`, e8m0 powers of two.
- DeepSeek-V4's release: `fp8` as above with the scales in `NAME.scale` (float8_e8m0fnu), and with the
  top-level `expert_dtype: "fp4"` the routed experts `experts.{e}.w1|w2|w3.weight [N, K/2]` int8 of
  packed e2m1 (low nibble first) with an e8m0 `.scale [N, K/32]`: MXFP4's numbers in another storage.
`modules_to_not_convert` names modules stored unquantized (the router, attention, lm_head, ...).
Anything else (another quant_method, fmt or scale_fmt, static activation scales) is refused here,
naming the key, so no loader ever meets a format it would read wrongly.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from epdraft.errors import ConfigError

MXFP4_GROUP = 32
"""Values per e8m0 scale in MXFP4 (OCP MX v1.0)."""

QuantMethod = Literal["mxfp4", "fp8"]
ScaleFormat = Literal["float", "ue8m0"]
ExpertDtype = Literal["fp8", "fp4"]


class QuantSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One checkpoint's weight quantization.

    `block` is the (rows, columns) of weight that share one scale: (1, 32) for mxfp4, the
    config's `weight_block_size` for fp8. `not_converted` holds `modules_to_not_convert` as given.
    `scale_fmt`: fp8 scales stored as fp32 (`float`) or e8m0 exponents (`ue8m0`). `expert_dtype`
    (fp8 only): `fp4` = the routed experts are DeepSeek's packed FP4 (`experts` says how they are held).
    """

    method: QuantMethod
    block: tuple[Annotated[int, msgspec.Meta(ge=1)], Annotated[int, msgspec.Meta(ge=1)]]
    not_converted: tuple[str, ...] = ()
    scale_fmt: ScaleFormat = "float"
    expert_dtype: ExpertDtype = "fp8"

    @property
    def experts(self) -> "QuantSpec":
        """The routed experts' storage: DeepSeek's FP4 experts are MXFP4 numbers (e2m1 codes, an e8m0
        scale per 32 inputs), held by the experts as mxfp4; every other checkpoint stores them as the rest."""
        if self.expert_dtype == "fp4":
            return QuantSpec(method="mxfp4", block=(1, MXFP4_GROUP), not_converted=self.not_converted)
        return self

    @property
    def bits_per_weight(self) -> float:
        """Bytes moved per weight, in bits, scales included (mxfp4: 4 + 8/32 = 4.25)."""
        if self.method == "mxfp4":
            return 4 + 8 / MXFP4_GROUP
        return 8 + (8 if self.scale_fmt == "ue8m0" else 32) / (self.block[0] * self.block[1])

    def describe(self) -> str:
        """One line for logs and `epdraft check`: format, scale block, unconverted modules."""
        if self.method == "mxfp4":
            text = f"mxfp4 (e2m1 values, e8m0 scale per {MXFP4_GROUP})"
        else:
            scale = "e8m0" if self.scale_fmt == "ue8m0" else "fp32"
            text = f"fp8 e4m3 ({scale} scale per {self.block[0]}x{self.block[1]} block)"
        if self.expert_dtype == "fp4":
            text = f"linears {text}; routed experts fp4 (e2m1 in int8 pairs, e8m0 scale per {MXFP4_GROUP})"
        if self.not_converted:
            text += f", not converted: {', '.join(self.not_converted)}"
        return text

    def converts(self, module: str) -> bool:
        """Whether `module` (a dotted name, e.g. `model.layers.0.mlp.gate`) is stored quantized.

        A `modules_to_not_convert` entry matches a whole dotted component run of the name
        (`mlp.gate` matches `layers.0.mlp.gate`, not `layers.0.mlp.gate_proj`); `*` matches one
        component or more, as in `model.layers.*.self_attn`; a leading `model.` is ignored on both sides.
        """
        module = module.removeprefix("model.")  # SpecForge exports drop HF's `model.` prefix
        for pattern in self.not_converted:
            pattern = pattern.removeprefix("model.")
            body = r"\.".join("[^.]+(?:\\.[^.]+)*" if part == "*" else re.escape(part) for part in pattern.split("."))
            if re.search(rf"(?:^|\.){body}(?:\.|$)", module):
                return False
        return True


_FP8_KEYS = {"quant_method", "activation_scheme", "weight_block_size", "fmt", "scale_fmt",
             "modules_to_not_convert", "ignored_layers", "dequantize", "expert_dtype", "modules_to_convert"}
_MXFP4_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}


def parse_quantization_config(
    raw: object, path: str = "quantization_config", *, expert_dtype: str | None = None, expert_dtype_key: str = ""
) -> QuantSpec:
    """A `QuantSpec` from a config's `quantization_config` object; ConfigError naming `path.key`.

    `expert_dtype`: the config's top-level `expert_dtype` (DeepSeek-V4: "fp4"), found at `expert_dtype_key`.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} = {raw!r}: expected an object with a quant_method")
    method = raw.get("quant_method")
    if method not in ("mxfp4", "fp8"):
        raise ConfigError(f"{path}.quant_method = {method!r}: unknown quantization; supported: 'mxfp4', 'fp8'")
    known = _MXFP4_KEYS if method == "mxfp4" else _FP8_KEYS
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown} for quant_method = {method!r}; known: {sorted(known)}")
    not_converted = raw.get("modules_to_not_convert")
    if not_converted is None:
        not_converted = raw.get("ignored_layers") or []
    if not isinstance(not_converted, list) or not all(isinstance(m, str) for m in not_converted):
        raise ConfigError(f"{path}.modules_to_not_convert = {not_converted!r}: expected a list of module names")
    if raw.get("modules_to_convert"):
        raise ConfigError(f"{path}.modules_to_convert = {raw['modules_to_convert']!r}: not supported; "
                          "name the unquantized modules in modules_to_not_convert")
    if method == "mxfp4":
        if expert_dtype is not None:
            raise ConfigError(f"{expert_dtype_key} = {expert_dtype!r} with {path}.quant_method = 'mxfp4': "
                              "expert_dtype belongs to fp8 checkpoints (DeepSeek-V4's fp4 experts)")
        return QuantSpec(method="mxfp4", block=(1, MXFP4_GROUP), not_converted=tuple(not_converted))
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"{path}.activation_scheme = {scheme!r}: only 'dynamic' (no stored activation scales) "
                          "is supported")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{path}.fmt = {fmt!r}: only e4m3 fp8 weights are supported")
    scale_fmt = raw.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise ConfigError(f"{path}.scale_fmt = {scale_fmt!r}: expected 'float' or 'ue8m0'")
    experts = _expert_dtype(raw.get("expert_dtype"), f"{path}.expert_dtype", expert_dtype, expert_dtype_key)
    block = raw.get("weight_block_size")
    if block is None:
        raise ConfigError(f"{path}.weight_block_size is missing: per-tensor fp8 is not supported, "
                          "block-scaled fp8 (e.g. [128, 128]) is")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b >= 1 for b in block)):
        raise ConfigError(f"{path}.weight_block_size = {block!r}: expected two positive integers [rows, columns]")
    return QuantSpec(method="fp8", block=(block[0], block[1]), not_converted=tuple(not_converted),
                     scale_fmt=scale_fmt, expert_dtype=experts)


def _expert_dtype(inner: object, inner_key: str, outer: object, outer_key: str) -> ExpertDtype:
    """fp8 or fp4 from `quantization_config.expert_dtype` (transformers' key) and the top-level one
    (DeepSeek's release); two that disagree are refused, naming both."""
    for value, key in ((inner, inner_key), (outer, outer_key)):
        if value is not None and value not in ("fp8", "fp4"):
            raise ConfigError(f"{key} = {value!r}: expected 'fp8' or 'fp4' (e2m1 packed in int8, DeepSeek-V4)")
    if inner is not None and outer is not None and inner != outer:
        raise ConfigError(f"{outer_key} = {outer!r} contradicts {inner_key} = {inner!r}")
    return inner or outer or "fp8"
