"""Local helpers for the rendezvous: a free port on this node."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on this node now (for MASTER_PORT or a store when rank 0 is here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
