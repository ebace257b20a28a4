"""Reading the files a person hands over (job manifests, model files, JSON configs): every way
such a file can be bad — unreadable, not UTF-8, not YAML/JSON, nested past any sane depth, too
large, a YAML "bomb" of aliases — is a one-line ``ConfigError`` naming the file and the fix, never
a traceback, and is found in bounded time and memory.

Bounds (docs/architecture.md, "Inputs"):

- a job manifest (``--job``, the operator's ``LIVESHARD_TRAINING``) is at most ``MAX_JOB_BYTES``
  (1 MiB; a real one is a few KiB); any other file read here at most ``MAX_INPUT_BYTES``;
- a YAML document expands, aliases included, to at most ``MAX_YAML_VALUES`` values; an alias to
  its own enclosing node (a recursive structure) is refused. The check runs on the composed node
  graph before any Python object is built, in time linear in the file;
- a value echoed in an error message is at most ``ECHO_LIMIT`` characters (``errors.short``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from liveshard.runtime.errors import ECHO_LIMIT, ConfigError, clip

MAX_INPUT_BYTES = 64 << 20  # a model file or config.json is a few KiB; this is no such file
MAX_JOB_BYTES = 1 << 20  # a job manifest is a few KiB (the API server's own limit is ~1.5 MiB)
MAX_YAML_VALUES = 1_000_000  # values of a YAML document, aliases expanded (1 MiB written out holds fewer)
MAX_TOKENIZER_BYTES = 64 << 20  # a tokenizer.json, .model, vocab.json or merges.txt (Llama 3's: 9 MB)


def size_text(n: int) -> str:
    """``1 MiB``, ``64 MiB``, ``512 KiB``, ``100 bytes``: a limit in words."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n:,} bytes"


def too_large(field: str, path: Any, size: int | None, limit: int, what: str) -> ConfigError:
    """The one line for a file over its cap (``size`` None: more than the cap was readable)."""
    got = f"is {size:,} bytes" if size is not None else f"holds more than {limit:,} bytes"
    return ConfigError(field, f"{path} {got}, over the {size_text(limit)} a {what} may be",
                       f"give a {what} of at most {size_text(limit)}")


def check_size(path: str | os.PathLike, field: str, *, what: str, limit: int) -> int:
    """``path``'s size in bytes, refused (one line) above ``limit``: for files a library reads
    itself (a tokenizer), checked before it does."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ConfigError(field, f"cannot read {path}: {e.strerror or e}", f"give the path of a readable {what}") from None
    if size > limit:
        raise too_large(field, path, size, limit, what)
    return size


def read_bytes(path: str | os.PathLike, field: str, *, what: str = "file", limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of ``path``, at most ``limit`` of them: a larger file (or a device or pipe that
    never ends) is refused after reading ``limit + 1`` bytes at most."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise too_large(field, p, size, limit, what)
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise ConfigError(field, f"{p} does not exist", f"give the path of a {what}") from None
    except IsADirectoryError:
        raise ConfigError(field, f"{p} is a directory", f"give the path of a {what}") from None
    except OSError as e:
        raise ConfigError(field, f"cannot read {p}: {e.strerror or e}", f"give the path of a readable {what}") from None
    if len(data) > limit:
        raise too_large(field, p, None, limit, what)
    return data


def read_text(path: str | os.PathLike, field: str, *, what: str = "file", limit: int = MAX_INPUT_BYTES) -> str:
    """The UTF-8 text of ``path`` (at most ``limit`` bytes). ``field`` names the flag or setting
    that gave the path."""
    p = Path(path)
    data = read_bytes(p, field, what=what, limit=limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(field, f"{p}: byte {e.start} (line {line}) is not UTF-8 ({data[e.start]:#04x})",
                          "save the file as UTF-8 text") from None


def parse_yaml_all(text: str, source: str, field: str, *, max_values: int = MAX_YAML_VALUES) -> list[Any]:
    """Every document of the YAML ``text`` (``source`` names it in messages). Each document's
    node graph is checked before it is built: at most ``max_values`` values once its aliases are
    expanded, and no alias inside the node it names (a YAML bomb, a recursive structure)."""
    import yaml

    loader_class = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        loader = loader_class(text)
        try:
            docs = []
            while loader.check_node():
                node = loader.get_node()
                _check_expansion(node, source, field, max_values)
                docs.append(loader.construct_document(node))
            return docs
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ConfigError(field, f"{source} is not valid YAML: {_first_line(e)}",
                          "fix the YAML at the place named") from None
    except RecursionError:
        raise ConfigError(field, f"{source} nests too deeply to be a {_kind(field)}",
                          "write it with far fewer levels of nesting") from None
    except (ValueError, TypeError, OverflowError) as e:  # e.g. a timestamp or number PyYAML cannot build
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(field, f"{source} holds a value YAML cannot read: {_first_line(e)}",
                          "fix the value at the place named") from None


def _check_expansion(root: Any, source: str, field: str, limit: int) -> None:
    """The values ``root`` stands for once every alias in it is expanded: at most ``limit``,
    and no alias inside the node it refers to. Linear in the number of distinct nodes (each
    node's expanded size is computed once; an alias is the same node object as its anchor),
    without recursion (a file may nest deeper than Python's stack)."""
    import yaml

    def children(node: Any) -> list[Any]:
        if isinstance(node, yaml.SequenceNode):
            return node.value
        if isinstance(node, yaml.MappingNode):
            return [n for pair in node.value for n in pair]
        return []

    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            open_nodes.discard(key)
            total = 1 + sum(map(sizes.__getitem__, map(id, children(node))))
            if total > limit:
                mark = node.start_mark
                raise ConfigError(field, f"{source} expands, through its YAML aliases (*name), to more than "
                                  f"{limit:,} values (the node at line {mark.line + 1}, column {mark.column + 1})",
                                  "write the values out, or use far fewer aliases") from None
            sizes[key] = total
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            mark = node.start_mark
            raise ConfigError(field, f"{source} holds a YAML alias to a node that contains it (a recursive "
                              f"structure, line {mark.line + 1}, column {mark.column + 1})",
                              "write the values out without self-reference")
        open_nodes.add(key)
        stack.append((node, True))
        # a node aliased many times in one list (``[*s, *s, ...]``) is visited once
        distinct = {id(c): c for c in children(node)}
        stack.extend((c, False) for k, c in distinct.items() if k not in sizes)


def load_yaml_all(path: str | os.PathLike, field: str, *, what: str = "YAML file",
                  limit: int = MAX_INPUT_BYTES) -> list[Any]:
    return parse_yaml_all(read_text(path, field, what=what, limit=limit), str(path), field)


def load_yaml(path: str | os.PathLike, field: str, *, what: str = "YAML file", limit: int = MAX_INPUT_BYTES) -> Any:
    docs = load_yaml_all(path, field, what=what, limit=limit)
    if len(docs) > 1:
        raise ConfigError(field, f"{path} holds {len(docs)} YAML documents", "give a file with one")
    return docs[0] if docs else None


def load_job_manifest(path: str | os.PathLike, field: str = "--job") -> list[Any]:
    """The documents of a job manifest file: the one bounded loader every command reading a
    job file goes through (at most ``MAX_JOB_BYTES``, aliases bounded)."""
    return load_yaml_all(path, field, what="job manifest", limit=MAX_JOB_BYTES)


def check_job_text(text: str, source: str) -> None:
    """A job spec handed over as text (the operator's ``LIVESHARD_TRAINING``) within the job cap."""
    if len(text) > MAX_JOB_BYTES:  # characters: at least as many bytes
        raise ConfigError(source, f"is {len(text):,} characters, over the {size_text(MAX_JOB_BYTES)} a job spec may be",
                          "the operator writes it from the job's spec; keep the job's spec small")


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
    lines = [line.strip() for line in str(e)[:4 * ECHO_LIMIT].splitlines() if line.strip()]
    return clip("; ".join(lines[:2])) if lines else type(e).__name__


def _kind(field: str) -> str:
    return "job manifest" if "job" in field else "model or config file"


__all__ = ["MAX_INPUT_BYTES", "MAX_JOB_BYTES", "MAX_TOKENIZER_BYTES", "MAX_YAML_VALUES", "check_job_text", "check_size", "load_job_manifest", "load_json",
           "load_yaml", "load_yaml_all", "parse_json", "parse_yaml_all", "read_bytes", "read_text", "size_text",
           "too_large"]
