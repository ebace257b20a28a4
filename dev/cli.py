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
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse: a usage error (2) or --help (0), the process's exit code
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
