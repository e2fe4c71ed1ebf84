"""How every family's Triton kernels launch: programmatic dependent launch (PDL), tile sizes.

Inside a CUDA graph each of the step's ~120 kernels still starts a microsecond or two after the one
before it ends, and a memory-bound kernel then ramps up before it streams at full rate: at N = 1
that was ~150 µs of a ~1 ms step on the H200 (docs/performance.md). With PDL (sm_90 and newer) a
kernel is launched while the one before it still runs: its programs start, may read what no kernel
of the step writes (weights: the skinny projections prefetch theirs into L2), then wait
(`griddepcontrol.wait`) until the previous kernel has finished and its writes are visible, before
any other read and before any write. Every kernel launched with PDL waits before its first
dependent access, so "kernel k finished" still implies "every kernel before k finished": the stream
order that torch's caching allocator and the step's buffers rely on holds.

`kwargs(device)` is what a launch adds: `PDL` (the kernels' constexpr) and Triton's `launch_pdl`.
`next_pow2` rounds a size up to the power-of-two tiles Triton takes. `host_ints` hands an eager
step's few host ints (slots, anchors, counts) to the device without waiting for it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator, Sequence

import torch

from epdraft.errors import ConfigError, EpdraftError

_enabled = True
_counts: dict[tuple[str, torch.device, bool], torch.Tensor] = {}


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Whether launches on `device` use PDL: CUDA of compute capability 9.0 or newer (griddepcontrol
    is sm_90 PTX), not Triton's CPU interpreter, and not inside `pdl_off`."""
    return (
        _enabled
        and device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and _hopper_or_newer(device.index)
    )


def kwargs(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a PDL-aware kernel on `device`."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": on}


@contextlib.contextmanager
def pdl_off() -> Iterator[None]:
    """Launch without PDL inside this block: what `epdraft bench step` times beside it. A CUDA graph
    keeps the launches it captured, so capture inside the block for a graph without PDL."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def _indexed(device: torch.device) -> torch.device:
    """`device` with its index: `cuda` and `cuda:0` name one device but compare and hash apart."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _second_stream(device: torch.device) -> torch.cuda.Stream:
    """The one second stream of a CUDA device, however it is named."""
    return _stream_of(_indexed(device))


@functools.lru_cache(maxsize=None)
def _stream_of(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


class Fork:
    """Work run beside the current stream of `device` on its one second stream: the fork waits on
    the current stream (so the side reads what was written before it), `side()` is the context the
    forked work is launched in, `join()` makes the current stream wait for it. A CUDA graph captures
    the two as parallel branches.

    The caller keeps every tensor the side reads or writes referenced until after `join()`; the
    side's own temporaries return to its pool, which the next fork reuses only after its wait."""

    def __init__(self, device: torch.device):
        self.main, self.other = torch.cuda.current_stream(device), _second_stream(device)
        self.other.wait_stream(self.main)

    def side(self) -> torch.cuda.StreamContext:
        return torch.cuda.stream(self.other)

    def join(self) -> None:
        self.main.wait_stream(self.other)


def zeroed_counts(owner: str, device: torch.device, size: int) -> torch.Tensor:
    """[size] int32 zeros on `device` through which a launch's programs find the last to arrive,
    which leaves them zeroed again: one buffer per owner, device and stream, the current one or
    `Fork`'s second, made on first use. Launches on one stream run one after another (a PDL launch
    waits for the one before it ends before it counts); a launch on the second stream gets counts
    of its own, so the two may run at once (the commit's K/V projections do).

    Raises:
        EpdraftError: the first use is inside a CUDA-graph capture (zeros made there exist only
            once the graph replays: launches before that would read garbage counts).
        ConfigError: more than the `size` of the owner's first use asked for.
    """
    device = _indexed(device)
    side = device.type == "cuda" and torch.cuda.current_stream(device) == _second_stream(device)
    key = (owner, device, side)
    if key not in _counts:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            stream = "the second stream of " if side else ""
            raise EpdraftError(f"{owner}: its first launch on {stream}{device} ran inside a CUDA-graph capture; "
                               "run the step once eagerly before capturing it (StepGraphs does)")  # fmt: skip
        _counts[key] = torch.zeros(size, dtype=torch.int32, device=device)
    if size > _counts[key].numel():
        raise ConfigError(f"{owner}: {size} arrival counts asked for, {_counts[key].numel()} made on {device}")
    return _counts[key]


def host_ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 [len(values)] on `device`, queued behind the work already on its stream without the
    host waiting: on CUDA through pinned memory and an asynchronous copy (`torch.tensor(values,
    device=cuda)` copies from pageable memory and synchronizes the stream; torch's pinned-memory
    cache keeps the staging block until the copy has run)."""
    host = torch.tensor(values, dtype=torch.long)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (Triton tile and grid sizes)."""
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def triton_installed() -> bool:
    """Whether Triton can be imported here (looked up without importing it)."""
    return importlib.util.find_spec("triton") is not None


def unsupported_reason(device_type: str) -> str | None:
    """Why no Triton kernel can run on a device of `device_type` here, or None: every family's
    first condition (each adds its own)."""
    if device_type != "cuda":
        return f"the Triton kernels run on CUDA, this rank's draft on {device_type}"
    if not triton_installed():
        # torch's Linux CUDA wheels depend on the Triton they were built with; a torch without it needs that one.
        return "Triton is not installed (it comes with torch's Linux CUDA wheels: pip install torch==2.13.0)"
    return None


def refuse_autograd(op: str, *tensors: torch.Tensor | None) -> None:
    """ConfigError when `op` is asked for gradients: its launches have no backward, and returning
    outputs without a grad_fn would drop a training step's gradients silently. A draft trained with
    autograd is built with `StepKernels.reference()` (its torch chains)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise ConfigError(f"{op}: the Triton step kernels have no backward and this call needs gradients; build "
                          "the draft with kernels=StepKernels.reference() to train it")
