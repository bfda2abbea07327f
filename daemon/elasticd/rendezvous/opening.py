"""Opening one watched key's record as the views take it: verified, newer, typed, or refused.

The jobs view (rendezvous/view.py) and the phase watch (rendezvous/phase_watch.py)
take every record the same way: ``records.open`` (trust/sealed.py: the cluster
key's MAC bound to the key name, the size cap, the decoder), a writer's count
above the last one taken of that key (``newer``), the typed record built from
the body (``typed``: its ValueError a refusal). ``refusing`` turns whatever goes
wrong with one key into a refusal of that key (trust/refusals.py), never an
exception out of the watch.
"""
from __future__ import annotations

import contextlib

from ..trust.refusals import Refusals
from ..trust.sealed import Kind, Opened, Reason, Refused


def newer(records, kind: Kind, key: str, value, seqs: dict, held: bool,
          relisted: bool) -> tuple[Opened, bool]:
    """The record at ``key``, opened, if its writer's count is above ``seqs[key]`` (the
    last one taken), and whether it is the record held (``held``) listed again (its
    count equal to the last, ``relisted``); Refused otherwise. The caller sets
    ``seqs[key]`` once it took the record."""
    opened = records.open(kind, key, value)
    last = seqs.get(key, 0)
    if opened.seq and opened.seq <= last:
        if relisted and opened.seq == last and held:
            return opened, True
        raise Refused(Reason.REPLAYED, "its writer's count is not above the last one's")
    return opened, False


def typed(build, doc: dict):
    """``build(doc)``; what it finds wrong with the body (ValueError, TypeError,
    KeyError) is a refusal of the record."""
    try:
        return build(doc)
    except (ValueError, TypeError, KeyError) as exc:
        raise Refused(Reason.INVALID, str(exc)[:200]) from None


@contextlib.contextmanager
def refusing(refusals: Refusals, kind: Kind, key: str):
    """Within it, a Refused is ``key``'s refusal, counted and logged once; any other
    exception (a bug, or a value nothing foresaw) too, with its trace. Never raises."""
    try:
        yield
    except Refused as exc:
        refusals.refused(kind, key, exc.reason, exc.detail)
    except Exception as exc:
        refusals.refused(kind, key, Reason.ERROR, f"{type(exc).__name__}: {exc}", trace=True)
