"""``liveshard demo``: the local cluster, a tiny GPT job, and three node events, checked."""

from __future__ import annotations

import argparse
import tempfile


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="directory for report.json, report.png, logs (default: a new temp dir)")


def run(args: argparse.Namespace) -> int:
    from liveshard.dev.localcluster.demo import run_demo

    return run_demo(args.out or tempfile.mkdtemp(prefix="liveshard-demo-"))
