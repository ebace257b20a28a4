"""The ``liveshard`` command: one entry point for everything a person runs.

Each subcommand lives in its own module with two functions, ``configure(parser)`` and
``run(args) -> int``; modules are imported only when their command runs, so planning commands
start fast and the operator image needs no torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from liveshard.runtime.errors import ConfigError, RunFailed

# Exit codes of every command (README "Exit codes"): 0 done; 1 it ran and did not finish (one
# line says why; a crash's traceback also ends in 1); 2 bad input, named in one line before anything ran.
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2

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


# The extra that brings each optional top-level module (pyproject.toml).
_EXTRA_OF = {"torch": "runtime", "megatron": "runtime", "numpy": "runtime", "psutil": "runtime",
             "kopf": "operator", "kubernetes": "operator", "prometheus_client": "operator",
             "kmock": "local", "aiohttp": "local", "matplotlib": "local", "celpy": "local", "jsonschema": "local",
             "jsonpatch": "local", "tokenizers": "runtime", "sentencepiece": "runtime", "tqdm": "runtime", "safetensors": "runtime"}


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose usage errors are one line naming the flag and the fix, exit 2, like every
    other bad input (argparse's own print the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {_one_line(message)} (fix: see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="liveshard",
        description="Elastic Megatron training that switches parallelism live.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).configure(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _lazy_parser(argv)
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except ConfigError as e:
        print(f"liveshard {args.command}: error: {_one_line(str(e))}", file=sys.stderr)
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
    module, help_text = COMMANDS[name]
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.set_defaults(_module=module)
    importlib.import_module(module).configure(p)
    return parser


if __name__ == "__main__":
    sys.exit(main())
