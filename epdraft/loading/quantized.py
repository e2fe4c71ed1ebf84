"""A quantized checkpoint seen as the unquantized one: `QuantizedSource` dequantizes on read.

Every loader above it (FFN rules, EP/TP slices, the draft's own tensors) sees the logical names and
shapes of a bf16 export: `NAME_blocks` + `NAME_scales` (mxfp4) read as `NAME`, `NAME.weight` +
`NAME.weight_scale_inv` (fp8) as `NAME.weight`. A slice reads only the blocks and scales that cover
it, so an EP rank still touches only its experts' bytes. Fused mxfp4 expert tensors of gpt-oss
(`experts.gate_up_proj_blocks [E, 2I, H/32, 16]`) read transposed, `[E, H, 2I]`, as transformers
dequantizes them and as the bf16 gpt-oss export stores them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch

from epdraft.config.ffn import DraftMoeFFNSpec
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.config.quant import MXFP4_GROUP, QuantSpec
from epdraft.errors import LoadError
from epdraft.loading.quant import dequantize_mxfp4, e8m0_to_float, expand_block_scales
from epdraft.loading.source import Index, TensorSource, as_source

log = logging.getLogger(__name__)

_BLOCKS, _SCALES, _SCALE_INV = "_blocks", "_scales", "_scale_inv"
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class QuantizedSource:
    """`source` with its quantized tensors read dequantized to `dtype` (a TensorSource itself).

    `transposed_stacked`: 3-d mxfp4 tensors read transposed (the gpt-oss layout, see the module
    docstring). `stored_names` / `get_stored` give the stored tensors to experts that keep them
    quantized (`epdraft.loading.ffn`).

    Raises LoadError, naming the tensor and the format, for blocks without scales (or scales
    without their weight), a scales shape that does not cover the weight, a quantized tensor of a
    module `modules_to_not_convert` lists, and (on read) an fp8 weight without scales.
    """

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
        self._plain: list[str] = []
        names = set(source.keys())
        if spec.method == "mxfp4":
            self._pair(names, _BLOCKS, _SCALES)
        else:
            self._pair(names, "", _SCALE_INV)
        log.debug("%d %s tensor(s) in the checkpoint, read dequantized to %s (%s)", len(self._quantized),
                  spec.method, str(dtype).removeprefix("torch."), spec.describe())

    def _pair(self, names: set[str], values_suffix: str, scales_suffix: str) -> None:
        """Pair every `X + values_suffix` with `X + scales_suffix` as logical `X`; the rest is read as stored."""
        fmt = self._spec.method
        for name in sorted(names):
            if name.endswith(scales_suffix):
                logical = name.removesuffix(scales_suffix)
                values = logical + values_suffix
                if values not in names:
                    raise LoadError(f"{name}: {fmt} scales without their weight {values}")
                self._check(logical, values, name)
                self._quantized[logical] = (values, name)
            elif values_suffix and name.endswith(values_suffix):
                if name.removesuffix(values_suffix) + scales_suffix not in names:
                    raise LoadError(f"{name}: {fmt} blocks without their scales "
                                    f"{name.removesuffix(values_suffix)}{scales_suffix} (missing scales)")
            else:
                self._plain.append(name)
        self._plain = [n for n in self._plain if n not in self._quantized]

    def _check(self, logical: str, values: str, scales: str) -> None:
        """Refuse a quantized tensor of an unconverted module, or scales that do not match the weight."""
        module = logical.rsplit(".", 1)[0]  # the tensor's module: `experts.0.gate_proj`, `experts` (fused)
        if not self._spec.converts(module):
            raise LoadError(f"{values}: stored {self._spec.method} but its module is listed in "
                            f"quantization_config.modules_to_not_convert ({', '.join(self._spec.not_converted)})")
        vshape, sshape = tuple(self._source.shape(values)), tuple(self._source.shape(scales))
        if self._spec.method == "mxfp4":
            expected = vshape[:-1]
            if len(vshape) < 3 or vshape[-1] != MXFP4_GROUP // 2:
                raise LoadError(f"{values}: mxfp4 blocks have shape {list(vshape)}, expected [..., N, K/32, 16]")
        else:
            bn, bk = self._spec.block
            if len(vshape) < 2:
                raise LoadError(f"{values}: fp8 weight has shape {list(vshape)}, expected [..., N, K]")
            expected = (*vshape[:-2], -(-vshape[-2] // bn), -(-vshape[-1] // bk))
        if sshape != expected:
            raise LoadError(f"{scales}: {self._spec.method} scales shape {list(sshape)} does not cover "
                            f"{values} {list(vshape)}: expected {list(expected)} (bad scales shape)")

    def keys(self) -> Iterable[str]:
        return [*self._plain, *self._quantized]

    def stored_names(self, name: str) -> tuple[str, str] | None:
        """(values, scales) names holding logical tensor `name` as stored; None if it is stored unquantized."""
        return self._quantized.get(name)

    def get_stored(self, name: str, index: Index = ()) -> torch.Tensor:
        """A stored tensor (blocks, scales, fp8 values) as it is in the checkpoint, `index` slice only."""
        return self._source.get(name, index)

    def _natural_shape(self, logical: str) -> tuple[int, ...]:
        values, _ = self._quantized[logical]
        shape = tuple(self._source.shape(values))
        if self._spec.method == "mxfp4":
            return (*shape[:-2], shape[-2] * shape[-1] * 2)
        return shape

    def _is_transposed(self, logical: str) -> bool:
        return self._transposed and self._spec.method == "mxfp4" and len(self._natural_shape(logical)) == 3

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._quantized:
            return tuple(self._source.shape(name))
        shape = self._natural_shape(name)
        return (*shape[:-2], shape[-1], shape[-2]) if self._is_transposed(name) else shape

    def get(self, name: str, index: Index = ()) -> torch.Tensor:
        if name not in self._quantized:
            tensor = self._source.get(name, index)
            if tensor.dtype in _FLOAT8:
                raise LoadError(f"{name}: {tensor.dtype} weight without {name}{_SCALE_INV} (missing fp8 scales)")
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
        out = self._read_mxfp4(name, lead, rows, cols) if self._spec.method == "mxfp4" else \
            self._read_fp8(name, lead, rows, cols)
        return out.transpose(-1, -2).contiguous() if transposed else out

    def _read_mxfp4(self, name: str, lead: tuple, rows: slice, cols: slice) -> torch.Tensor:
        blocks_name, scales_name = self._quantized[name]
        g0, g1 = cols.start // MXFP4_GROUP, -(-cols.stop // MXFP4_GROUP)
        blocks = self._source.get(blocks_name, (*lead, rows, slice(g0, g1)))
        scales = self._source.get(scales_name, (*lead, rows, slice(g0, g1)))
        for tensor_name, tensor in ((blocks_name, blocks), (scales_name, scales)):
            if tensor.dtype != torch.uint8:
                raise LoadError(f"{tensor_name}: mxfp4 {tensor_name.rsplit('_', 1)[1]} stored as {tensor.dtype}, "
                                "expected uint8")
        first = cols.start - g0 * MXFP4_GROUP
        return dequantize_mxfp4(blocks, scales, self._dtype)[..., first : first + cols.stop - cols.start]

    def _read_fp8(self, name: str, lead: tuple, rows: slice, cols: slice) -> torch.Tensor:
        weight_name, scale_name = self._quantized[name]
        bn, bk = self._spec.block
        weight = self._source.get(weight_name, (*lead, rows, cols))
        if weight.dtype != torch.float8_e4m3fn:
            raise LoadError(f"{weight_name}: fp8 weight stored as {weight.dtype}, expected float8_e4m3fn")
        blocks = (slice(rows.start // bn, -(-rows.stop // bn)), slice(cols.start // bk, -(-cols.stop // bk)))
        scale = self._source.get(scale_name, (*lead, *blocks))
        scale32 = e8m0_to_float(scale) if scale.dtype == torch.uint8 else scale.float()
        return (weight.float() * expand_block_scales(scale32, self._spec.block, rows, cols)).to(self._dtype)


def quantized_source(source: TensorSource, spec: DraftMixFFNSpec, dtype: torch.dtype) -> TensorSource:
    """`source` dequantized per `spec.quantization` (one log line), or `source` itself if unquantized."""
    if spec.quantization is None:
        return source
    transposed = any(isinstance(s, DraftMoeFFNSpec) and s.activation.kind == "swigluoai" for s in spec.layers)
    return QuantizedSource(source, spec.quantization, dtype, transposed_stacked=transposed)
