"""Host addresses: whether a rendezvous address is this host's loopback (no other host can join)."""

from __future__ import annotations

import ipaddress


def is_loopback(address: str) -> bool:
    """Whether `address` (an IP or "localhost") names this host's loopback: no other host can join there."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
