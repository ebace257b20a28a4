"""The production runtime has no code path that kills its own process on request.

Fault injection (holding a worker at a step, killing it there) is dev tooling
(``dev/localrun/held_worker.py``, ``dev/localrun/driver.py``): the driver kills from outside.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
FORBIDDEN = ("os.kill(", "SIGKILL", "hold_at_steps", "inject/")
# The one legitimate SIGKILL: children ask the kernel to kill them when the process that started
# them dies (PR_SET_PDEATHSIG, runtime/lifeline.py: no orphans training on their own), and a child
# whose parent died before the setting took effect does it itself. Nothing can request it.
ALLOWED = {
    ("lifeline.py", "os.kill(os.getpid(), sig)"),
    ("lifeline.py", "def bind_to_parent(parent: int, sig: int = signal.SIGKILL) -> bool:"),
    ("lifeline.py", "def preexec(parent: int | None = None, sig: int = signal.SIGKILL) -> Callable[[], None] | None:"),
}


def _prose_lines(source: str) -> set[int]:
    """Lines that are only words: docstrings (what they say runs nothing)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            lines.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    return lines


def _code(line: str) -> str:
    """``line`` without its comment (a ``#`` outside a string)."""
    tokens = tokenize.generate_tokens(io.StringIO(line).readline)
    try:
        comment = next((t for t in tokens if t.type == tokenize.COMMENT), None)
    except (tokenize.TokenError, SyntaxError):  # a line of a multi-line statement: read it whole
        return line
    return line[:comment.start[1]] if comment else line


def _offences() -> list[str]:
    out = []
    for path in sorted(RUNTIME.rglob("*.py")):
        rel = path.relative_to(RUNTIME).as_posix()
        source = path.read_text()
        prose = _prose_lines(source)
        for number, line in enumerate(source.splitlines(), 1):
            if number in prose or (rel, line.strip()) in ALLOWED:
                continue
            code = _code(line)
            out += [f"runtime/{rel}:{number}: {word}" for word in FORBIDDEN if word in code]
    return out


def test_the_allowed_lines_are_there():
    for rel, line in ALLOWED:
        assert line in {s.strip() for s in (RUNTIME / rel).read_text().splitlines()}, (rel, line)


def test_the_scan_reads_code_not_prose():
    assert _code('os.kill(pid, signal.SIGKILL)  # a comment') == "os.kill(pid, signal.SIGKILL)  "
    assert _code('x = 1  # SIGKILL') == "x = 1  "
    assert _code('s = "# SIGKILL"') == 's = "# SIGKILL"'
    assert _prose_lines('def f():\n    """SIGKILL\n    here."""\n    os.kill(1, 9)\n') == {2, 3}


def test_the_runtime_sources_are_there():
    assert (RUNTIME / "agent" / "worker.py").is_file()
    assert len(list(RUNTIME.rglob("*.py"))) > 20


def test_no_runtime_module_kills_itself_or_holds_for_a_driver():
    assert _offences() == []


def test_the_worker_command_has_no_hold_option(capsys):
    from liveshard.runtime.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["worker", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--coordinator" in text
    assert "--hold-at-steps" not in text
