"""`quantization_config` -> `QuantSpec`: which checkpoint weights are quantized, and how.

Two formats are understood, as transformers writes them:
- `mxfp4` (OCP MX, gpt-oss / DeepSeek-V4 routed experts): e2m1 values packed two per byte, low
  nibble first, in `NAME_blocks [..., N, K/32, 16]` uint8, and one e8m0 exponent per 32 values in
  `NAME_scales [..., N, K/32]` uint8 (value = e2m1 * 2**(scale - 127)).
- `fp8` (DeepSeek-V3 style): `NAME.weight [N, K]` float8_e4m3fn and one scale per
  `weight_block_size` block in `NAME.weight_scale_inv [ceil(N/bn), ceil(K/bk)]` (value = fp8 * scale).
`modules_to_not_convert` names modules stored unquantized (the router, attention, lm_head, ...).
Anything else (another quant_method, static activation scales, FP4-packed fp8 experts) is refused
here, naming the key, so no loader ever meets a format it would read wrongly.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from epdraft.errors import ConfigError

MXFP4_GROUP = 32
"""Values per e8m0 scale in MXFP4 (OCP MX v1.0)."""

QuantMethod = Literal["mxfp4", "fp8"]


class QuantSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One checkpoint's weight quantization.

    `block` is the (rows, columns) of weight that share one scale: (1, 32) for mxfp4, the
    config's `weight_block_size` for fp8. `not_converted` holds `modules_to_not_convert` as given.
    """

    method: QuantMethod
    block: tuple[Annotated[int, msgspec.Meta(ge=1)], Annotated[int, msgspec.Meta(ge=1)]]
    not_converted: tuple[str, ...] = ()

    @property
    def bits_per_weight(self) -> float:
        """Bytes moved per weight, in bits, scales included (mxfp4: 4 + 8/32 = 4.25)."""
        if self.method == "mxfp4":
            return 4 + 8 / MXFP4_GROUP
        return 8 + 32 / (self.block[0] * self.block[1])

    def describe(self) -> str:
        """One line for logs and `epdraft check`: format, scale block, unconverted modules."""
        if self.method == "mxfp4":
            text = f"mxfp4 (e2m1 values, e8m0 scale per {MXFP4_GROUP})"
        else:
            text = f"fp8 e4m3 (fp32 scale per {self.block[0]}x{self.block[1]} block)"
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


def parse_quantization_config(raw: object, path: str = "quantization_config") -> QuantSpec:
    """A `QuantSpec` from a config's `quantization_config` object; ConfigError naming `path.key`."""
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
    if raw.get("expert_dtype", "fp8") != "fp8":
        raise ConfigError(f"{path}.expert_dtype = {raw['expert_dtype']!r}: FP4-packed experts under fp8 are not "
                          "supported; an mxfp4 checkpoint (quant_method 'mxfp4') is")
    block = raw.get("weight_block_size")
    if block is None:
        raise ConfigError(f"{path}.weight_block_size is missing: per-tensor fp8 is not supported, "
                          "block-scaled fp8 (e.g. [128, 128]) is")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b >= 1 for b in block)):
        raise ConfigError(f"{path}.weight_block_size = {block!r}: expected two positive integers [rows, columns]")
    return QuantSpec(method="fp8", block=(block[0], block[1]), not_converted=tuple(not_converted))
