"""The settings as people read them: the sample TOML file, ``--help-config``, and
``documented()``, each setting's name, default, help text and bounds (what
docs/settings.md is made from).
"""
from __future__ import annotations

import dataclasses
import json
import textwrap
from dataclasses import dataclass
from typing import Any, Iterator

from .loading import ENV_PREFIX
from .model import SECTIONS


@dataclass(frozen=True)
class Setting:
    """One setting as its field declares it (settingfield.setting)."""
    section: str
    name: str
    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    exclusive_min: bool = False
    choices: tuple[str, ...] | None = None

    @property
    def env(self) -> str:
        """The environment variable that sets it."""
        return f"{ENV_PREFIX}{self.section}_{self.name}".upper()

    def rules(self) -> list[str]:
        """Its bounds in words: ``one of: a, b``, ``>= 0``, ``<= 60``."""
        out = []
        if self.choices:
            out.append("one of: " + ", ".join(self.choices))
        if self.min is not None:
            out.append(f"{'>' if self.exclusive_min else '>='} {_num(self.min)}")
        if self.max is not None:
            out.append(f"<= {_num(self.max)}")
        return out


def documented() -> Iterator[Setting]:
    """Every setting, section by section in ``SECTIONS`` order, fields in declaration order."""
    for sname, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            meta = f.metadata
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
                else f.default
            yield Setting(sname, f.name, default, meta["help"], meta.get("min"),
                          meta.get("max"), bool(meta.get("exclusive_min")),
                          meta.get("choices"))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, str)):
        return json.dumps(value)
    return repr(value)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def sample_toml(header: str) -> str:
    """The sample config file: every setting commented out, with its default."""
    out = [header.rstrip("\n"), ""]
    section = ""
    for s in documented():
        if s.section != section:
            if section:
                out[-1:] = [""]
            out.append(f"[{s.section}]")
            section = s.section
        out.extend("# " + line for line in textwrap.wrap(s.help, 78))
        out.append("# " + "; ".join(s.rules() + [f"env {s.env}"]))
        out.append(f"# {s.name} = {_toml_value(s.default)}")
        out.append("")
    out[-1:] = []
    return "\n".join(out) + "\n"


def describe() -> str:
    """Every setting with its default and meaning, for --help-config."""
    lines = []
    section = ""
    for s in documented():
        if s.section != section:
            lines.append(f"[{s.section}]")
            section = s.section
        lines.append(f"  {s.name} = {s.default!r}  # {s.help}  (env {s.env})")
    return "\n".join(lines)
