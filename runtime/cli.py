"""The ``liveshard`` command: one entry point for everything a person runs.

Each subcommand lives in its own module with two functions, ``configure(parser)`` and
``run(args) -> int``; modules are imported only when their command runs, so planning commands
start fast and the operator image needs no torch.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
from collections.abc import Callable
from typing import NoReturn

from liveshard.runtime.errors import ConfigError, RunFailed

# Exit codes of every command (README "Exit codes"): 0 done; 1 it ran and did not finish (one
# line says why; a crash's traceback also ends in 1); 2 bad input, named in one line before anything ran.
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # SIGINT, as a shell reports a command it interrupted

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "layout": ("liveshard.runtime.commands.layout", "show where every piece of training state lives"),
    "plan-transition": ("liveshard.runtime.commands.plan_transition", "plan moving training state between two layouts"),
    "reshard-local": ("liveshard.dev.commands.reshard_local", "run a transition on local gloo processes and check it"),
    "operator": ("liveshard.operator.command", "run the ElasticTrainingJob operator (kopf)"),
    "plan": ("liveshard.runtime.commands.plan", "pick the fastest parallel config for a model on N GPUs"),
    "worker": ("liveshard.runtime.commands.worker", "run one training rank of a job"),
    "coordinator": ("liveshard.runtime.commands.coordinator", "run a job's coordinator (store and reconfiguration driver)"),
    "run-local": ("liveshard.dev.commands.run_local", "train on local processes through a list of world changes"),
    "local-cluster": ("liveshard.dev.commands.local_cluster", "start or stop a Kubernetes cluster on this machine (emulated)"),
    "demo": ("liveshard.dev.commands.demo", "train on the local cluster through spot notices and node losses"),
    "convert": ("liveshard.runtime.commands.convert", "import Hugging Face weights into any layout, or export a checkpoint as Hugging Face safetensors"),
    "prepare-data": ("liveshard.runtime.commands.prepare_data", "tokenize text into Megatron's indexed format (.bin/.idx)"),
}

# How ``liveshard --help`` (and docs/cli-reference.md) groups the commands; every command is in
# exactly one group.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("run a job", ("run-local", "demo", "local-cluster")),
    ("daemons (what a job's pods run)", ("operator", "coordinator", "worker")),
    ("plan", ("plan", "plan-transition", "layout")),
    ("data and checkpoints", ("prepare-data", "convert")),
    ("dev tools", ("reshard-local",)),
)


# The extra that brings each optional top-level module (pyproject.toml).
_EXTRA_OF = {"torch": "runtime", "megatron": "runtime", "numpy": "runtime", "psutil": "runtime",
             "kopf": "operator", "kubernetes": "operator", "prometheus_client": "operator",
             "kmock": "local", "aiohttp": "local", "matplotlib": "local", "celpy": "local", "jsonschema": "local",
             "jsonpatch": "local", "tokenizers": "runtime", "sentencepiece": "runtime", "tqdm": "runtime", "safetensors": "runtime"}


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose usage errors are one line naming the flag and the fix, exit 2, like every
    other bad input (argparse's own print the whole usage first). A flag is read only as it is
    spelled (no prefixes: ``--job`` is not ``--jobs``), and one flag given in its old and new
    spellings (``alias``) is refused, not decided by the order."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {_one_line(message)} (fix: see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        self._refuse_two_spellings(sys.argv[1:] if args is None else list(args))
        return super().parse_known_args(args, namespace)

    def _refuse_two_spellings(self, argv: list[str]) -> None:
        given: dict[int, list[str]] = {}
        for token in argv:
            if token == "--":
                break
            flag = token.partition("=")[0]
            action = self._option_string_actions.get(flag) if flag.startswith("--") else None
            if action is not None and getattr(action, "aliases", ()):
                spellings = given.setdefault(id(action), [])
                if flag not in spellings:
                    spellings.append(flag)
        for spellings in given.values():
            if len(spellings) > 1:
                new = next((f for f in spellings if f not in self._aliases_of(f)), spellings[-1])
                old = [f for f in spellings if f != new]
                self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {' and '.join([*old, new])} are one flag "
                                          f"({', '.join(old)}: its old spelling) (fix: give only {new})\n")

    def _aliases_of(self, flag: str) -> tuple[str, ...]:
        return tuple(getattr(self._option_string_actions[flag], "aliases", ()))


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, without the old spellings of renamed flags (``alias``)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        hidden = getattr(action, "aliases", ())
        if hidden:
            action = copy.copy(action)
            action.option_strings = [o for o in action.option_strings if o not in hidden]
        return super()._format_action_invocation(action)


def alias(parser: argparse.ArgumentParser, flag: str, *old: str) -> None:
    """Keep the old spellings ``old`` of ``flag`` working, hidden from ``--help`` and the CLI
    reference (one name per meaning across commands; docs/cli-reference.md lists the renames).
    Errors argparse reports name both spellings (``--procs/--workers``)."""
    action = parser._option_string_actions[flag]
    for name in old:
        if name in parser._option_string_actions:
            raise ValueError(f"{name} is already a flag of {parser.prog}")
        parser._option_string_actions[name] = action
        action.option_strings.append(name)
    action.aliases = (*getattr(action, "aliases", ()), *old)  # type: ignore[attr-defined]


# ``--preallocate`` in every command that has it (worker, run-local, reshard-local): who allocates
# its new tensors ahead of a transfer; a bare ``--preallocate`` is ``--preallocate all``.
PREALLOCATE_CHOICES = ("auto", "all", "joiners")


def add_preallocate(p: argparse.ArgumentParser, default: str | None, help_text: str) -> None:
    p.add_argument("--preallocate", choices=PREALLOCATE_CHOICES, nargs="?", const="all", default=default,
                   help=f"{help_text} (a bare --preallocate: all)")


def byte_size(flag: str) -> Callable[[str], int]:
    """An argparse ``type`` for sizes in bytes, read as every size is (``units.parse_bytes``):
    ``67108864``, ``64MiB``, ``1GiB``, ``80Gi``, ``96GB``."""
    def parse(text: str) -> int:
        from liveshard.runtime.units import parse_bytes

        try:
            return parse_bytes(text, flag)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(f"{e.problem} ({e.fix})" if e.fix else e.problem) from None

    parse.__name__ = "size"
    return parse


def _commands_help() -> str:
    width = max(map(len, COMMANDS)) + 2
    blocks = []
    for title, names in GROUPS:
        lines = [f"{title}:"] + [f"  {name:<{width}}{COMMANDS[name][1]}" for name in names]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n\nliveshard COMMAND --help: the command's flags (docs/cli-reference.md: all of them)"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="liveshard",
        description="Elastic Megatron training that switches parallelism live.",
        epilog=_commands_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                help="one of the commands below")
    for name in COMMANDS:
        _add_command(sub, name)
    return parser


def _add_command(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    """Command ``name``'s parser (listed in the top-level help by ``_commands_help``, by group)."""
    module, help_text = COMMANDS[name]
    p = sub.add_parser(name, description=help_text, formatter_class=HelpFormatter)
    p.set_defaults(_module=module)
    importlib.import_module(module).configure(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _lazy_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(parser, args.command, unknown)
    _warn_old_spellings(parser, args.command, argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except ConfigError as e:
        named = _with_new_names(parser, args.command, e)
        print(f"liveshard {args.command}: error: {_one_line(str(named))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunFailed as e:
        print(f"liveshard {args.command}: failed: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_FAILED
    except ModuleNotFoundError as e:
        extra = _EXTRA_OF.get((e.name or "").partition(".")[0])
        if extra is None:
            raise
        # a command run where its extra is not installed (e.g. the demo in a product image)
        print(f"liveshard {args.command}: error: needs {e.name!r}, which this install leaves out "
              f"(fix: pip install 'liveshard[{extra}]')", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `liveshard layout ... | head`
        return 0
    except KeyboardInterrupt:  # Ctrl-C: what the command started has been stopped by its own cleanup
        print(f"liveshard {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


# the release after which the old spellings of renamed flags (``alias``) are no longer read
OLD_FLAGS_READ_UNTIL = "0.3"


def _warn_old_spellings(parser: argparse.ArgumentParser, command: str, argv: list[str]) -> None:
    """One warning line per renamed flag given in its old spelling (``alias``)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    actions = sub.choices[command]._option_string_actions
    for token in argv:
        flag = token.partition("=")[0]
        action = actions.get(flag) if flag.startswith("--") else None
        if action is not None and flag in getattr(action, "aliases", ()):
            print(f"liveshard {command}: warning: {flag} is the old spelling of {action.option_strings[0]} "
                  f"(read until liveshard {OLD_FLAGS_READ_UNTIL})", file=sys.stderr)
        elif action is not None and getattr(action, "replaced_by", None):  # another unit: not an alias
            print(f"liveshard {command}: warning: {flag} is deprecated: give {action.replaced_by} "
                  f"(read until liveshard {OLD_FLAGS_READ_UNTIL})", file=sys.stderr)


def _refuse_unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> NoReturn:
    """Arguments the command does not take, refused by the command's own parser: its name and its
    --help in the one line (``--job`` given to prepare-data, whose prefix once read it as ``--jobs``)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices[command].error(f"unrecognized arguments: {' '.join(unknown)}")


def _with_new_names(parser: argparse.ArgumentParser, command: str, e: ConfigError) -> ConfigError:
    """``e`` naming a renamed flag by both spellings, as argparse's own errors do
    (``--procs/--workers``): the commands' checks still name the old one."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action = sub.choices[command]._option_string_actions.get(e.field)
    if action is None or e.field not in getattr(action, "aliases", ()):
        return e
    return ConfigError(f"{action.option_strings[0]}/{e.field}", e.problem, e.fix)


def _one_line(text: str) -> str:
    """A message as the one line it must be (a value quoted in it may hold line breaks)."""
    return " ".join(text.split())


def _lazy_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Configure only the named subcommand when one is given: its imports alone are paid."""
    name = next((a for a in argv if not a.startswith("-")), None)
    if name not in COMMANDS:
        return build_parser()
    parser = OneLineParser(prog="liveshard")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_command(sub, name)
    return parser


if __name__ == "__main__":
    sys.exit(main())
