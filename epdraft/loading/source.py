"""Tensor sources: a checkpoint seen as names -> lazily sliceable tensors.

A source answers a tensor's shape without reading it and reads only the requested slice, so an
EP rank touches only its experts' bytes and a TP rank only its intermediate slice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors import SafetensorError, safe_open

from epdraft.errors import LoadError
from epdraft.loading.header import TORCH_DTYPES, TensorHeader, read_header

Index = tuple[slice, ...]
"""Slices per leading dim (missing trailing dims = whole); () reads the whole tensor."""

INDEX_FILE = "model.safetensors.index.json"


@runtime_checkable
class TensorSource(Protocol):
    """Names -> tensors, read lazily."""

    def keys(self) -> Iterable[str]:
        """Every tensor name in the source."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's full shape, without reading its data."""
        ...

    def get(self, name: str, index: Index = ()) -> torch.Tensor:
        """The tensor's `index` slice (a new tensor; only those bytes are read)."""
        ...


class DictSource:
    """In-memory tensors (a `state_dict()`, a test's dict) as a TensorSource."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def keys(self) -> Iterable[str]:
        return self._tensors.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def get(self, name: str, index: Index = ()) -> torch.Tensor:
        return self._tensors[name].detach()[index]


class SafetensorsSource:
    """One or more safetensors files; `weight_map` says which file holds each name.

    Files are memory-mapped on first use and stay open until `close()` (or the end of a `with`).
    """

    def __init__(self, weight_map: Mapping[str, Path]) -> None:
        self._weight_map = dict(weight_map)
        self._handles: dict[Path, object] = {}

    def _handle(self, name: str):
        path = self._weight_map[name]
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (OSError, SafetensorError) as e:
                raise LoadError(f"{path}: cannot read safetensors file: {e}") from e
        return self._handles[path]

    def keys(self) -> Iterable[str]:
        return self._weight_map.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, index: Index = ()) -> torch.Tensor:
        tensor_slice = self._handle(name).get_slice(name)
        return tensor_slice[index] if index else tensor_slice[:]

    def close(self) -> None:
        """Drop the open files (their memory maps go with the last reference)."""
        self._handles.clear()

    def __enter__(self) -> "SafetensorsSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _from_index(index_path: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LoadError(f"{index_path}: not a safetensors index (needs a 'weight_map' object): {e}") from e
    files = {name: index_path.parent / shard for name, shard in weight_map.items()}
    for shard in sorted(set(files.values())):
        if not shard.is_file():
            raise LoadError(f"{index_path}: shard {shard.name} listed in weight_map does not exist")
    return files


def _from_files(paths: list[Path]) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for path in paths:
        for name in read_header(path):
            if name in files:
                raise LoadError(f"tensor {name} is in both {files[name]} and {path}; add a {INDEX_FILE}")
            files[name] = path
    return files


def checkpoint_weight_map(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the file holding it, for a `.safetensors` file, an index json, or a directory.

    A directory uses its `model.safetensors.index.json` if present, else every `*.safetensors`
    file in it. Raises LoadError naming the path when nothing readable is there.
    """
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            return _from_index(path / INDEX_FILE)
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise LoadError(f"{path}: no {INDEX_FILE} and no *.safetensors files")
        return _from_files(shards)
    if path.suffix == ".json" and path.is_file():
        return _from_index(path)
    if path.suffix == ".safetensors" and path.is_file():
        return _from_files([path])
    raise LoadError(f"{path}: not a safetensors file, index json or checkpoint directory")


def open_checkpoint(path: str | Path) -> SafetensorsSource:
    """A lazy source over a checkpoint (see `checkpoint_weight_map` for what `path` may be)."""
    return SafetensorsSource(checkpoint_weight_map(path))


class HeaderSource:
    """A checkpoint seen through its safetensors headers only: `get` returns meta tensors.

    Loading a draft built on the meta device from this source runs every name and shape check of
    the real load without reading (or allocating) a byte of weights: what the launcher checks
    before any rank starts. Every file's header is read, and checked for truncation, up front.
    """

    def __init__(self, weight_map: Mapping[str, Path]) -> None:
        headers = {path: read_header(path) for path in sorted(set(weight_map.values()))}
        self.files = tuple(headers)
        self.tensors: dict[str, TensorHeader] = {}
        for name, path in weight_map.items():
            if name not in headers[path]:
                raise LoadError(f"{path}: has no tensor {name}, which the index places there")
            self.tensors[name] = headers[path][name]

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def get(self, name: str, index: Index = ()) -> torch.Tensor:
        header = self.tensors[name]
        tensor = torch.empty(header.shape, dtype=TORCH_DTYPES.get(header.dtype, torch.float32), device="meta")
        return tensor[index] if index else tensor


def as_source(tensors: Mapping[str, torch.Tensor] | TensorSource) -> TensorSource:
    """Wrap a plain mapping; pass a TensorSource through."""
    if isinstance(tensors, TensorSource):
        return tensors
    return DictSource(tensors)
