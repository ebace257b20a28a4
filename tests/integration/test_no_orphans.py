"""Nothing outlives what started it: ``run-local`` SIGKILLed mid-run (a CI timeout, the OOM
killer) leaves no coordinator, worker or pulse behind, and the coordinator's port is free again.

Every process of the run is found by a marker in its environment (inherited by everything the
run starts), so a grandchild that escaped would be found too.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

MARKER = "LIVESHARD_TEST_ORPHAN_MARKER"


def _marked(value: str) -> dict[int, str]:
    """pid -> command line of every process whose environment holds ``MARKER=value``."""
    needle = f"{MARKER}={value}".encode()
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return out


def _listeners(port: int) -> list[str]:
    """The sockets listening on ``port`` (any address: /proc/net/tcp{,6}, state 0A), each with
    the processes holding it: ``inode <n>: <pid> <command line>``."""
    inodes = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                inodes.append(fields[9])
    out = []
    for inode in inodes:
        holders = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if any(os.readlink(fd) == f"socket:[{inode}]" for fd in (entry / "fd").iterdir()):
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    holders.append(f"{entry.name} {command[:200]}")
            except OSError:
                continue
        out.append(f"inode {inode}: {'; '.join(holders) or 'no process'}")
    return out


def _listening(port: int) -> bool:
    return bool(_listeners(port))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_a_sigkilled_run_local_leaves_no_process_and_frees_its_port(tmp_path):
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen([sys.executable, "-m", "liveshard.runtime.cli", "run-local", "--model", "tiny-gpt",
                            "--procs", "2", "--parallel", "tp=1,pp=1,dp=2", "--train-iters", "100000", "--mock-data",
                            "--global-batch", "4", "--seq-length", "32", "--workdir", str(tmp_path / "run"),
                            "--result", str(tmp_path / "run.json"), "--quiet"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = None
        deadline = time.monotonic() + 120
        # mid-run: the coordinator serves its store and both workers are started
        while time.monotonic() < deadline:
            assert run.poll() is None, f"run-local exited with {run.returncode} before the kill"
            procs = _marked(marker)
            coordinator = next((c for c in procs.values() if " coordinator " in c), None)
            workers = [c for c in procs.values() if re.search(r" worker .*--id w\d", c)]
            if coordinator and len(workers) == 2:
                port = int(re.search(r"--port (\d+)", coordinator).group(1))
                if _listening(port):
                    break
            time.sleep(0.2)
        assert port is not None and _listening(port), f"the run did not get going: {_marked(marker)}"
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (left := _marked(marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"processes outlived the SIGKILLed run-local: {left}"
        deadline = time.monotonic() + 5  # the kernel closes a dead process's sockets as it reaps it
        while _listening(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _listening(port), f"port {port} is still served: {_listeners(port)}"
    finally:
        if run.poll() is None:
            run.kill()
        for pid in _marked(marker):  # what a failure left: never leak into the next test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
