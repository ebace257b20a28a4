"""e2e/real_cluster/run.py cannot run here (no cluster); its arguments, the taints it writes and
the checks it makes are tested."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from liveshard.operator import signals
from liveshard.runtime.contract.causes import NODE_KINDS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "e2e" / "real_cluster" / "run.py"


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("real_cluster_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_help_runs_as_a_program():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--signal", "--fake-gpus", "--operator-image", "--step-pattern", "--dry-run"):
        assert flag in out.stdout


def test_defaults(e2e):
    args = e2e.parse_args([])
    assert args.signal == "nth" and Path(args.job) == ROOT / "examples" / "tiny-cpu.yaml"
    assert Path(args.chart) == ROOT / "helm" / "liveshard" and Path(args.chart, "Chart.yaml").is_file()


@pytest.mark.parametrize("argv", [
    ["--signal", "gke"],
    ["--fake-gpus", "-1"],
    ["--steps-after", "0"],
    ["--step-pattern", "step ("],
    ["--step-pattern", "step \\d+"],
    ["--operator-image", "liveshard/operator"],
    ["--job", "examples/nope.yaml"],
    ["--ready-timeout", "0"],
])
def test_bad_arguments_exit_2(e2e, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        e2e.parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("signal", ["nth", "karpenter"])
def test_the_taint_is_one_the_operator_acts_on_by_default(e2e, signal):
    node = {"metadata": {"name": "n1", "annotations": {}}, "spec": {"taints": [e2e.taint_object(signal, "abc")]},
            "status": {}}
    sig = signals.classify_node(node, datetime.now(UTC))
    assert sig is not None and not sig.failure
    assert signals.acts_on(sig, frozenset(NODE_KINDS))
    key, _, effect = e2e.TAINTS[signal]
    assert e2e.taint_args(signal, "abc").startswith(key) and e2e.taint_args(signal, "abc").endswith(":" + effect)


def _pods(e2e, **changes):
    base = {"j-worker-0": ("u0", "n0"), "j-worker-1": ("u1", "n1"), "j-worker-2": ("u2", "n2")}
    out = {name: e2e.PodState(name, uid, node, "Running", 0) for name, (uid, node) in base.items()}
    for name, state in changes.items():
        out[name.replace("_", "-")] = state
    return out


def test_check_passes_a_clean_switch(e2e):
    before = _pods(e2e)
    plan0 = {"generation": 1, "members": ["j-worker-0", "j-worker-1", "j-worker-2"]}
    plan1 = {"generation": 2, "members": ["j-worker-0", "j-worker-1"]}
    after = {k: v for k, v in before.items() if k != "j-worker-2"}  # the leaver was deleted after the ack
    assert e2e.check_reconfiguration(before, plan0, plan1, 2, after, "n2") == []


def test_check_reports_every_broken_expectation(e2e):
    before = _pods(e2e)
    plan0 = {"generation": 1, "members": ["j-worker-0", "j-worker-1", "j-worker-2"]}
    ok1 = {"generation": 2, "members": ["j-worker-0", "j-worker-1"]}
    same = {"generation": 1, "members": plan0["members"]}
    problems = e2e.check_reconfiguration(before, plan0, same, 1, before, "n2")
    assert any("no new plan" in p for p in problems)
    assert any("still uses pods on the tainted node: j-worker-2" in p for p in problems)
    assert any("appliedGeneration is 1, not 2" in p
               for p in e2e.check_reconfiguration(before, plan0, ok1, 1, before, "n2"))
    restarted = _pods(e2e, j_worker_1=e2e.PodState("j-worker-1", "u1", "n1", "Running", 1))
    assert any("j-worker-1 restarted" in p for p in e2e.check_reconfiguration(before, plan0, ok1, 2, restarted, "n2"))
    replaced = _pods(e2e, j_worker_0=e2e.PodState("j-worker-0", "new", "n0", "Running", 0))
    assert any("j-worker-0 was replaced" in p for p in e2e.check_reconfiguration(before, plan0, ok1, 2, replaced, "n2"))
    gone = {k: v for k, v in before.items() if k != "j-worker-1"}
    assert any("j-worker-1 (not on the tainted node) is gone" in p
               for p in e2e.check_reconfiguration(before, plan0, ok1, 2, gone, "n2"))
    stop = {"generation": 2, "members": [], "reason": "too few"}
    assert any("no members" in p for p in e2e.check_reconfiguration(before, plan0, stop, 2, before, "n2"))


def test_last_step(e2e):
    logs = "x step 3 loss 1.0\nstep=4\nnothing\nstep: 12 done\n"
    assert e2e.last_step(logs, e2e.DEFAULT_STEP_PATTERN) == 12
    assert e2e.last_step("no progress here", e2e.DEFAULT_STEP_PATTERN) is None


def test_dry_run_prints_the_writes_and_needs_no_tools(e2e, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert e2e.main(["--dry-run", "--signal", "karpenter", "--fake-gpus", "2",
                     "--operator-image", "registry.local:5000/liveshard/operator:abc"]) == 0
    out = capsys.readouterr().out
    assert "helm upgrade --install liveshard" in out
    assert "--set image.repository=registry.local:5000/liveshard/operator --set image.tag=abc" in out
    assert "kubectl apply -f -" in out and "karpenter.sh/disrupted:NoSchedule" in out


def test_without_kubectl_it_says_so(e2e, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert e2e.main([]) == 2
    assert "is not on PATH" in capsys.readouterr().err
