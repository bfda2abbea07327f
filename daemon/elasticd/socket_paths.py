"""Where the control socket and the state dir are by default, for the daemon and its clients.

Its own module, importing nothing but ``os``: elasticctl reads the default
socket path at every run, and the settings package (elasticd.config, which
re-exports both) would cost each run tens of milliseconds of imports.
"""
from __future__ import annotations

import os


def default_paths(uid: int) -> tuple[str, str]:
    """(socket, state dir) by default. Not root: $XDG_RUNTIME_DIR/elasticd/control.sock,
    else (no runtime dir, as under ``su``) the socket in the state dir under the
    user's home; never a shared directory such as /tmp, where anyone could
    create the path first."""
    if uid == 0:
        return "/run/elasticd/control.sock", "/var/lib/elasticd"
    state_home = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    state = os.path.join(state_home, "elasticd")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    sock = (os.path.join(runtime, "elasticd", "control.sock") if runtime
            else os.path.join(state, "control.sock"))
    return sock, state


def default_socket_path() -> str:
    """Where a client looks for the control socket when told nothing."""
    return os.environ.get("ELASTICD_DAEMON_SOCKET") or default_paths(os.geteuid())[0]
