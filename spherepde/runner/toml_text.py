"""TOML text of plain values: what the sweep writes into its messages and what derived sweep
files and their base configs are written with (tomllib reads TOML but does not write it)."""

from __future__ import annotations

import json
import math

__all__ = ["toml_key", "toml_value", "toml_document", "toml_short"]


def toml_key(key: str) -> str:
    """A bare key where TOML allows one, else a quoted key."""
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else json.dumps(key)


def toml_value(v) -> str:
    """A value as TOML writes it: booleans, integers, floats (nan, ±inf), strings, arrays, inline
    tables. Raises TypeError for anything else."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def toml_short(value, limit: int = 60) -> str:
    """A value as it reads in TOML, for a message: cut at `limit` characters (repr for what TOML
    cannot hold)."""
    try:
        text = toml_value(value)
    except TypeError:
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def toml_document(tables: dict) -> str:
    """TOML text of {table name: {key: value}} (values: numbers, strings, lists, inline tables)."""
    lines = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)
