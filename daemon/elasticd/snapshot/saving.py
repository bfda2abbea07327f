"""save(): copy a rank's state into the slot of its pair (the pin pair for a step on the
pin grid, $ELASTICD_SNAPSHOT_PIN_EVERY; the other pair otherwise) that does not hold the
pair's newest complete snapshot, now (``wait=True``) or from a staging copy on a
background thread.

``wait=False`` copies the tensors into a staging buffer kept between saves
(pinned when the state has CUDA tensors) before it returns, so the caller may
change them at once; one background thread (its owner is this module; it stops
at interpreter exit after the save in flight, waiting at most EXIT_WAIT_S) then
fills the slot and marks it complete. A save first waits for the one before.
"""
from __future__ import annotations

import atexit
import queue
import threading
import time

import torch

from ..workers import snapshot_format as fmt
from . import meta as metas
from . import costs, slots
from .errors import BadState, SnapshotError
from .ranks import identity
from .region import Region, pin_every, slot_names
from .structure import check_same, flatten

EXIT_WAIT_S = 60.0     # at exit, how long the save in flight may still take
POLL_S = 0.5           # how often the idle writer looks at its stop event


class SaveHandle:
    """A save in progress or done: ``wait()`` returns when the snapshot is complete
    and raises what the save raised."""

    def __init__(self, step: int):
        self.step = step
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._seen = False

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the save of step {self.step} is still running after {timeout} s")
        self._seen = True
        if self._error is not None:
            raise self._error

    def finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def unseen_error(self) -> BaseException | None:
        """The error of a finished save nobody waited for (then it counts as seen)."""
        if self._done.is_set() and not self._seen and self._error is not None:
            self._seen = True
            return self._error
        return None


class Writer:
    """The background thread that completes asynchronous saves, one at a time."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, handle: SaveHandle, work) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="elasticd-snapshot",
                                                daemon=True)
                self._thread.start()
        self._jobs.put((handle, work))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                handle, work = self._jobs.get(timeout=POLL_S)
            except queue.Empty:
                continue
            try:
                work()
            except BaseException as exc:  # handed to whoever waits for this save
                handle.finish(exc)
            else:
                handle.finish()

    def stop(self, timeout: float = EXIT_WAIT_S) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


_writer = Writer()
_lock = threading.RLock()
_pending: SaveHandle | None = None
_structures: dict[tuple, tuple] = {}    # (dir, rank) -> the signature of its last save
_staging: dict[bool, torch.Tensor] = {}  # pinned? -> the staging buffer


def _at_exit() -> None:
    if _pending is not None:
        _pending._done.wait(EXIT_WAIT_S)
    _writer.stop(POLL_S * 2)


atexit.register(_at_exit)


def settle() -> None:
    """Wait for the save in flight, if any; raise its error if nobody waited for it."""
    with _lock:
        pending = _pending
    if pending is None:
        return
    pending._done.wait()
    error = pending.unseen_error()
    if error is not None:
        raise SnapshotError(f"the asynchronous save of step {pending.step} failed: "
                            f"{error}") from error


def _staging_for(nbytes: int, pinned: bool) -> torch.Tensor:
    buf = _staging.get(pinned)
    if buf is None or buf.numel() < nbytes:
        _staging.pop(pinned, None)
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        _staging[pinned] = buf
    return buf[:nbytes]


def save(step: int, state, *, wait: bool = True) -> SaveHandle:
    """Snapshot ``state`` as ``step`` of this rank (see the package's docstring)."""
    global _pending
    t0 = time.perf_counter()
    if type(step) is not int or step < 0:
        raise BadState(f"step must be a whole number >= 0, not {step!r}")
    with _lock:
        settle()
        flat = flatten(state)
        rank, world = identity()
        region = Region.open(create=True)
        assert region is not None
        with region:
            mine = (region.key, rank)
            if mine in _structures:
                check_same(_structures[mine], flat.signature, rank)
            try:
                plan = metas.plan(flat)
                raw = metas.encode(plan)
            except ValueError as exc:
                raise BadState(str(exc)) from None
            size = fmt.data_offset(len(raw)) + plan.data_len
            names = slot_names(rank, fmt.pair(step, pin_every()))
            held = [c for c in (slots.probe(region, n, rank, world) for n in names) if c]
            name = slots.pick(held, step, names)
            m = slots.prepare(region, name, size)
        _structures[mine] = flat.signature
        slots.write_header(m, slots.complete_header(rank, world, step, len(raw), plan.data_len,
                                                    fmt.SlotState.WRITING))
        handle = SaveHandle(step)

        def finish(fill) -> None:
            slots.write_meta(m, raw)
            fill()
            slots.write_header(m, slots.complete_header(rank, world, step, len(raw),
                                                        plan.data_len, fmt.SlotState.COMPLETE))
            costs.record(save_step=step, save_total_s=time.perf_counter() - t0,
                         save_bytes=plan.data_len)

        if wait:
            finish(lambda: slots.fill(m, plan, len(raw), flat.tensors))
            handle.finish()
        else:
            pinned = torch.cuda.is_available() and any(t.is_cuda for t in flat.tensors)
            staged = _staging_for(plan.data_len, pinned)
            slots.stage(plan, flat.tensors, staged)
            _pending = handle
            _writer.submit(handle, lambda: finish(lambda: slots.fill_from(m, len(raw), staged)))
        costs.record(save_stall_s=time.perf_counter() - t0)
        costs.publish(rank)
        return handle
