"""The line a benchmark prints for each row of the README's table it measured.

A benchmark that feeds the table calls ``emit_row(ROW, elasticd=..., torch=...,
matched=..., ratio=...)`` once per row, each cell a short text as the table
shows it: ``elasticd`` ours, ``torch`` torch/torchrun at its defaults,
``matched`` torchrun with its settings matched to ours where torch has them
(last call, timeouts; "" where it has none), ``ratio`` the comparison.
bench/run_all.py reads these lines (``parse_rows``) from the script's output;
the rest of the output is for people. No dependencies: the tests import it.
"""
from __future__ import annotations

import json

PREFIX = "BENCH-ROW "
CELLS = ("elasticd", "torch", "matched", "ratio")


def emit_row(row: str, **cells: str) -> None:
    """Print one row's cells for bench/run_all.py."""
    unknown = set(cells) - set(CELLS)
    if unknown:
        raise ValueError(f"unknown cells {sorted(unknown)}; cells are {', '.join(CELLS)}")
    print(PREFIX + json.dumps({"row": row, **{k: str(v) for k, v in cells.items()}},
                              sort_keys=True), flush=True)


def parse_rows(text: str) -> dict[str, dict[str, str]]:
    """The rows a benchmark's output carries: row -> its cells (the last line wins)."""
    rows: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        try:
            doc = json.loads(line[len(PREFIX):])
        except ValueError:
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("row"), str):
            continue
        rows[doc["row"]] = {c: str(doc.get(c, "")) for c in CELLS}
    return rows
