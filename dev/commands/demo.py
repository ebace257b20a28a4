"""``liveshard demo``: the local cluster, a tiny GPT job, and three node events, checked;
``--kueue``: the same job behind Kueue, preempted in part and grown back."""

from __future__ import annotations

import argparse
import os
import tempfile


def configure(p: argparse.ArgumentParser) -> None:
    from liveshard.runtime.cli import alias

    p.add_argument("--workdir", dest="out", default=None, metavar="DIR",
                   help="directory for report.json, report.png, logs (default: a new temp dir)")
    alias(p, "--workdir", "--out")  # --out: a file elsewhere
    p.add_argument("--kueue", action="store_true",
                   help="the story behind Kueue (a stand-in for its scheduler): two teams' queues on one spot pool, a "
                        "higher-priority job preempting part of the elastic job, which shrinks live and grows back")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from liveshard.runtime import quiet

    out = Path(args.out or tempfile.mkdtemp(prefix="liveshard-demo-"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    # third-party warnings (megatron-core's at import: the corpus build imports it) go to the
    # log, once each; the pods' too (they inherit the variable)
    os.environ[quiet.WARNINGS_ENV] = str(out / "logs" / "warnings.log")
    quiet.warnings_to(os.environ[quiet.WARNINGS_ENV])
    if getattr(args, "kueue", False):
        from liveshard.dev.localcluster.kueue_demo import run_kueue_demo

        return run_kueue_demo(out)
    from liveshard.dev.localcluster.demo import run_demo

    return run_demo(out)
