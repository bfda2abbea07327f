"""The GPU check's rows: one per check (PASS / FAIL / SKIP, numbers, note), kept per step.

A step writes its rows to ``WORK/results/STEP.json`` after each one, so a
step killed at its timeout still leaves what it finished. Nothing here
imports more than the standard library: the summary must come out even
when the daemon's own dependencies could not be installed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import traceback

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
TAG_ENV = "ELASTICD_GPU_CHECK"  # every process of a run carries it: the sweep's mark


@dataclasses.dataclass(frozen=True)
class Row:
    check: str
    status: str          # PASS | FAIL | SKIP
    numbers: str = ""
    note: str = ""


class Step:
    """One step's rows, written to its results file after each one."""

    def __init__(self, name: str, work: str):
        self.name, self.work = name, work
        self.path = os.path.join(os.path.dirname(work), "results", f"{name}.json")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.rows: list[Row] = load(self.path)

    def add(self, check: str, ok: bool | None, numbers: str = "", note: str = "") -> Row:
        """A row: ``ok`` True -> PASS, False -> FAIL, None -> SKIP."""
        row = Row(check, SKIP if ok is None else PASS if ok else FAIL, numbers, note)
        self.rows.append(row)
        print(f"[{self.name}] {check}: {row.status} {numbers} {note}".rstrip(), flush=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump([dataclasses.asdict(r) for r in self.rows], fh)
        os.replace(tmp, self.path)
        return row

    def crashed(self, check: str, exc: BaseException) -> None:
        """A FAIL row for an exception; its traceback goes to the step's folder."""
        with open(os.path.join(self.work, "traceback.txt"), "a") as fh:
            traceback.print_exception(exc, file=fh)
        self.add(check, False, note=f"{type(exc).__name__}: {str(exc)[:300]}")


def load(path: str) -> list[Row]:
    """The rows in a results file ([] if there is none, or it is torn)."""
    try:
        with open(path) as fh:
            return [Row(**r) for r in json.load(fh)]
    except (OSError, ValueError, TypeError):
        return []


def markdown(rows: list[Row]) -> str:
    """The rows as a Markdown table (what bench/README.md keeps)."""
    cell = lambda s: str(s).replace("|", "/").replace("\n", " ")  # noqa: E731
    lines = ["| check | result | numbers | note |", "|---|---|---|---|"]
    lines += [f"| {cell(r.check)} | {r.status} | {cell(r.numbers)} | {cell(r.note)} |"
              for r in rows]
    return "\n".join(lines)
