"""Whether this host's name resolves, as torch's workers need it: one bounded look.

gloo binds each rank's device to the address ``gethostname()`` resolves to
(falling back to loopback, with a warning, when it does not: ranks on other
nodes then cannot reach it), and torchrun's rendezvous hosts (``getfqdn()``)
hand that name to every worker as the store's address: a name that does not
resolve makes torch's c10d client retry ``gai error -2`` until its timeout,
minutes later, with nothing saying why. ``problem()`` names it at once: the
lookup runs in a thread of its own and is waited for at most ``timeout``
seconds (a resolver that does not answer is as bad as a wrong answer).
Standard library only: the test suite's preflight (tests/conftest.py) asks too.
"""
from __future__ import annotations

import socket
import threading

DEFAULT_TIMEOUT = 1.0   # seconds: a lookup of one's own name through /etc/hosts takes microseconds


def _resolve(name: str, out: list) -> None:
    try:
        out.append(socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP))
    except (OSError, UnicodeError) as exc:
        out.append(exc)


def problem(name: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> str:
    """One sentence saying why ``name`` (default: this host's) does not resolve, or ""."""
    name = socket.gethostname() if name is None else name
    out: list = []
    worker = threading.Thread(target=_resolve, args=(name, out), daemon=True,
                              name="hostname-lookup")
    worker.start()
    worker.join(timeout)
    if not out:
        why = f"no answer from the resolver within {timeout:g} s"
    elif isinstance(out[0], BaseException):
        why = getattr(out[0], "strerror", None) or str(out[0])
    elif not out[0]:
        why = "no address"
    else:
        return ""
    return (f"this host's name {name!r} does not resolve ({why}): torch's workers need it "
            f"(gloo binds to its address, torchrun hands it to the ranks as the store's "
            f"address); add it to /etc/hosts, e.g. `127.0.1.1 {name}` on a single machine "
            f"or this node's own address in a cluster")


_cache_lock = threading.Lock()
_cache: dict = {}   # {"at": monotonic time of the look, "problem": what it said}


def cached_problem(max_age: float = 30.0, timeout: float = DEFAULT_TIMEOUT, now=None) -> str:
    """``problem()`` of this host, looked at most once per ``max_age`` seconds (for
    ``elasticctl nodes``: a short call must not wait on a resolver each time)."""
    import time
    now = time.monotonic() if now is None else now
    with _cache_lock:
        if _cache and now - _cache["at"] < max_age:
            return _cache["problem"]
        said = problem(timeout=timeout)
        _cache.update(at=now, problem=said)
        return said
