"""bench/run_all.py's table: rows read from a benchmark's output, rendered with the script,
date and commit of each, and written between README.md's markers. No benchmark runs."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}",
                                                  os.path.join(REPO, "bench", name + ".py"))
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_all = _load("run_all")
rows = sys.modules["rows"]  # as run_all imports it (bench/ on its path)

NODE_LOSS = next(b for b in run_all.BENCHES if b.name == "node_loss")
OUTPUT = "\n".join([  # what node_loss_bench.py prints, trimmed
    "node loss (kill -9 of 1 of 3 nodes) -> first step on the survivors",
    "  rep 1 elasticd  survivors' workers stopped  0.50 s   first step  1.32 s",
    rows.PREFIX + "{not json",
    rows.PREFIX + json.dumps({"row": "node-loss", "elasticd": "1.40 s", "torch": "old"}),
    rows.PREFIX + json.dumps({"row": "node-loss", "elasticd": "1.32 s", "torch": "46.8 s (c10d)",
                              "matched": "19.2 s (c10d-lc2)", "ratio": "35.5x | 14.5x"}),
    rows.PREFIX + json.dumps({"row": "not-in-the-table", "elasticd": "x"}),
])
SAMPLE = "# elasticd\n\n## Benchmarks\n\nintro\n\n{begin}\n| old | table |\n|---|---|\n" \
         "| a | row |\n{end}\n\n## Status\n\nafter\n".format(begin=run_all.BEGIN, end=run_all.END)


def test_a_benchmarks_rows_are_read_from_its_output_the_last_line_winning(capsys):
    rows.emit_row("idle-daemon", elasticd="47 MB", ratio="")
    printed = capsys.readouterr().out
    assert rows.parse_rows(printed) == {"idle-daemon": {"elasticd": "47 MB", "torch": "",
                                                        "matched": "", "ratio": ""}}
    with pytest.raises(ValueError, match="unknown cells"):
        rows.emit_row("idle-daemon", speed="fast")
    assert rows.parse_rows(OUTPUT)["node-loss"] == {
        "elasticd": "1.32 s", "torch": "46.8 s (c10d)", "matched": "19.2 s (c10d-lc2)",
        "ratio": "35.5x | 14.5x"}


def test_take_keeps_the_rows_printed_with_script_date_and_commit_and_drops_the_rest():
    results = {"node-loss": {"elasticd": "stale"}, "idle-daemon": {"elasticd": "kept"}}
    assert run_all.take(results, NODE_LOSS, OUTPUT, True, "2026-11-26", "abc123") == []
    assert results["node-loss"] == {
        "elasticd": "1.32 s", "torch": "46.8 s (c10d)", "matched": "19.2 s (c10d-lc2)",
        "ratio": "35.5x | 14.5x", "script": "node_loss_bench.py", "args": ["--reps", "1"],
        "date": "2026-11-26", "commit": "abc123"}
    assert results["idle-daemon"] == {"elasticd": "kept"}  # another benchmark's: untouched
    assert "not-in-the-table" not in results
    # A script that no longer prints its row: the row is dropped, and said.
    assert run_all.take(results, NODE_LOSS, "no rows here", False, "d", "c") == [
        "node_loss_bench.py printed no row 'node-loss'"]
    assert "node-loss" not in results


def test_the_table_has_a_line_per_row_in_order_each_naming_where_it_was_measured():
    results = {}
    run_all.take(results, NODE_LOSS, OUTPUT, False, "2026-11-26", "abc123-dirty")
    lines = run_all.render(results)
    want = [r for b in run_all.BENCHES for r in b.rows]
    assert lines[0] == run_all.HEADER and len(lines) == 2 + len(want)
    assert all(len(re.split(r"(?<!\\)\|", line)) == 8 for line in lines), lines  # 6 cells
    measured = lines[2 + want.index(NODE_LOSS.rows[0])]
    assert measured == ("| kill -9 of one of 3 nodes → first step on the survivors | 1.32 s | "
                        "46.8 s (c10d) | 19.2 s (c10d-lc2) | 35.5x \\| 14.5x | "
                        "bench/node_loss_bench.py, 2026-11-26, abc123-dirty |")
    idle = lines[2 + [r.key for r in want].index("idle-daemon")]
    assert idle == ("| idle daemon | not measured on this tree yet: "
                    "`bench/run_all.py --only daemon_overhead` | | | | |")


def test_the_rewrite_touches_only_the_lines_between_the_markers(tmp_path):
    readme, results = tmp_path / "README.md", tmp_path / "results.json"
    readme.write_text(SAMPLE)
    stored = {}
    run_all.take(stored, NODE_LOSS, OUTPUT, True, "2026-11-26", "abc123")
    results.write_text(json.dumps(stored))
    assert run_all.main(["--render-only", "--readme", str(readme),
                         "--results", str(results)]) == 0
    text = readme.read_text()
    before, _, rest = SAMPLE.partition(run_all.BEGIN)
    _, _, after = rest.partition(run_all.END)
    assert text.startswith(before + run_all.BEGIN + "\n" + run_all.HEADER + "\n")
    assert text.endswith("\n" + run_all.END + after)
    assert "| old | table |" not in text
    assert "bench/node_loss_bench.py --reps 1, 2026-11-26, abc123 |" in text
    # Again: the same text (the rewrite is stable).
    run_all.main(["--render-only", "--readme", str(readme), "--results", str(results)])
    assert readme.read_text() == text
    with pytest.raises(ValueError, match="bench-table:begin"):
        run_all.rewrite("no markers\n", [])


def test_every_benchmark_of_the_table_is_a_script_here_with_its_own_name_and_rows():
    names = [b.name for b in run_all.BENCHES]
    keys = [r.key for b in run_all.BENCHES for r in b.rows]
    assert len(set(names)) == len(names) and len(set(keys)) == len(keys)
    for b in run_all.BENCHES:
        assert os.path.isfile(os.path.join(REPO, "bench", b.script)), b.script
    with pytest.raises(SystemExit):
        run_all.main(["--only", "no-such-bench", "--render-only"])
