"""The memory ceiling a bench's floor divides bytes by, per kind of GPU: a large device-to-device
copy's bandwidth measured on that kind of machine here (bytes read plus bytes written; the device
library's KINDS.md), not the datasheet's. A floor on an H100 counted at the H200's rate would put
every ratio 1.4x too high."""

from __future__ import annotations

COPY_BYTES_PER_S: dict[str, float] = {"H200": 4.3e12, "H100": 3.0e12}


def memory_bytes_per_s(device_name: str) -> tuple[float, str]:
    """(bytes/s, which measurement) for a `torch.cuda.get_device_name()`; a GPU with none here gets
    the H200's, and the label says so."""
    for kind, rate in COPY_BYTES_PER_S.items():
        if kind in device_name:
            return rate, f"{kind} copy {rate / 1e12:.1f} TB/s"
    return COPY_BYTES_PER_S["H200"], f"no measurement for {device_name}: the H200's copy 4.3 TB/s"
