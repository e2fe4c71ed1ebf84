"""A quantized checkpoint seen as the unquantized one: `QuantizedSource` dequantizes on read.

Every loader above it (FFN rules, EP/TP slices, the draft's own tensors) sees the logical names and
shapes of a bf16 export: `NAME_blocks` + `NAME_scales` (mxfp4) read as `NAME`, `NAME.weight` +
`NAME.weight_scale_inv` (fp8) or DeepSeek's `NAME.weight` + `NAME.scale` (fp8, or with
`expert_dtype: fp4` the routed experts' packed fp4) as `NAME.weight`. A slice reads only the blocks and scales that cover
it, so an EP rank still touches only its experts' bytes. Fused mxfp4 expert tensors of gpt-oss
(`experts.gate_up_proj_blocks [E, 2I, H/32, 16]`) read transposed, `[E, H, 2I]`, as transformers
dequantizes them and as the bf16 gpt-oss export stores them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Literal

import torch

from epdraft.config.ffn import DraftMoeFFNSpec
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.config.quant import MXFP4_GROUP, QuantSpec
from epdraft.errors import LoadError
from epdraft.loading.quant import E8M0_DTYPES, dequantize_mxfp4, e8m0_to_float, expand_block_scales, fp4_as_mxfp4
from epdraft.loading.source import Index, TensorSource, as_source

log = logging.getLogger(__name__)

_BLOCKS, _SCALES, _SCALE_INV, _SCALE, _WEIGHT = "_blocks", "_scales", "_scale_inv", ".scale", ".weight"
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_ROUTED_EXPERT = re.compile(r"(?:^|\.)experts\.\d+\.w[123]\.weight$")
"""DeepSeek's routed expert weights (`ffn.experts.{e}.w1|w2|w3.weight`): fp4 under `expert_dtype: fp4`;
the shared expert's (`shared_experts.w1.weight`) stay fp8."""
StoredKind = Literal["mxfp4", "fp4", "fp8"]


class QuantizedSource:
    """`source` with its quantized tensors read dequantized to `dtype` (a TensorSource itself).

    `transposed_stacked`: 3-d mxfp4 tensors read transposed (the gpt-oss layout, see the module
    docstring). `stored_names` / `get_stored` give the stored tensors to experts that keep them
    quantized (`epdraft.loading.ffn`); `stored_kind` says which format a logical tensor is stored in.

    Raises LoadError, naming the tensor and the format, for blocks without scales (or scales
    without their weight), a DeepSeek fp4 expert weight without its `.scale`, a scales shape that
    does not cover the weight, a packed fp4 width that is not whole groups of 32, a quantized tensor
    of a module `modules_to_not_convert` lists, and (on read) a weight or scale of the wrong dtype
    and an fp8 weight without scales.
    """

    dequantizes = True
    """Quantized tensors read dequantized: a layer's `load_weights` need not wrap this source again."""

    def __init__(
        self,
        source: Mapping[str, torch.Tensor] | TensorSource,
        spec: QuantSpec,
        dtype: torch.dtype,
        *,
        transposed_stacked: bool,
    ) -> None:
        source = as_source(source)
        self._source, self._spec, self._dtype = source, spec, dtype
        self._transposed = transposed_stacked
        self._quantized: dict[str, tuple[str, str]] = {}  # logical name -> (values name, scales name)
        self._kind: dict[str, StoredKind] = {}
        ordered = list(source.keys())
        names = set(ordered)
        if spec.method == "mxfp4":
            self._pair_mxfp4(names)
        else:
            self._pair_fp8(names)
        stored = {n for pair in self._quantized.values() for n in pair}
        self._plain = [n for n in ordered if n not in self._quantized and n not in stored]

    def describe(self) -> str:
        """One line: how many tensors of each stored format, the format, the dtype they are read in."""
        counts = {k: sum(1 for v in self._kind.values() if v == k) for k in ("fp8", "fp4", "mxfp4")}
        stored = ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "none"
        return (f"quantized tensors in the checkpoint: {stored} ({self._spec.describe()}); read dequantized to "
                f"{str(self._dtype).removeprefix('torch.')} at load, except routed experts the fused kernels hold quantized")

    def _pair_mxfp4(self, names: set[str]) -> None:
        """`X_blocks` + `X_scales` -> logical `X`."""
        for name in sorted(names):
            if name.endswith(_SCALES):
                logical = name.removesuffix(_SCALES)
                if logical + _BLOCKS not in names:
                    raise LoadError(f"{name}: mxfp4 scales without their weight {logical + _BLOCKS}")
                self._add(logical, logical + _BLOCKS, name, "mxfp4")
            elif name.endswith(_BLOCKS) and name.removesuffix(_BLOCKS) + _SCALES not in names:
                raise LoadError(f"{name}: mxfp4 blocks without their scales "
                                f"{name.removesuffix(_BLOCKS)}{_SCALES} (missing scales)")

    def _pair_fp8(self, names: set[str]) -> None:
        """`X` + `X_scale_inv` (transformers) or `P.weight` + `P.scale` (DeepSeek) -> logical `X` / `P.weight`;
        with `expert_dtype: fp4`, routed experts' `.weight` are packed fp4 and must have their `.scale`."""
        fp4 = self._spec.expert_dtype == "fp4"

        def kind(logical: str) -> StoredKind:
            return "fp4" if fp4 and _ROUTED_EXPERT.search(logical) else "fp8"

        for name in sorted(names):
            if name.endswith(_SCALE_INV):
                logical = name.removesuffix(_SCALE_INV)
                if logical not in names:
                    raise LoadError(f"{name}: fp8 scales without their weight {logical}")
                self._add(logical, logical, name, kind(logical))
            elif name.endswith(_SCALE) and name.removesuffix(_SCALE) + _WEIGHT in names:
                logical = name.removesuffix(_SCALE) + _WEIGHT
                self._add(logical, logical, name, kind(logical))
            elif kind(name) == "fp4" and not {name.removesuffix(_WEIGHT) + _SCALE, name + _SCALE_INV} & names:
                raise LoadError(f"{name}: an fp4 routed expert weight (expert_dtype = 'fp4') without its scale "
                                f"{name.removesuffix(_WEIGHT)}{_SCALE} (missing scale)")

    def _add(self, logical: str, values: str, scales: str, kind: StoredKind) -> None:
        """Record a quantized pair after checking its module is converted and its scales cover the weight."""
        module = logical.rsplit(".", 1)[0]  # the tensor's module: `experts.0.gate_proj`, `experts` (fused)
        if not self._spec.converts(module):
            raise LoadError(f"{values}: stored {kind} but its module is listed in "
                            f"quantization_config.modules_to_not_convert ({', '.join(self._spec.not_converted)})")
        vshape, sshape = tuple(self._source.shape(values)), tuple(self._source.shape(scales))
        if kind == "mxfp4":
            expected = vshape[:-1]
            if len(vshape) < 3 or vshape[-1] != MXFP4_GROUP // 2:
                raise LoadError(f"{values}: mxfp4 blocks have shape {list(vshape)}, expected [..., N, K/32, 16]")
        elif kind == "fp4":
            if len(vshape) < 2 or vshape[-1] % (MXFP4_GROUP // 2):
                raise LoadError(f"{values}: fp4 weight has shape {list(vshape)}: expected [..., N, K/2] with K/2 a "
                                f"multiple of {MXFP4_GROUP // 2} (two e2m1 a byte, one scale per {MXFP4_GROUP}): "
                                "wrong packed width")
            expected = (*vshape[:-1], vshape[-1] * 2 // MXFP4_GROUP)
        else:
            bn, bk = self._spec.block
            if len(vshape) < 2:
                raise LoadError(f"{values}: fp8 weight has shape {list(vshape)}, expected [..., N, K]")
            expected = (*vshape[:-2], -(-vshape[-2] // bn), -(-vshape[-1] // bk))
        if sshape != expected:
            raise LoadError(f"{scales}: {kind} scales shape {list(sshape)} does not cover "
                            f"{values} {list(vshape)}: expected {list(expected)} (bad scales shape)")
        self._quantized[logical] = (values, scales)
        self._kind[logical] = kind

    def keys(self) -> Iterable[str]:
        return [*self._plain, *self._quantized]

    def stored_names(self, name: str) -> tuple[str, str] | None:
        """(values, scales) names holding logical tensor `name` as stored; None if it is stored unquantized."""
        return self._quantized.get(name)

    def stored_kind(self, name: str) -> StoredKind | None:
        """How logical tensor `name` is stored: "mxfp4" (blocks), "fp4" (DeepSeek int8 pairs), "fp8"; None: plain."""
        return self._kind.get(name)

    def get_stored(self, name: str, index: Index = ()) -> torch.Tensor:
        """A stored tensor (blocks, scales, fp8 values) as it is in the checkpoint, `index` slice only."""
        return self._source.get(name, index)

    def _natural_shape(self, logical: str) -> tuple[int, ...]:
        values, _ = self._quantized[logical]
        shape = tuple(self._source.shape(values))
        if self._kind[logical] == "mxfp4":
            return (*shape[:-2], shape[-2] * shape[-1] * 2)
        if self._kind[logical] == "fp4":
            return (*shape[:-1], shape[-1] * 2)
        return shape

    def _is_transposed(self, logical: str) -> bool:
        return self._transposed and self._kind[logical] == "mxfp4" and len(self._natural_shape(logical)) == 3

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._quantized:
            return tuple(self._source.shape(name))
        shape = self._natural_shape(name)
        return (*shape[:-2], shape[-1], shape[-2]) if self._is_transposed(name) else shape

    def get(self, name: str, index: Index = ()) -> torch.Tensor:
        if name not in self._quantized:
            tensor = self._source.get(name, index)
            if tensor.dtype in _FLOAT8:
                raise LoadError(f"{name}: {tensor.dtype} weight without its scales ({name}{_SCALE_INV} or "
                                f"{name.removesuffix(_WEIGHT)}{_SCALE}: missing fp8 scales)")
            return tensor
        natural = self._natural_shape(name)
        transposed = self._is_transposed(name)
        dims = list(index) + [slice(None)] * (len(natural) - len(index))
        if transposed:
            dims[-2], dims[-1] = dims[-1], dims[-2]
        lead = tuple(dims[:-2])
        rows = slice(*dims[-2].indices(natural[-2])[:2])
        cols = slice(*dims[-1].indices(natural[-1])[:2])
        assert all(d.step in (None, 1) for d in dims), "loader slices are contiguous"
        kind = self._kind[name]
        out = self._read_fp8(name, lead, rows, cols) if kind == "fp8" else self._read_fp4(name, lead, rows, cols, kind)
        return out.transpose(-1, -2).contiguous() if transposed else out

    def _read_fp4(self, name: str, lead: tuple, rows: slice, cols: slice, kind: StoredKind) -> torch.Tensor:
        """mxfp4 blocks or DeepSeek's int8 pairs: only the groups of 32 that cover `cols` are read."""
        values_name, scales_name = self._quantized[name]
        g0, g1 = cols.start // MXFP4_GROUP, -(-cols.stop // MXFP4_GROUP)
        per_group = MXFP4_GROUP // 2
        values_cols = slice(g0, g1) if kind == "mxfp4" else slice(g0 * per_group, g1 * per_group)
        values = self._source.get(values_name, (*lead, rows, values_cols))
        scales = self._source.get(scales_name, (*lead, rows, slice(g0, g1)))
        check_fp4_values(values_name, values, kind)
        check_e8m0_scales(scales_name, scales, kind)
        if kind == "fp4":
            values, scales = fp4_as_mxfp4(values, scales)
        first = cols.start - g0 * MXFP4_GROUP
        return dequantize_mxfp4(values, scales, self._dtype)[..., first : first + cols.stop - cols.start]

    def _read_fp8(self, name: str, lead: tuple, rows: slice, cols: slice) -> torch.Tensor:
        weight_name, scale_name = self._quantized[name]
        bn, bk = self._spec.block
        weight = self._source.get(weight_name, (*lead, rows, cols))
        if weight.dtype != torch.float8_e4m3fn:
            raise LoadError(f"{weight_name}: fp8 weight stored as {weight.dtype}, expected float8_e4m3fn")
        blocks = (slice(rows.start // bn, -(-rows.stop // bn)), slice(cols.start // bk, -(-cols.stop // bk)))
        scale = self._source.get(scale_name, (*lead, *blocks))
        check_fp8_scale_dtype(scale_name, scale)
        scale32 = e8m0_to_float(scale) if scale.dtype in E8M0_DTYPES else scale.float()
        return (weight.float() * expand_block_scales(scale32, self._spec.block, rows, cols)).to(self._dtype)


def check_fp4_values(name: str, values: torch.Tensor, kind: StoredKind) -> None:
    """LoadError naming the tensor when mxfp4 blocks are not uint8 or DeepSeek fp4 values not int8."""
    want = torch.uint8 if kind == "mxfp4" else torch.int8
    if values.dtype != want:
        raise LoadError(f"{name}: {kind} values stored as {values.dtype}, expected {want}")


def check_e8m0_scales(name: str, scales: torch.Tensor, kind: StoredKind) -> None:
    """LoadError naming the tensor when fp4 / mxfp4 scales are not e8m0 (uint8 or float8_e8m0fnu)."""
    if scales.dtype not in E8M0_DTYPES:
        raise LoadError(f"{name}: {kind} scales stored as {scales.dtype}, expected e8m0 (float8_e8m0fnu or uint8)")


def check_fp8_scale_dtype(scale_name: str, scale: torch.Tensor) -> None:
    """LoadError naming the tensor when fp8 block scales are neither fp32 nor e8m0."""
    if scale.dtype != torch.float32 and scale.dtype not in E8M0_DTYPES:
        raise LoadError(f"{scale_name}: fp8 scales stored as {scale.dtype}, expected float32 or e8m0 "
                        "(float8_e8m0fnu / uint8, scale_fmt = 'ue8m0')")


def quantized_source(source: TensorSource, spec: DraftMixFFNSpec, dtype: torch.dtype) -> TensorSource:
    """`source` dequantized per `spec.quantization`, or `source` itself if unquantized."""
    if spec.quantization is None:
        return source
    transposed = any(isinstance(s, DraftMoeFFNSpec) and s.activation.kind == "swigluoai" for s in spec.layers)
    quantized = QuantizedSource(source, spec.quantization, dtype, transposed_stacked=transposed)
    log.debug("%s", quantized.describe())  # the rank's one line is StepKernels' (what stays quantized, why)
    return quantized
