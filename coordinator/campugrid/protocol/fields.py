"""How a spec's fields are checked: each refusal names the field and says what would be
accepted (protocol/spec.py and protocol/verify.py)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from campugrid.protocol.errors import InvalidInput

MAX_COMMAND_ARGS = 256
MAX_ARG_LEN = 8192


def require(ok: bool, field: str, what: str) -> None:
    if not ok:
        raise InvalidInput(f"{field}: {what}")


def no_unknown(data: Mapping[str, Any], cls: type, where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(sorted(known))})"
            raise InvalidInput(f"{where}: unknown field '{key}'{hint}")


def integer(d: Mapping[str, Any], key: str, default: int, lo: int, hi: int, where: str) -> int:
    v = d.get(key, default)
    require(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi,
            f"{where}.{key}" if where != "spec" else key, f"must be an integer from {lo} to {hi}")
    return int(v)


def number(d: Mapping[str, Any], key: str, default: float, lo: float, hi: float, where: str) -> float:
    v = d.get(key, default)
    require(isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi,
            f"{where}.{key}", f"must be a number from {lo} to {hi}")
    return float(v)


def parse_command(command: Any, field: str) -> tuple[str, ...] | None:
    """A command as a spec gives it: a string (run by sh -c) or a list of arguments."""
    if command is None:
        return None
    if isinstance(command, str):
        command = ["sh", "-c", command]
    require(isinstance(command, (list, tuple)) and 0 < len(command) <= MAX_COMMAND_ARGS,
            field, f"must be a string or a list of 1 to {MAX_COMMAND_ARGS} strings")
    for i, arg in enumerate(command):
        require(isinstance(arg, str) and len(arg) <= MAX_ARG_LEN and "\x00" not in arg,
                f"{field}[{i}]",
                f"must be a string of at most {MAX_ARG_LEN} characters without NUL")
    return tuple(command)
