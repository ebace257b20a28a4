"""Bugs planted in the shipped protocol code (``liveshard.dev.sim.mutants``): the simulator must
catch each within a fixed budget of schedules, from a seed no mutant was tuned on. Each runs in
a fresh process (the bug is planted before its module is first imported)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from liveshard.dev.sim.mutants import MUTANTS

BUDGET = 1500  # schedules per mutant; the first catch comes within a few dozen for most
SEED = 4242


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_the_simulator_catches_a_planted_bug(mutant):
    run = subprocess.run([sys.executable, "-m", "liveshard.dev.sim", "--mutant", mutant.name,
                          "--schedules", str(BUDGET), "--seed", str(SEED)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode != 3, run.stderr  # the mutant's text must still be in its module
    assert run.returncode == 1, f"{mutant.name} ({mutant.why}) survived {BUDGET} schedules:\n{run.stdout[-2000:]}"
    assert "VIOLATION in schedule seed" in run.stdout or f"VIOLATION in scenario {mutant.scenario}" in run.stdout


def test_a_mutant_whose_text_moved_is_an_error_not_a_pass():
    run = subprocess.run([sys.executable, "-c", (
        "import sys; from liveshard.dev.sim import mutants; "
        "m = mutants.Mutant('gone', 'liveshard.runtime.coordinator.generations', 'no such text', '', ''); "
        "mutants.install(m)\n"
        "try:\n    import liveshard.runtime.coordinator.generations\n"
        "except mutants.NotPlanted:\n    sys.exit(3)\n")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 3, run.stderr


def test_the_command_exits_3_for_a_mutant_whose_text_moved_in_any_module_it_imports():
    """Also in a module imported with the simulator itself (the worker's control rules), where
    the planted import fails before any schedule runs."""
    code = ("import sys; from liveshard.dev.sim import mutants; "
            "gone = mutants.Mutant('gone', 'liveshard.runtime.agent.control', 'no such text', '', ''); "
            "mutants.BY_NAME['gone'] = gone; "
            "from liveshard.dev.sim.__main__ import main; sys.exit(main(['--mutant', 'gone', '--schedules', '1']))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 3, run.stderr
    assert "its text is not in" in run.stderr and "Traceback" not in run.stderr
