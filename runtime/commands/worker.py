"""``liveshard worker``: one training rank that follows the job's world plans."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--id", default=None, help="worker id (default: hostname or $POD_NAME, plus $LOCAL_RANK)")
    p.add_argument("--coordinator", default=os.environ.get("LIVESHARD_COORDINATOR", "127.0.0.1:29400"),
                   help="host:port of the job's coordinator store")
    p.add_argument("--job", default=os.environ.get("LIVESHARD_JOB", "job"))
    p.add_argument("--model", default=None,
                   help="preset name or YAML file (default: $LIVESHARD_MODEL, the ModelSpec JSON the operator sets)")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--budget", type=int, default=64 << 20, help="staging bytes per rank during a transfer")
    p.add_argument("--verify", action="store_true", help="checksum every transferred region")
    p.add_argument("--collective-timeout", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument("--result", default=None, help="write steps, events and final checksums here (JSON)")
    p.add_argument("--hold-at-steps", default="", help="comma-separated steps at which a plan is due (scripted runs)")
    p.add_argument("--load", default=None, help="megatron checkpoint to start from")
    p.add_argument("--save-dir", default=None)
    p.add_argument("--save-at-step", type=int, default=None, help="save to --save-dir at this step, then exit")
    p.add_argument("--checkpoint-dir", default=None, help="periodic safety checkpoints go here")
    p.add_argument("--checkpoint-every", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    from liveshard.runtime.spec import model_from_ref_or_env

    spec = model_from_ref_or_env(args.model)
    import torch

    torch.set_num_threads(args.threads)
    from liveshard.runtime.agent.trainer import TrainingSettings
    from liveshard.runtime.agent.worker import WorkerAgent, WorkerOptions

    pod = os.environ.get("LIVESHARD_POD_NAME") or os.environ.get("POD_NAME") or socket.gethostname()
    worker_id = args.id or pod + "/" + os.environ.get("LOCAL_RANK", "0")
    host, _, port = args.coordinator.rpartition(":")
    settings = TrainingSettings(global_batch=args.global_batch, micro_batch=args.micro_batch,
                                seq_length=args.seq_length, lr=args.lr, seed=args.seed)
    options = WorkerOptions(max_steps=args.max_steps, transfer_budget=args.budget, verify=args.verify,
                            collective_timeout=args.collective_timeout,
                            hold_at_steps=tuple(int(x) for x in args.hold_at_steps.split(",") if x),
                            load_dir=args.load, save_dir=args.save_dir, save_at_step=args.save_at_step,
                            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every)
    agent = WorkerAgent(worker_id, host, int(port), spec, settings, options, job=args.job)
    state = agent.run()
    if args.result:
        out = {
            "id": worker_id,
            "phase": state.phase,
            "generation": state.generation,
            "rank": state.rank,
            "steps": [r.__dict__ for r in state.records],
            "events": state.events,
            "ready": state.ready,
            "checksums": agent.final_checksums() if agent.built is not None else {},
        }
        with open(args.result, "w") as f:
            json.dump(out, f)
    return 0
