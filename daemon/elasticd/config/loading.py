"""Loading the settings: defaults, the TOML file, ``ELASTICD_<SECTION>_<FIELD>``
environment variables and flags, later ones winning; every bad field named.
"""
from __future__ import annotations

import dataclasses
import grp
import os
import socket
import tomllib
from typing import Any, Mapping

from ..socket_paths import default_paths, default_socket_path  # noqa: F401 (re-exported)
from .model import SECTIONS, Config
from .rules import check_relations

DEFAULT_CONFIG_PATH = "/etc/elasticd/elasticd.toml"
ENV_PREFIX = "ELASTICD_"


class ConfigError(ValueError):
    """One or more settings are invalid; ``errors`` names each bad field."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid configuration:\n  " + "\n  ".join(errors))


def _coerce(section: str, name: str, ftype: Any, raw: Any, errors: list[str]) -> Any:
    """Turn a raw value (TOML value or env/flag string) into the field's type."""
    where = f"{section}.{name}"
    tname = ftype if isinstance(ftype, str) else ftype.__name__
    try:
        if tname == "bool":
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(raw, str) and raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tname == "int":
            if isinstance(raw, bool):
                raise ValueError
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return int(raw)
        if tname == "float":
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if tname == "list":
            if isinstance(raw, str):
                return [p.strip() for p in raw.split(",") if p.strip()]
            if isinstance(raw, list) and all(isinstance(x, str) for x in raw):
                return list(raw)
            raise ValueError
        if tname == "str":
            if not isinstance(raw, (str, int)) or isinstance(raw, bool):
                raise ValueError
            return str(raw)
    except (TypeError, ValueError):
        pass
    errors.append(f"{where}: expected {tname}, got {raw!r}")
    return None


def _check_field(section: str, f: dataclasses.Field, value: Any, errors: list[str]) -> None:
    meta = f.metadata
    where = f"{section}.{f.name}"
    if meta.get("choices") and value not in meta["choices"]:
        errors.append(f"{where}: must be one of {', '.join(meta['choices'])}, got {value!r}")
    lo, hi = meta.get("min"), meta.get("max")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value != value or value in (float("inf"), float("-inf")):
            errors.append(f"{where}: must be a finite number, got {value!r}")
        elif lo is not None and (value < lo or (meta.get("exclusive_min") and value == lo)):
            op = ">" if meta.get("exclusive_min") else ">="
            errors.append(f"{where}: must be {op} {lo}, got {value!r}")
        elif hi is not None and value > hi:
            errors.append(f"{where}: must be <= {hi}, got {value!r}")


def load(path: str | None = None, env: Mapping[str, str] | None = None,
         overrides: Mapping[str, Any] | None = None) -> Config:
    """Build and validate the settings.

    ``path``: TOML file; None reads ``/etc/elasticd/elasticd.toml`` if present.
    ``env``: environment to read ``ELASTICD_*`` from (default ``os.environ``).
    ``overrides``: ``{"section.field": value}`` from flags; wins over all.
    """
    env = os.environ if env is None else env
    errors: list[str] = []
    raw: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    source = ""

    file_path = path if path is not None else (
        DEFAULT_CONFIG_PATH if os.path.exists(DEFAULT_CONFIG_PATH) else None)
    if file_path:
        try:
            with open(file_path, "rb") as fh:
                data = tomllib.load(fh)
            source = file_path
        except FileNotFoundError:
            raise ConfigError([f"config file {file_path}: does not exist"]) from None
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError([f"config file {file_path}: {exc}"]) from None
        for sname, body in data.items():
            if sname not in SECTIONS:
                errors.append(f"{sname}: unknown section (known: {', '.join(SECTIONS)})")
                continue
            if not isinstance(body, dict):
                errors.append(f"{sname}: must be a table, got {body!r}")
                continue
            raw[sname].update(body)

    for sname, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            key = f"{ENV_PREFIX}{sname}_{f.name}".upper()
            if key in env:
                raw[sname][f.name] = env[key]

    for dotted, value in (overrides or {}).items():
        sname, _, fname = dotted.partition(".")
        if sname not in SECTIONS:
            errors.append(f"{dotted}: unknown section (known: {', '.join(SECTIONS)})")
            continue
        raw[sname][fname] = value

    sections: dict[str, Any] = {}
    for sname, cls in SECTIONS.items():
        known = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for fname, value in raw[sname].items():
            f = known.get(fname)
            if f is None:
                errors.append(f"{sname}.{fname}: unknown setting (known: {', '.join(known)})")
                continue
            coerced = _coerce(sname, fname, f.type, value, errors)
            if coerced is not None:
                _check_field(sname, f, coerced, errors)
                values[fname] = coerced
        sections[sname] = cls(**values)

    cfg = Config(**sections, source=source)
    cfg = _resolve_defaults(cfg)
    check_relations(cfg, errors)
    if errors:
        raise ConfigError(errors)
    return cfg


def _resolve_defaults(cfg: Config) -> Config:
    d = cfg.daemon
    sock, state = default_paths(os.geteuid())
    d = dataclasses.replace(
        d,
        node_id=d.node_id or socket.gethostname().split(".")[0],
        socket=d.socket or sock,
        state_dir=d.state_dir or state,
        slots=d.slots or (os.cpu_count() or 1),
    )
    snap = cfg.snapshot
    if not snap.root:
        snap = dataclasses.replace(snap, root=default_snapshot_dir(os.geteuid()))
    return dataclasses.replace(cfg, daemon=d, snapshot=snap)


def default_snapshot_dir(uid: int) -> str:
    """Where jobs' snapshot dirs live by default: tmpfs, one root per daemon user (a
    user's own daemon never meets root's dir)."""
    return "/dev/shm/elasticd" if uid == 0 else f"/dev/shm/elasticd-{uid}"


def socket_gid(cfg: Config) -> int | None:
    """The gid of ``daemon.socket_group``, or None if there is no such group."""
    g = cfg.daemon.socket_group
    if not g:
        return None
    try:
        return int(g) if g.isdigit() else grp.getgrnam(g).gr_gid
    except KeyError:
        return None

