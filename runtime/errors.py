"""Errors a person can act on: each names the field at fault and the fix.

A message is one short line whatever the input: a value echoed in it goes through ``short``
(at most ``ECHO_LIMIT`` characters, computed without rendering the whole value), and a
``ConfigError``'s problem and fix are each cut at ``MESSAGE_LIMIT`` characters as a backstop.
"""

from __future__ import annotations

import reprlib
from typing import Any

ECHO_LIMIT = 200  # characters of a value an error message quotes
MESSAGE_LIMIT = 1000  # characters of a ConfigError's problem, and of its fix
FIELD_LIMIT = 300  # characters of a ConfigError's field (a path of names, one of which may be a key it quotes)


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` as one line of at most ``limit`` characters (``...`` where it was cut)."""
    text = " ".join(text[:4 * limit].split())  # no more than 4x the limit is ever looked at
    return _cut(text, limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _bounded_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel, r.maxdict, r.maxlist, r.maxtuple, r.maxset = 4, 8, 8, 8, 8
    r.maxstring = r.maxother = r.maxlong = ECHO_LIMIT
    return r


_REPR = _bounded_repr()


def short(value: Any, limit: int = ECHO_LIMIT) -> str:
    """``repr(value)`` in at most ``limit`` characters, in time that does not grow with the value
    (a list of a million items, a string of a megabyte, a structure a YAML alias repeats)."""
    try:
        text = _REPR.repr(value)
    except Exception:  # e.g. an int too long to print: its type says enough
        text = f"<{type(value).__name__}>"
    return clip(text, limit)


def exit_text(code: int | None) -> str:
    """How a process ended, in words: ``exit code 3``, ``signal SIGKILL`` (a Popen returncode of
    -9), ``exit code 137 (SIGKILL)`` (a shell's or a container's 128 + N)."""
    import signal

    def name(n: int) -> str:
        try:
            return signal.Signals(n).name
        except ValueError:
            return f"signal {n}"

    if code is None:
        return "no exit status yet"
    if code < 0:
        named = name(-code)
        return named if named.startswith("signal ") else f"signal {named}"
    if code > 128 and not name(code - 128).startswith("signal "):
        return f"exit code {code} ({name(code - 128)})"
    return f"exit code {code}"


class ConfigError(ValueError):
    """A model spec, parallel config or job field is invalid.

    ``field`` names the offending setting; ``fix`` says what to change. ``str()`` is one line.
    """

    def __init__(self, field: str, problem: str, fix: str = "") -> None:
        field, problem, fix = _cut(field, FIELD_LIMIT), _cut(problem, MESSAGE_LIMIT), _cut(fix, MESSAGE_LIMIT)
        self.field = field
        self.problem = problem
        self.fix = fix
        text = f"{field}: {problem}"
        if fix:
            text += f" (fix: {fix})"
        super().__init__(text)


class UnsupportedModelError(ConfigError):
    """The model is valid but uses an architecture liveshard cannot lay out yet."""


class RunFailed(RuntimeError):
    """A run that did not finish: a worker died and nothing recovered, the coordinator failed the
    job or refused a change, the final checkpoint is missing. ``str()`` is one line saying why
    (and where the logs are); the CLI prints it and exits 1."""


class RunTimedOut(RunFailed, TimeoutError):
    """A run that waited too long for something that never happened."""
