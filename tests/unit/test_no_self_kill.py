"""The production runtime has no code path that kills its own process on request.

Fault injection (holding a worker at a step, killing it there) is dev tooling
(``dev/localrun/held_worker.py``, ``dev/localrun/driver.py``): the driver kills from outside.
"""

from __future__ import annotations

from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
FORBIDDEN = ("os.kill(", "SIGKILL", "hold_at_steps", "inject/")
# The one legitimate SIGKILL: a pod supervisor's children ask the kernel to kill them when the
# supervisor dies (PR_SET_PDEATHSIG: no orphans training on their own). Nothing can request it.
ALLOWED = {
    ("agent/local_workers.py", '"""Linux: the child gets SIGKILL if the supervisor dies (no orphans training on their own)."""'),
    ("agent/local_workers.py", 'ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG'),
}


def _offences() -> list[str]:
    out = []
    for path in sorted(RUNTIME.rglob("*.py")):
        rel = path.relative_to(RUNTIME).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if (rel, line.strip()) in ALLOWED:
                continue
            out += [f"runtime/{rel}:{number}: {word}" for word in FORBIDDEN if word in line]
    return out


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
