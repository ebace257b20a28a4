"""``liveshard run-local``: a whole job on local processes through a list of world changes.

``--job FILE`` takes the ElasticTrainingJob manifest ``kubectl apply`` takes (its model, training
and parallelism constraints); flags override single fields or, without ``--job``, say it all.
``--check`` checks all of it (job, data, start config, every event) and starts nothing.

Exit codes: 0 the job trained every step and saved its final checkpoint; 1 it did not finish (one
line says why: a worker died and nothing recovered, the coordinator failed the job or refused an
event, the final checkpoint is missing); 2 bad input, found before any process started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from liveshard.runtime.commands import training_args


def configure(p: argparse.ArgumentParser) -> None:
    from liveshard.runtime.cli import add_preallocate, alias

    training_args.add_arguments(p)
    alias(p, "--train-iters", "--steps")
    p.add_argument("--procs", dest="workers", type=int, default=None, metavar="N",
                   help="training processes (one per emulated GPU) at the start (default: the job's workers.replicas "
                        "x gpusPerWorker, the operator's first pods)")
    alias(p, "--procs", "--workers")
    p.add_argument("--parallel", default=None,
                   help="the starting config, e.g. tp=2,pp=1,dp=2 (default: the planner's choice for --procs)")
    p.add_argument("--events", default="", help='e.g. "5:leave=1 10:join=1 15:kill=0 20:parallel=tp=2,pp=1,dp=1"; slow devices: "5:slow=1@0.5 30:slow=1@1"; faults: '
                   '"3:kill=1@commit 4:join=1" (kill at a phase of the next change), "6:sigstop=1 8:sigcont=all"')
    p.add_argument("--mode", choices=("live", "checkpoint"), default="live",
                   help="how the job goes through each world change: live resharding, or save, restart and "
                        "load a checkpoint (default live)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="periodic checkpoint interval (steps)")
    p.add_argument("--verify", action="store_true", help="checksum every transferred region")
    add_preallocate(p, "auto", "who allocates its new tensors while training goes on: joiners, all members, "
                               "or auto (all on CPU, joiners on GPU; liveshard worker)")
    p.add_argument("--build-world-ahead", choices=("auto", "on", "off"), default="auto",
                   help="new members connect the next world's communicators while training goes on (liveshard worker)")
    p.add_argument("--workdir", default=None, help="logs, checkpoints and per-worker results")
    p.add_argument("--result", dest="out", default="run.json", metavar="FILE",
                   help="write the run's report here (JSON; default run.json)")
    alias(p, "--result", "--out")
    p.add_argument("--quiet", action="store_true", help="no progress log on stderr")
    p.add_argument("--check", action="store_true",
                   help="check the job, its data, the start config and every event, then exit (0: valid, 2: not); "
                        "starts no process")
    g = p.add_argument_group("stragglers")
    g.add_argument("--stretch", type=float, default=1.0,
                   help="emulate devices this many times slower than the CPU by sleeping in proportion to their "
                        "compute, so ranks do not compete for the cores (benchmarks; default 1: off)")
    g.add_argument("--adaptive", action="store_true",
                   help="let the straggler policy re-plan around slow devices (with slow=R@F events)")
    g.add_argument("--adaptive-threshold", type=float, default=0.7, help="relative speed below which a device is slow")
    g.add_argument("--adaptive-window", type=int, default=8, help="steps per speed estimate")
    g.add_argument("--adaptive-horizon", type=int, default=200, help="steps over which a switch must pay for itself")
    g.add_argument("--adaptive-min-gain", type=float, default=0.1,
                   help="least predicted saving, as a share of the step, worth a switch")
    g.add_argument("--adaptive-probation", type=int, default=200,
                   help="steps a device set aside for slowness waits before it is tried again")


MAX_LOCAL_WORKERS = 256  # processes of one local run (each imports megatron and builds a model)


def _start_config(args: argparse.Namespace, spec, training, workers: int) -> str:
    """``--parallel``, else the planner's choice for ``workers`` processes: with ``--job``, the
    operator's own call (``planner.pods.plan_for`` on the job's spec, flags applied), so the
    config and the processes left standing by are the ones the operator would plan on as many
    GPUs; without, ``plan_world`` under the flags' batch."""
    if args.parallel:
        return args.parallel
    from liveshard.runtime.errors import ConfigError
    from liveshard.runtime.planner import GPU, Constraints, plan_world
    from liveshard.runtime.planner.search import NoFeasiblePlan

    try:
        if args.job_file:
            plan = _operator_plan(args.job_file, spec, training, workers).plan
        else:
            gpus = [GPU(id=f"w{i}", node="local", memory_bytes=80 << 30) for i in range(workers)]
            plan = plan_world(spec, gpus, Constraints(global_batch=training.global_batch,
                                                      micro_batch=training.micro_batch))
    except NoFeasiblePlan as e:
        raise ConfigError("--procs", f"no parallel config fits {workers} worker(s): {e}",
                          "give --parallel, or another number of --procs") from None
    return str(plan.config)


def _operator_plan(job_file: str, spec, training, workers: int):
    """The operator's first plan for the job in ``job_file`` (``operator.planning`` calls the same
    ``plan_for``) on ``workers`` GPUs in pods of ``spec.workers.gpusPerWorker`` (one GPU each where
    ``workers`` is not a whole number of pods), each on a node of its own with the job's
    ``gpuMemory``."""
    from dataclasses import replace

    from liveshard.runtime.contract.jobspec import read_spec
    from liveshard.runtime.planner.pods import Candidate, plan_for

    raw = training_args.read_job_file(job_file).raw["spec"]
    job = read_spec({**raw, "image": raw.get("image") or "local"})
    job = replace(job, model=spec, training=training)  # the flags' overrides
    if workers % job.workers.gpus_per_worker:
        job = replace(job, workers=replace(job.workers, gpus_per_worker=1))
    pods = workers // job.workers.gpus_per_worker
    if pods > job.workers.max:  # more processes than the job's pods: as many as the operator plans on
        job = replace(job, workers=replace(job.workers, max=pods))
    return plan_for(job, [Candidate(pod=f"w{i}", node=f"local-{i}") for i in range(pods)])


def prepare(args: argparse.Namespace):
    """The run ``args`` ask for, checked as far as it can be before a process starts (what
    ``--check`` runs): a ``RunSpec``, or ConfigError naming the first problem."""
    from liveshard.dev.localrun.driver import RunSpec, check_run
    from liveshard.dev.localrun.events import parse_events
    from liveshard.runtime.contract.jobspec import AdaptivePolicy
    from liveshard.runtime.errors import ConfigError

    spec, training = training_args.resolve(args, env={})
    from liveshard.runtime.data.datasets import check_data

    workers = args.workers
    if workers is None:
        if not args.job_file:
            raise ConfigError("--workers", "is required without --job", "give the number of local workers")
        job = training_args.read_job_file(args.job_file)
        workers = job.workers_replicas * job.gpus_per_worker  # the pods the operator starts
    if workers < 1:
        raise ConfigError("--workers", f"must be >= 1, got {workers}", "give the number of local workers")
    if workers > MAX_LOCAL_WORKERS:
        raise ConfigError("--workers", f"{workers} processes on one machine", f"use at most {MAX_LOCAL_WORKERS}")
    # what a worker would find alone, later (every worker of a local run builds its own index)
    check_data(training, spec.vocab_size, spec.padded_vocab_size, processes=workers)
    from liveshard.runtime.agent.checkpoint import check_start_weights

    check_start_weights(spec, training)
    if args.checkpoint_every < 0:
        raise ConfigError("--checkpoint-every", f"must be >= 0, got {args.checkpoint_every}", "0 (off) or a step count")
    events = parse_events(args.events)
    if any(e.step >= training.train_iters for e in events):
        raise ConfigError("--events", "every event must come before the last step", "raise --steps")
    checkpointing = _job_checkpointing(args.job_file) if args.job_file else {}
    run_spec = RunSpec(
        spec=spec, training=training, workers=workers, parallel=_start_config(args, spec, training, workers),
        events=events, mode=args.mode, verify=args.verify, preallocate=args.preallocate,
        build_world_ahead=args.build_world_ahead, **checkpointing,
        checkpoint_every=args.checkpoint_every, workdir=args.workdir, log=None if args.quiet else sys.stderr,
        adaptive=AdaptivePolicy(enabled=args.adaptive, threshold=args.adaptive_threshold, window=args.adaptive_window,
                                horizon=args.adaptive_horizon, min_gain=args.adaptive_min_gain,
                                probation=args.adaptive_probation), stretch=args.stretch)
    check_run(run_spec)
    return run_spec


def _job_checkpointing(job_file: str) -> dict[str, Any]:
    """What the job file's ``spec.checkpoint`` means on this machine: the seconds between saves
    and how many are kept, where it says so, and the directory. ``spec.checkpoint.path`` is a
    path inside the pods, on the job's volume; the one volume whose files are this machine's is
    a ``hostPath`` (the node's directory): its path is used (made if missing; this user must be
    able to write it). Any other volume: the run's own ``WORKDIR/checkpoints/periodic``."""
    from liveshard.runtime.contract.jobspec import read_checkpointing
    from liveshard.runtime.errors import ConfigError

    section = (training_args.read_job_file(job_file).raw.get("spec") or {}).get("checkpoint")
    if not isinstance(section, dict):
        return {}
    given = read_checkpointing(section)
    out: dict[str, Any] = {"checkpoint_keep": given.keep} if "keep" in section else {}
    if "intervalSeconds" in section or "intervalMinutes" in section:
        out["checkpoint_interval_seconds"] = float(given.interval_seconds)
    volume = section.get("volume") if isinstance(section.get("volume"), dict) else {}
    host = volume.get("hostPath") if isinstance(volume.get("hostPath"), dict) else {}
    if isinstance(host.get("path"), str) and host["path"]:
        path = Path(host["path"])
        field = "spec.checkpoint.volume.hostPath.path"
        if path.is_dir() and any(p for p in path.iterdir() if not p.name.startswith(".liveshard-write-test")):
            # the coordinator would continue the newest checkpoint there: another run's
            raise ConfigError(field, f"{path} is not empty (an earlier run's checkpoints would be continued)",
                              "empty it or name another directory; a new run starts from an empty one")
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".liveshard-write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ConfigError(field, f"{path} cannot be written here: "
                              f"{e.strerror or e}", "give a directory this user can write, or another volume "
                              "(the run's --workdir then holds the checkpoints)") from None
        out["checkpoint_dir"] = str(path)
    return out


@contextlib.contextmanager
def _workdir(run_spec) -> Iterator[Any]:
    """``run_spec`` as it runs: without --workdir, in a directory of its own in the system's temp
    directory, removed when the block ends, finished or failed (a failure says its logs went)."""
    if run_spec.workdir is not None:
        yield run_spec
        return
    import dataclasses
    import shutil
    import tempfile

    workdir = tempfile.mkdtemp(prefix="liveshard-run-")
    try:
        yield dataclasses.replace(run_spec, workdir=workdir)
    except BaseException:
        if run_spec.log is not None:  # not --quiet
            print(f"liveshard run-local: the run's logs were in {workdir}, removed with it; give --workdir DIR "
                  "to keep them", file=sys.stderr)
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    # megatron-core warns at import that Apex / TransformerEngine kernels are missing: a matter
    # for the workers' training (their logs say it), noise on this console
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from liveshard.dev.localrun.driver import run_local
    from liveshard.runtime.errors import RunFailed

    run_spec = prepare(args)
    if args.check:
        from liveshard.runtime.parallel import ParallelConfig

        spare = run_spec.workers - ParallelConfig.parse(run_spec.parallel).world_size
        print(f"{args.job_file or 'the run'} is valid: {run_spec.spec.name}, {run_spec.workers} workers starting as "
              f"{run_spec.parallel}{f' ({spare} standing by)' if spare else ''}, {run_spec.steps} steps, "
              f"{len(run_spec.events)} event(s); nothing was started")
        return 0
    with _workdir(run_spec) as running:
        report = run_local(running)
        _summary(args, report, temporary=args.workdir is None)
        why = unfinished(report, run_spec.steps)  # reads the logs: before they go
        if why:
            raise RunFailed(f"the job did not finish: {why} (report: {args.out})")
    return 0


def _summary(args: argparse.Namespace, report: dict, temporary: bool) -> None:
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for e in report["events"]:
        dt = e.get("downtime")
        print(f"{e['event']:<28} {e['outcome']:<10} downtime {'-' if dt is None else f'{dt:.3f} s'}")
    last = report["steps"][-1] if report["steps"] else {}
    for a in report.get("adaptive") or []:
        d = a.get("decision") or {}
        print(f"adaptive switch at step {a.get('switch_step')}: {a.get('config')} ({a.get('outcome')}; "
              f"predicted {d.get('predictedStepSeconds')} -> {d.get('predictedStepSecondsAfter')} s/step)")
    loss = last.get("loss")
    final = report.get("final_checkpoint")
    if final and temporary and str(final).startswith(str(report.get("workdir"))):
        final = f"{final} (goes with the run's temporary directory: give --workdir DIR to keep it)"
    print(f"{len(report['steps'])} steps, final loss {'-' if loss is None else f'{loss:.4f}'}, "
          f"consumed {last.get('consumed_samples')}"
          f" samples; final checkpoint {final}; report: {args.out}")


def unfinished(report: dict, steps: int) -> str | None:
    """Why the run of ``report`` did not finish (None: every step trained and the final checkpoint
    saved): the steps it reached, and the first worker that failed, with the last line it logged."""
    from liveshard.dev.localrun.driver import last_log_line

    last = report["steps"][-1]["step"] if report["steps"] else 0
    if last >= steps and report.get("final_checkpoint"):
        return None
    what = f"trained {last} of {steps} steps" if last < steps else "no final checkpoint was saved"
    failed = {wid: code for wid, code in (report.get("exit_codes") or {}).items() if code not in (0, None, -9)}
    if failed:
        wid, code = next(iter(failed.items()))
        line = last_log_line(Path(report.get("workdir") or ".") / f"{wid.replace('/', '_')}.log")
        from liveshard.runtime.errors import exit_text

        what += f"; {wid} exited with {exit_text(code)}" + (f": {line}" if line else "")
    return what + f" (logs: {report.get('workdir')})"
