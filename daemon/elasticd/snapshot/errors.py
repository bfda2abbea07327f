"""The errors elasticd.snapshot raises: one base, SnapshotError, and a subclass per cause."""
from __future__ import annotations


class SnapshotError(Exception):
    """A snapshot could not be saved or restored; the message says why and what to do."""


class BadState(SnapshotError):
    """The state holds something that is neither a tensor nor a plain value (the path is named)."""


class StructureChanged(SnapshotError):
    """This rank saved a different structure (keys, types, dtypes, shapes) than last time."""


class OverBudget(SnapshotError):
    """The save would grow the job's snapshot dir past its byte budget on this node."""


class NoSpace(SnapshotError):
    """The filesystem under the snapshot dir cannot hold the save."""


class NotOwned(SnapshotError):
    """The snapshot dir or a slot file is not the caller's own private file (another
    user's, readable by others, or a symbolic link): refused, never followed."""
