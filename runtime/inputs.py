"""Reading the files a person hands over (job manifests, model files, JSON configs): every way
such a file can be bad — unreadable, not UTF-8, not YAML/JSON, nested past any sane depth — is a
one-line ``ConfigError`` naming the file and the fix, never a traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from liveshard.runtime.errors import ConfigError

MAX_INPUT_BYTES = 64 << 20  # a manifest, model file or config.json is a few KiB; this is no such file


def read_text(path: str | os.PathLike, field: str, *, what: str = "file", limit: int = MAX_INPUT_BYTES) -> str:
    """The UTF-8 text of ``path``. ``field`` names the flag or setting that gave the path."""
    p = Path(path)
    try:
        if p.stat().st_size > limit:
            raise ConfigError(field, f"{p} is {p.stat().st_size:,} bytes, not a {what}",
                              f"give a {what} (at most {limit >> 20} MiB)")
        data = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(field, f"{p} does not exist", f"give the path of a {what}") from None
    except IsADirectoryError:
        raise ConfigError(field, f"{p} is a directory", f"give the path of a {what}") from None
    except OSError as e:
        raise ConfigError(field, f"cannot read {p}: {e.strerror or e}", f"give the path of a readable {what}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(field, f"{p}: byte {e.start} (line {line}) is not UTF-8 ({data[e.start]:#04x})",
                          "save the file as UTF-8 text") from None


def parse_yaml_all(text: str, source: str, field: str) -> list[Any]:
    """Every document of the YAML ``text`` (``source`` names it in messages)."""
    import yaml

    try:
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        raise ConfigError(field, f"{source} is not valid YAML: {_first_line(e)}",
                          "fix the YAML at the place named") from None
    except RecursionError:
        raise ConfigError(field, f"{source} nests too deeply to be a {_kind(field)}",
                          "write it with far fewer levels of nesting") from None
    except (ValueError, TypeError, OverflowError) as e:  # e.g. a timestamp or number PyYAML cannot build
        raise ConfigError(field, f"{source} holds a value YAML cannot read: {_first_line(e)}",
                          "fix the value at the place named") from None


def load_yaml_all(path: str | os.PathLike, field: str, *, what: str = "YAML file") -> list[Any]:
    return parse_yaml_all(read_text(path, field, what=what), str(path), field)


def load_yaml(path: str | os.PathLike, field: str, *, what: str = "YAML file") -> Any:
    docs = load_yaml_all(path, field, what=what)
    if len(docs) > 1:
        raise ConfigError(field, f"{path} holds {len(docs)} YAML documents", "give a file with one")
    return docs[0] if docs else None


def json_problem(e: json.JSONDecodeError, *, line: bool = True) -> str:
    """What is wrong and where, in words: ``invalid control character (a raw tab or line break
    inside a string: write it as \\t or \\n) at line 1, column 17``."""
    what = e.msg.removesuffix(" at").rstrip(":")
    if what.startswith("Invalid control character"):
        char = e.doc[e.pos] if isinstance(e.doc, str) and 0 <= e.pos < len(e.doc) else ""
        escaped = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}.get(char, f"\\u{ord(char):04x}" if char else "")
        named = {"\t": "a raw tab", "\n": "a raw line break", "\r": "a raw carriage return"}.get(
            char, f"the raw control character U+{ord(char):04X}" if char else "a raw control character")
        what = f"invalid control character ({named} inside a string: write it as {escaped or 'an escape'})"
    else:
        what = what[:1].lower() + what[1:]
    return f"{what} at line {e.lineno}, column {e.colno}" if line else f"{what} at column {e.colno}"


def parse_json(text: str, source: str, field: str) -> Any:
    """The JSON value of ``text``; nesting past Python's recursion limit is bad input too."""
    it = "" if source == field else f"{source} "  # the error names its field first: a file's path once
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(field, f"{it}is not valid JSON ({json_problem(e)})",
                          "fix the JSON at the place named") from None
    except RecursionError:
        raise ConfigError(field, f"{it}nests too deeply", "write it with far fewer levels of nesting") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise ConfigError(field, f"{it}holds a value JSON cannot read: {_first_line(e)}") from None


def load_json(path: str | os.PathLike, field: str, *, what: str = "JSON file") -> Any:
    return parse_json(read_text(path, field, what=what), str(path), field)


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return "; ".join(lines[:2])[:200] if lines else type(e).__name__


def _kind(field: str) -> str:
    return "job manifest" if "job" in field else "model or config file"


__all__ = ["MAX_INPUT_BYTES", "load_json", "load_yaml", "load_yaml_all", "parse_json", "parse_yaml_all",
           "read_text"]
