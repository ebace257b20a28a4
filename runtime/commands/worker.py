"""``liveshard worker``: the training processes of one worker pod, one per GPU.

With one local worker (``gpusPerWorker: 1``, or ``LOCAL_RANK`` set) this process is one training
rank that follows the job's world plans. With more (``--local-workers``, default
``$LIVESHARD_GPUS_PER_WORKER``, which the operator sets) it is the pod's supervisor: it starts
one copy of its command line per GPU with ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` set and waits for
them (``agent/local_workers.py``). A rank uses CUDA device ``LOCAL_RANK`` when CUDA is present.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Callable

from liveshard.runtime.commands import training_args
from liveshard.runtime.contract.env import Defaults, Env


def configure(p: argparse.ArgumentParser) -> None:
    from liveshard.runtime.cli import add_preallocate, alias, byte_size

    p.add_argument("--id", default=None,
                   help="worker id (default: $LIVESHARD_POD_NAME, $POD_NAME or hostname, plus /$LOCAL_RANK); "
                        "with several local workers each gets /LOCAL_RANK appended")
    p.add_argument("--procs", dest="local_workers", type=int, default=None, metavar="N",
                   help="training processes in this pod, one per GPU (default: $LIVESHARD_GPUS_PER_WORKER, else 1); "
                        "ignored when $LOCAL_RANK is set")
    alias(p, "--procs", "--local-workers")
    p.add_argument("--coordinator", default=os.environ.get(Env.COORDINATOR, "127.0.0.1:29400"),
                   help="host:port of the job's coordinator store")
    p.add_argument("--job-name", default=os.environ.get(Env.JOB, "job"),
                   help="the job's name (its store is authenticated for it; default $LIVESHARD_JOB)")
    training_args.add_arguments(p)
    p.add_argument("--stop-at-step", dest="max_steps", type=int, default=None, metavar="STEP",
                   help="stop at this step without the final checkpoint (default: train to trainIters and save it)")
    alias(p, "--stop-at-step", "--max-steps")
    p.add_argument("--budget", type=byte_size("--budget"), default=Defaults.STAGING_BUDGET, metavar="SIZE",
                   help="staging bytes per rank during a transfer: bytes or a size, e.g. 64MiB, 1GiB "
                        f"(default {Defaults.STAGING_BUDGET >> 20}MiB)")
    p.add_argument("--verify", action="store_true", help="checksum every transferred region")
    add_preallocate(p, "auto", "who allocates its new tensors while training goes on: joiners, all members, "
                               "or auto (all on CPU, joiners on GPU)")
    p.add_argument("--build-world-ahead", choices=("auto", "on", "off"), default="auto",
                   help="a new member connects the next training world's communicators while training goes "
                        "on (on), or at the commit (off); auto: on (NCCL and gloo), at the commit where megatron's groups "
                        "cannot be probed")
    p.add_argument("--transformer-impl", choices=("auto", "local", "transformer_engine"), default=None,
                   help="megatron layer modules: TransformerEngine's (GPU) or the local ones; default: the "
                        "model's transformer_impl (auto: TransformerEngine where installed on a GPU)")
    p.add_argument("--collective-timeout", type=float, default=Defaults.COLLECTIVE_TIMEOUT,
                   help=f"seconds before a collective with a dead peer fails (default {Defaults.COLLECTIVE_TIMEOUT:g})")
    p.add_argument("--pulse", action=argparse.BooleanOptionalAction, default=True,
                   help="heartbeats from a small process of their own, which work holding this process's GIL "
                        "(a data build, a compile) cannot starve (default); --no-pulse: from the control thread")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument("--result", default=None,
                   help="write steps, events and final checksums here (JSON); with several local workers, "
                        "each writes FILE with .LOCAL_RANK before the extension (r.json -> r.0.json)")
    p.add_argument("--step-log", default=None,
                   help="append every step's record to this file (JSON lines) as it is made, flushed, so a "
                        "process killed later leaves the steps it trained; with several local workers, each "
                        "writes FILE with .LOCAL_RANK before the extension")
    p.add_argument("--load", default=None, help="megatron checkpoint to start from")
    p.add_argument("--save-dir", default=None, help="where --save-at-step saves (a megatron checkpoint)")
    p.add_argument("--save-at-step", type=int, default=None, help="save to --save-dir at this step, then exit")
    p.add_argument("--checkpoint-dir", default=os.environ.get(Env.CHECKPOINT_DIR) or None,
                   help="safety checkpoints and the checkpoint a stop saves go here (shared by all workers)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between safety checkpoints (0: off)")
    p.add_argument("--checkpoint-keep", type=int, default=int(os.environ.get(Env.CHECKPOINT_KEEP) or 3),
                   help="complete checkpoints kept in --checkpoint-dir, newest first (0: all)")
    p.add_argument("--checkpoint-interval-seconds", type=float,
                   default=float(os.environ.get(Env.CHECKPOINT_INTERVAL_SECONDS)
                                 or 60 * float(os.environ.get(Env.CHECKPOINT_INTERVAL_MINUTES) or 0)),
                   help="seconds between safety checkpoints (0: off)")
    old = p.add_argument("--checkpoint-interval-minutes", type=float, default=None, help=argparse.SUPPRESS)
    old.replaced_by = "--checkpoint-interval-seconds"  # type: ignore[attr-defined]  # cli.main warns
    p.add_argument("--checkpoint-finalize-steps", type=int, default=0,
                   help="wait for a background checkpoint this many steps after it starts (0: when done)")
    p.add_argument("--fallback-checkpoint-dir", default=os.environ.get(Env.FALLBACK_CHECKPOINT_DIR) or None,
                   help="the final checkpoint goes here when --checkpoint-dir fails (a volume every worker sees)")
    p.add_argument("--final-save-patience", type=float,
                   default=float(os.environ.get(Env.FINAL_SAVE_PATIENCE) or Defaults.FINAL_SAVE_PATIENCE),
                   help="seconds the final checkpoint's retries wait for space before the job fails")


def worker_id(args: argparse.Namespace) -> str:
    """This process's worker id: ``--id`` (``/LOCAL_RANK`` appended in a pod of several
    processes), else ``<pod>/<LOCAL_RANK>``."""
    from liveshard.runtime.agent import local_workers as lw

    local_rank, local_size = lw.local_rank(os.environ)
    pod = os.environ.get(Env.POD_NAME) or os.environ.get("POD_NAME") or socket.gethostname()
    return lw.per_process_id(args.id, local_rank, local_size) if args.id else f"{pod}/{local_rank}"


# megatron-core warns once per module that imports them that Transformer Engine / Apex are
# missing (seven two-line warnings on a CPU worker): one log line says it instead.
_FALLBACK_WARNINGS = (r".*(Transformer Engine|Apex).*(not installed|Falling back).*", r"full scope is deprecated.*")


def _quiet_fallback_warnings() -> None:
    import importlib.util
    import warnings

    for pattern in _FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    # megatron-core's INFO lines are its internals (its FSDP package's import chatter, the mock
    # dataset's split, every gradient bucket's parameters each time a world is built): a
    # worker's log says what liveshard does; megatron's warnings and errors still show
    logging.getLogger("megatron").setLevel(logging.WARNING)
    if importlib.util.find_spec("transformer_engine") is None:
        logging.getLogger("liveshard.worker").info(
            "Transformer Engine is not installed: megatron-core's local layers and torch's optimizer "
            "(expected on CPU; on GPUs install it for the fused kernels)")


def run(args: argparse.Namespace, step_gate: Callable[[int], bool] | None = None,
        command: list[str] | None = None, phase_gate: Callable[[str, int], None] | None = None,
        compute_gate: Callable[[float], None] | None = None) -> int:
    """``step_gate``, ``phase_gate``, ``compute_gate``: see ``WorkerAgent`` (dev tooling only); ``command``: what a pod's
    supervisor starts once per GPU (default: this ``liveshard worker`` command line)."""
    from liveshard.runtime.agent import local_workers as lw
    from liveshard.runtime.errors import ConfigError

    n = lw.default_local_workers(os.environ) if args.local_workers is None else args.local_workers
    if n < 1:
        raise ConfigError("--local-workers", f"must be >= 1, got {n}", "one per GPU of the pod, e.g. 8")
    local_rank, local_size = lw.local_rank(os.environ)
    prefix = f"[local rank {local_rank}] " if local_size > 1 else ""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {prefix}%(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    if lw.should_supervise(n, os.environ):
        return lw.supervise(command or lw.child_command(), n)
    _quiet_fallback_warnings()

    spec, training = training_args.resolve(args)
    import torch

    torch.set_num_threads(args.threads)
    if torch.cuda.is_available():
        # Before anything else touches CUDA: world.device(), NCCL and the trainer use the
        # current device. Every GPU of the pod stays visible, so NCCL can use NVLink/P2P.
        if local_rank >= torch.cuda.device_count():
            raise ConfigError("LOCAL_RANK", f"{local_rank}, but this pod sees {torch.cuda.device_count()} GPU(s)",
                              "gpusPerWorker must match the GPUs the pod gets (nvidia.com/gpu)")
        torch.cuda.set_device(local_rank)
    from liveshard.runtime.agent.worker import WorkerAgent, WorkerOptions
    from liveshard.runtime.megatron.build import resolve_transformer_impl

    spec = resolve_transformer_impl(spec, args.transformer_impl)

    wid = worker_id(args)
    result = lw.per_process_path(args.result, local_rank, local_size) if args.result else None
    step_log = lw.per_process_path(args.step_log, local_rank, local_size) if args.step_log else None
    host, _, port = args.coordinator.rpartition(":")
    options = WorkerOptions(max_steps=args.max_steps, transfer_budget=args.budget, verify=args.verify,
                            preallocate=args.preallocate, build_world_ahead=args.build_world_ahead,
                            collective_timeout=args.collective_timeout, pulse=args.pulse,
                            load_dir=args.load, save_dir=args.save_dir, save_at_step=args.save_at_step,
                            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                            checkpoint_interval=(args.checkpoint_interval_seconds if args.checkpoint_interval_minutes is None
                                                 else 60.0 * args.checkpoint_interval_minutes),
                            checkpoint_finalize_steps=args.checkpoint_finalize_steps,
                            checkpoint_keep=args.checkpoint_keep, step_log=step_log,
                            final_fallback_dir=args.fallback_checkpoint_dir,
                            final_save_patience=args.final_save_patience)
    agent = WorkerAgent(wid, host, int(port), spec, training, options, job=args.job_name, step_gate=step_gate,
                        phase_gate=phase_gate, compute_gate=compute_gate)
    state = agent.run()
    if result:
        out = {
            "id": wid,
            "phase": state.phase,
            "generation": state.generation,
            "rank": state.rank,
            "steps": [r.__dict__ for r in state.records],
            "events": state.events,
            "ready": state.ready,
            "evals": state.evals,
            "final_checkpoint": state.final_checkpoint,
            "failure": state.failure,
            "checksums": agent.final_checksums() if agent.built is not None else {},
        }
        with open(result, "w") as f:
            json.dump(out, f)
    if state.phase == "failed":  # the job cannot end well (the coordinator fails it): say why, in one line
        print(f"liveshard worker: failed: {state.failure}", file=sys.stderr)
        return 1
    return 0
