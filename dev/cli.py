"""The ``liveshard`` command line run inside the test process, its output captured."""

from __future__ import annotations

import contextlib
import io
import subprocess


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``liveshard ARGS`` in this process (the CLI prints and returns its exit code)."""
    from liveshard.runtime.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
