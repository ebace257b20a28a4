"""The ``liveshard`` command's public surface: commands grouped in ``--help``, one flag name per
meaning (old spellings kept as hidden aliases), sizes read one way, and docs/cli-reference.md
generated from the parser and current."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from liveshard.dev.cli import run_cli
from liveshard.runtime.cli import COMMANDS, GROUPS, build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_cli_reference", ROOT / "docs" / "gen_cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_cli_reference_is_up_to_date(gen):
    assert gen.main(["--check"]) == 0, "run: python docs/gen_cli_reference.py"


def test_reference_names_its_regeneration_command_and_every_command():
    text = (ROOT / "docs" / "cli-reference.md").read_text()
    assert "python docs/gen_cli_reference.py" in text.split("\n## ")[0]
    for name in COMMANDS:
        assert f"### liveshard {name}\n" in text and f"usage: liveshard {name}" in text
    assert "| `plan-transition` | `--from` | `--from-parallel` |" in text  # the renames are listed


def test_every_command_is_in_exactly_one_group():
    grouped = [name for _, names in GROUPS for name in names]
    assert sorted(grouped) == sorted(COMMANDS) and len(grouped) == len(set(grouped))


def test_top_level_help_lists_commands_by_group(capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    where = {title: out.index(f"\n{title}:\n") for title, _ in GROUPS}
    assert list(where.values()) == sorted(where.values())  # groups in their order
    bounds = [*where.values(), len(out)]
    for (title, names), start, end in zip(GROUPS, bounds, bounds[1:], strict=False):
        for name in names:
            assert f"\n  {name} " in out[start:end], (title, name)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_help_works_and_hides_old_spellings(name, capsys):
    from liveshard.runtime.cli import main

    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith(f"usage: liveshard {name}")
    for hidden in ("--workers", "--local-workers", "--steps", "--max-steps", "--out ", "--out,"):
        assert hidden not in out, hidden


# command, old spelling, value, canonical flag, dest
RENAMED = [
    ("plan-transition", "--from", "tp=2", "--from-parallel", "old"),
    ("plan-transition", "--to", "tp=2", "--to-parallel", "new"),
    ("reshard-local", "--from", "tp=2", "--from-parallel", "old"),
    ("reshard-local", "--to", "tp=2", "--to-parallel", "new"),
    ("reshard-local", "--mode", "a2a", "--collective", "mode"),
    ("run-local", "--workers", "3", "--procs", "workers"),
    ("run-local", "--steps", "7", "--train-iters", "train_iters"),
    ("run-local", "--out", "r.json", "--result", "out"),
    ("worker", "--local-workers", "2", "--procs", "local_workers"),
    ("worker", "--max-steps", "5", "--stop-at-step", "max_steps"),
    ("demo", "--out", "d", "--workdir", "out"),
    ("prepare-data", "--workers", "4", "--jobs", "workers"),
]
_REQUIRED = {"plan-transition": ["--model", "m", "--from-parallel", "tp=1", "--to-parallel", "tp=1"],
             "reshard-local": ["--model", "m", "--from-parallel", "tp=1", "--to-parallel", "tp=1", "--procs", "1"]}


@pytest.mark.parametrize(("command", "old", "value", "flag", "dest"), RENAMED)
def test_old_spellings_still_work(command, old, value, flag, dest):
    parser = build_parser()
    base = [command, *_REQUIRED.get(command, [])]
    with_old = parser.parse_args([*base, old, value])
    with_new = parser.parse_args([*base, flag, value])
    assert getattr(with_old, dest) == getattr(with_new, dest) != parser.parse_args(base).__dict__.get(dest)


def test_old_spellings_of_required_flags_satisfy_them():
    args = build_parser().parse_args(["plan-transition", "--model", "m", "--from", "tp=1", "--to", "tp=2"])
    assert (args.old, args.new) == ("tp=1", "tp=2")


def test_one_name_one_meaning(commands):
    def visible(flag):
        return sorted(name for name, p in commands.items() for a in p._actions
                      if flag in a.option_strings and flag not in getattr(a, "aliases", ()))

    assert visible("--mode") == ["run-local"]  # live|checkpoint
    assert visible("--from") == visible("--to") == ["convert"]  # a source and a target, not configs
    assert visible("--workers") == visible("--local-workers") == visible("--steps") == visible("--out") == []
    assert visible("--procs") == ["convert", "reshard-local", "run-local", "worker"]  # local processes


def test_budget_is_a_size_everywhere():
    from liveshard.runtime.units import parse_bytes

    parser = build_parser()
    transition = ["plan-transition", *_REQUIRED["plan-transition"]]
    for text, size in (("64MiB", 64 << 20), ("1GiB", 1 << 30), ("1048576", 1 << 20)):
        assert parser.parse_args(["worker", "--budget", text]).budget == size
        # plan-transition and reshard-local read theirs in transition_args.resolve, as the worker does
        assert parse_bytes(parser.parse_args([*transition, "--budget", text]).budget, "--budget") == size
    assert parser.parse_args(["worker"]).budget == 64 << 20


def test_a_bad_size_is_one_line_naming_the_flag(capsys):
    from liveshard.runtime.cli import main

    with pytest.raises(SystemExit) as done:
        main(["worker", "--budget", "lots"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "--budget" in err and len(err.strip().splitlines()) == 1, err


def test_errors_about_a_renamed_flag_name_both_spellings(tmp_path):
    r = run_cli("run-local", "--mock-data", "--model", "tiny-gpt", "--workers", "0", "--check",
                "--workdir", str(tmp_path))
    assert r.returncode == 2 and "--procs/--workers" in r.stderr, r.stderr
