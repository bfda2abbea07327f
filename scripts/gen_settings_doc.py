"""Rewrite docs/settings.md from the settings in elasticd.config.

Run after adding or changing a setting: python scripts/gen_settings_doc.py
(tests/test_docs.py fails while the doc and the code disagree; ``--check``
says whether they do without writing). Everything above the line
``<!-- settings:begin -->`` in docs/settings.md is written by hand and kept;
everything below it is made here from the public surface of elasticd.config,
as packaging/elasticd.toml is (scripts/gen_sample_config.py): ``SECTIONS``
(section name -> settings dataclass), ``ENV_PREFIX``, and each field's
metadata (help, min, max, choices, exclusive_min; elasticd/settingfield.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

MARKER = "<!-- settings:begin -->"
PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "settings.md")

# Where each section's settings are explained in prose (docs/ pages); a section
# missing here is listed without a pointer.
EXPLAINED_IN = {
    "daemon": "[operating a cluster](operating.md), [GPUs](gpus.md)",
    "etcd": "[operating a cluster](operating.md)",
    "cluster": "[security model](security.md)",
    "membership": "[operating a cluster](operating.md)",
    "rendezvous": "[the restart ladder](restarts.md)",
    "agent": "[the restart ladder](restarts.md), [hangs](hangs.md), "
             "[worker templates and spares](templates.md)",
    "inprocess": "[the restart ladder](restarts.md)",
    "control": "[security model](security.md)",
    "limits": "[security model](security.md)",
    "metrics": "[metrics and alerts](metrics.md)",
    "events": "[operating a cluster](operating.md)",
    "retention": "[retention](retention.md)",
    "snapshot": "[operating a cluster](operating.md)",
}


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _literal(value: Any) -> str:
    """The value as it is written in the TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, str)):
        return json.dumps(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _human(name: str, help_text: str, value: Any) -> str:
    """A reading aid for large byte counts and long durations, e.g. ' (64 MiB)'."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return ""
    if (name.endswith("bytes") or help_text.startswith("bytes")) and value >= 1024:
        for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value >= size and value % size == 0:
                return f" ({int(value // size)} {unit})"
        return ""
    if help_text.startswith("seconds") and value >= 3600:
        for unit, size in (("day", 86400), ("hour", 3600)):
            if value % size == 0:
                count = int(value // size)
                return f" ({count} {unit}{'' if count == 1 else 's'})"
    return ""


def _rule(meta: dict) -> str:
    rules = []
    if meta.get("choices"):
        rules.append("one of " + ", ".join(f"`{c}`" for c in meta["choices"]))
    if meta.get("min") is not None:
        rules.append(f"{'>' if meta.get('exclusive_min') else '≥'} {_number(meta['min'])}")
    if meta.get("max") is not None:
        rules.append(f"≤ {_number(meta['max'])}")
    return ", ".join(rules)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _intro(cls: type) -> str:
    """The class docstring, if one was written (a dataclass makes up its own otherwise)."""
    doc = cls.__doc__ or ""
    if not doc or doc.startswith(cls.__name__ + "("):
        return ""
    first = doc.strip().split("\n\n")[0]
    return " ".join(first.split()).replace("``", "`")


def render(config: Any) -> str:
    """The generated part of docs/settings.md: one table per section of ``config.SECTIONS``."""
    out = []
    for sname, cls in config.SECTIONS.items():
        out += [f"## [{sname}]", ""]
        intro = _intro(cls)
        if intro:
            out += [intro, ""]
        if sname in EXPLAINED_IN:
            out += [f"Explained in {EXPLAINED_IN[sname]}.", ""]
        out += ["| setting | default | allowed | environment variable | what |",
                "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            meta = f.metadata
            value = _default(f)
            env = f"{config.ENV_PREFIX}{sname}_{f.name}".upper()
            default = f"`{_literal(value)}`{_human(f.name, meta['help'], value)}"
            out.append(f"| `{sname}.{f.name}` | {_cell(default)} | {_cell(_rule(meta))} "
                       f"| `{env}` | {_cell(meta['help'])} |")
        out.append("")
    return "\n".join(out)


def expected(current: str, config: Any) -> str:
    """``current`` (the doc as it is) with everything below the marker made anew."""
    if MARKER not in current:
        raise SystemExit(f"{PATH}: no line {MARKER!r} to write below")
    head = current[:current.index(MARKER) + len(MARKER)]
    return head + "\n\n" + render(config)


def main(argv: list[str]) -> int:
    from elasticd import config
    with open(PATH) as fh:
        current = fh.read()
    want = expected(current, config)
    if "--check" in argv:
        if current != want:
            print("docs/settings.md differs from elasticd.config: "
                  "run python scripts/gen_settings_doc.py", file=sys.stderr)
            return 1
        return 0
    if current != want:
        with open(PATH, "w") as fh:
            fh.write(want)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
