"""The per-pod supervisor of ``liveshard worker``: one training process per GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from liveshard.runtime.agent import local_workers as lw


def test_how_many_processes_and_who_supervises():
    assert lw.default_local_workers({}) == 1
    assert lw.default_local_workers({"LIVESHARD_GPUS_PER_WORKER": "8"}) == 8
    assert lw.default_local_workers({"LIVESHARD_GPUS_PER_WORKER": "0"}) == 1
    assert lw.default_local_workers({"LIVESHARD_GPUS_PER_WORKER": "x"}) == 1
    assert lw.should_supervise(2, {})
    assert not lw.should_supervise(1, {})
    assert not lw.should_supervise(8, {"LOCAL_RANK": "0"})  # a child (or torchrun's) trains itself
    assert lw.local_rank({}) == (0, 1)
    assert lw.local_rank({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}) == (3, 4)
    assert lw.child_env({"A": "1"}, 1, 2) == {"A": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def test_per_process_ids_and_result_files():
    assert lw.per_process_id("w", 0, 1) == "w"
    assert lw.per_process_id("w", 1, 2) == "w/1"
    assert lw.per_process_path("out/pod.json", 0, 1) == "out/pod.json"
    assert lw.per_process_path("out/pod.json", 1, 2) == "out/pod.1.json"
    assert lw.per_process_path("out/pod", 0, 2) == "out/pod.0"


def test_exit_code():
    assert lw.exit_code([0, 0]) == 0
    assert lw.exit_code([0, 3, 1]) == 3
    assert lw.exit_code([0, -9]) == 137  # killed by SIGKILL, as a shell reports it
    assert lw.exit_code([]) == 0


CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    rank = int(os.environ["LOCAL_RANK"])
    out = sys.argv[1]
    signal.signal(signal.SIGTERM, lambda *a: (open(f"{out}.term{rank}", "w").close(), sys.exit(0)))
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rank": rank, "size": os.environ["LOCAL_WORLD_SIZE"], "argv": sys.argv[1:]}, f)
    mode = sys.argv[2]
    if mode == "fail" and rank == 1:
        sys.exit(3)
    if mode == "kill" and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode in ("fail", "kill", "wait"):
        end = time.time() + 30
        while time.time() < end and not os.path.exists(out + ".go"):
            time.sleep(0.05)
    open(f"{out}.done{rank}", "w").close()
""")


def _run(tmp_path, mode: str, n: int = 2) -> tuple[int, float]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    t0 = time.monotonic()
    code = lw.supervise([sys.executable, str(script), str(tmp_path / "r"), mode], n, poll=0.02)
    return code, time.monotonic() - t0


def test_supervisor_runs_one_process_per_gpu(tmp_path):
    code, _ = _run(tmp_path, "ok", n=3)
    assert code == 0
    seen = [json.loads((tmp_path / f"r.{i}").read_text()) for i in range(3)]
    assert [(s["rank"], s["size"]) for s in seen] == [(0, "3"), (1, "3"), (2, "3")]
    assert all(s["argv"] == [str(tmp_path / "r"), "ok"] for s in seen)  # the same command line


@pytest.mark.parametrize(("mode", "expected"), [("fail", 3), ("kill", 128 + signal.SIGKILL)])
def test_a_dead_child_leaves_its_siblings_running_and_fails_the_pod(tmp_path, mode, expected):
    import threading

    # the surviving child waits for a go file, given well after its sibling died
    def release():
        end = time.monotonic() + 20
        while time.monotonic() < end and not ((tmp_path / "r.0").exists() and (tmp_path / "r.1").exists()):
            time.sleep(0.02)
        time.sleep(0.5)
        (tmp_path / "r.go").touch()

    t = threading.Thread(target=release)
    t.start()
    code, seconds = _run(tmp_path, mode)
    t.join()
    assert code == expected
    survivor = 0 if mode == "fail" else 1
    assert [p.name for p in tmp_path.glob("r.done*")] == [f"r.done{survivor}"]  # it ran to its end
    assert seconds >= 0.5  # the supervisor waited for it
    assert not list(tmp_path.glob("r.term*"))  # nobody was told to stop


def test_sigterm_is_forwarded_to_every_child(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    sup = textwrap.dedent(f"""
        import sys
        from liveshard.runtime.agent import local_workers as lw
        sys.exit(lw.supervise([sys.executable, {str(script)!r}, {str(tmp_path / "r")!r}, "wait"], 2, poll=0.02))
    """)
    proc = subprocess.Popen([sys.executable, "-c", sup], env={**os.environ})
    end = time.monotonic() + 30
    while not ((tmp_path / "r.0").exists() and (tmp_path / "r.1").exists()):
        assert time.monotonic() < end and proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0  # the children handled SIGTERM and exited 0
    assert sorted(p.name for p in tmp_path.glob("r.term*")) == ["r.term0", "r.term1"]


def test_worker_command_supervises_when_the_pod_has_several_gpus(tmp_path):
    """``liveshard worker`` with LIVESHARD_GPUS_PER_WORKER=2: two children with LOCAL_RANK 0 and 1
    (they fail fast here: no coordinator answers), the supervisor's code is a child's."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(LIVESHARD_GPUS_PER_WORKER="2", LIVESHARD_POD_NAME="p")
    out = subprocess.run([sys.executable, "-m", "liveshard.runtime.cli", "worker", "--model", "no-such-model"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("no-such-model") == 2  # both children ran and reported the bad model
    assert "local worker 0/2" in out.stderr and "local worker 1/2" in out.stderr
