"""Who may drive a weight update: the rules both plugins' update routes apply (closed by default).

* Update routes without an API key are refused unless the server listens on loopback only.
* A worker joins the trainer's NCCL rendezvous only at an address the engine's operator allowed:
  loopback always; anything else must be listed in ``MXFP8_GRID_NCCL_HOSTS`` (comma-separated
  hosts or IPs) in the engine's environment -- so a caller of ``grid_nccl_init`` cannot make the
  workers connect to a host of its choosing.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Optional

NCCL_HOSTS_ENV = "MXFP8_GRID_NCCL_HOSTS"


class Refused(PermissionError):
    """A request the update routes refuse by policy (not a malformed one)."""


def is_loopback(host: Optional[str]) -> bool:
    """Is ``host`` a loopback address (127.0.0.0/8, ::1, localhost)?  None / "" / 0.0.0.0 are not."""
    if not host:
        return False
    h = str(host).strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_update_access(listen_host: Optional[str], api_keys: set, key_flags: str = "--api-key") -> None:
    """Raise :class:`Refused` when update routes would be open to the network without a key.
    ``key_flags``: how the caller's engine is given a key, for the message (vLLM: ``--api-key /
    VLLM_API_KEY``; SGLang: ``--api-key / --admin-api-key``)."""
    if api_keys or is_loopback(listen_host):
        return
    raise Refused(f"weight-update routes need an API key ({key_flags}) unless the server listens on "
                  f"loopback only (--host 127.0.0.1); this server listens on {listen_host or 'all interfaces'}")


def check_rendezvous(host: str) -> None:
    """Raise :class:`Refused` unless ``host`` is loopback or listed in ``MXFP8_GRID_NCCL_HOSTS``."""
    if is_loopback(host):
        return
    allowed = {h.strip().lower() for h in os.environ.get(NCCL_HOSTS_ENV, "").split(",") if h.strip()}
    if str(host).strip().lower() in allowed:
        return
    raise Refused(f"NCCL rendezvous at {host!r} is not allowed: the engine joins loopback addresses and the hosts "
                  f"listed in {NCCL_HOSTS_ENV} (set in the engine's environment) only")
