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
    ("local-cluster", "--dir", "/tmp/lc", "--workdir", "dir"),
]
_REQUIRED = {"plan-transition": ["--model", "m", "--from-parallel", "tp=1", "--to-parallel", "tp=1"],
             "reshard-local": ["--model", "m", "--from-parallel", "tp=1", "--to-parallel", "tp=1", "--procs", "1"],
             "local-cluster": ["up"]}


def _without(args: list[str], flag: str) -> list[str]:
    """``args`` without ``flag`` and its value (a required flag given in its old spelling instead)."""
    if flag not in args:
        return args
    i = args.index(flag)
    return args[:i] + args[i + 2:]


@pytest.mark.parametrize(("command", "old", "value", "flag", "dest"), RENAMED)
def test_old_spellings_still_work(command, old, value, flag, dest):
    parser = build_parser()
    base = [command, *_without(_REQUIRED.get(command, []), flag)]
    with_old = parser.parse_args([*base, old, value])
    with_new = parser.parse_args([*base, flag, value])
    assert getattr(with_old, dest) == getattr(with_new, dest) and str(getattr(with_new, dest)) == value


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


# ---- every flag name, one meaning -----------------------------------------------------------------
# Each flag name more than one command takes, with the words its help says in every one of them:
# one meaning, written down. A new shared flag (or a new command taking one) fails
# test_a_flag_name_has_one_meaning_in_every_command until it is listed here with the meaning it
# shares, or gets a name of its own.
SHARED_MEANINGS = {
    "--adaptive": "slow", "--adaptive-horizon": "pay for itself", "--adaptive-min-gain": "saving",
    "--adaptive-probation": "set aside", "--adaptive-threshold": "slow", "--adaptive-window": "speed estimate",
    "--budget": "staging bytes", "--build-world-ahead": "communicators", "--checkpoint-dir": "checkpoint",
    "--checkpoint-every": "checkpoint", "--data-prefix": "indexed dataset", "--dead": "lost without notice",
    "--from-parallel": "old parallel config", "--global-batch": "sequences per", "--gpus-per-node": "per node",
    "--job": "ElasticTrainingJob manifest", "--job-name": "the job's name", "--join": "joining", "--json": "JSON",
    "--kueue": "Kueue",
    "--kubeconfig": "kubeconfig", "--leave": "leaving", "--lr": "learning rate",
    "--metrics-address": "address the metrics port listens on", "--metrics-port": "metrics",
    "--micro-batch": "per micro-batch", "--mock-data": "synthetic", "--model": "model",
    "--namespace": "namespace", "--no-progress": "progress bar", "--parallel": "tp=",
    "--preallocate": "allocate", "--precision": "dtype", "--procs": "processes", "--result": "(JSON",
    "--seed": "random seed", "--seq-length": "tokens per sequence", "--to-parallel": "new parallel config",
    "--tokenizer": "tokenizer", "--train-iters": "optimizer steps", "--verify": "checksum",
    "--warmup-iters": "warm-up", "--workdir": "logs",
}
# Flags whose parsers differ although the meaning is one: why.
SAME_MEANING_OTHER_FORM = {
    "--namespace": "the Kubernetes namespace of the jobs a daemon serves: the coordinator serves one job, "
                   "the operator watches one or more namespaces (repeatable)",
}


def _visible_flags(commands) -> dict[str, dict[str, argparse.Action]]:
    """flag name -> {command: its action}, old spellings (``alias``) left out, and --help."""
    flags: dict[str, dict[str, argparse.Action]] = {}
    for name, parser in commands.items():
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and flag not in getattr(action, "aliases", ()):
                    flags.setdefault(flag, {})[name] = action
    return flags


def _form(action: argparse.Action) -> tuple:
    """What a parser makes of a flag: its action, the type it reads, its choices and arity."""
    kind = getattr(action.type, "__name__", action.type)
    return (type(action).__name__, kind, tuple(action.choices or ()), action.nargs, action.const)


def test_a_flag_name_has_one_meaning_in_every_command(commands):
    shared = {flag: by for flag, by in _visible_flags(commands).items() if len(by) > 1}
    unlisted = sorted(set(shared) - set(SHARED_MEANINGS))
    assert not unlisted, f"list the one meaning of {unlisted} in SHARED_MEANINGS, or give each its own name"
    for flag, by in shared.items():
        forms = {name: _form(action) for name, action in by.items()}
        if flag not in SAME_MEANING_OTHER_FORM:
            assert len(set(forms.values())) == 1, f"{flag} is read differently: {forms}"
        for name, action in by.items():
            assert SHARED_MEANINGS[flag].lower() in (action.help or "").lower(), \
                f"liveshard {name} {flag}: its help does not say {SHARED_MEANINGS[flag]!r}: {action.help!r}"


def test_an_old_spelling_never_names_another_commands_flag_in_a_visible_way(commands):
    """An old spelling kept for a command is hidden there; where it is another command's own flag,
    that command's meaning is the only one --help and the reference show."""
    visible = _visible_flags(commands)
    for name, parser in commands.items():
        for action in parser._actions:
            for old in getattr(action, "aliases", ()):
                assert name not in visible.get(old, {}), (name, old)


def test_every_parser_reads_flags_only_as_spelled(commands, capsys):
    parser = build_parser()
    assert parser.allow_abbrev is False
    assert all(p.allow_abbrev is False for p in commands.values())
    from liveshard.runtime.cli import main

    with pytest.raises(SystemExit) as done:  # --jobs, abbreviated: not read as it
        main(["prepare-data", "--job", "job.yaml", "--builtin-corpus"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("liveshard prepare-data: error: unrecognized arguments: --job job.yaml"), err


@pytest.mark.parametrize(("command", "old", "value", "flag", "dest"), RENAMED)
def test_old_and_new_spelling_together_are_refused_in_one_line(command, old, value, flag, dest, capsys):
    from liveshard.runtime.cli import main

    with pytest.raises(SystemExit) as done:
        main([command, *_without(_REQUIRED.get(command, []), flag), flag, value, old, value])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{old} and {flag} are one flag" in err and f"give only {flag}" in err


def test_an_old_spelling_warns_in_one_line(capsys):
    from liveshard.runtime.cli import main

    # local-cluster down: no cluster runs there (exit 2); the warning comes first
    assert main(["local-cluster", "down", "--dir", "/nonexistent-liveshard-dir"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == ("liveshard local-cluster: warning: --dir is the old spelling of --workdir "
                        "(read until liveshard 0.3)"), lines


@pytest.mark.parametrize("command", ["worker", "run-local", "reshard-local"])
def test_preallocate_is_one_choice_everywhere_and_bare_means_all(command):
    parser = build_parser()
    base = [command, *_REQUIRED.get(command, [])]
    assert parser.parse_args([*base, "--preallocate"]).preallocate == "all"
    assert parser.parse_args([*base, "--preallocate", "joiners"]).preallocate == "joiners"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--preallocate", "yes"])
