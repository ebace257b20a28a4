"""Every environment variable a liveshard pod reads, named once: the operator's pod builder sets
them (``operator/builders.py``), the commands and the runtime read them, the dev tooling sets
them for local pods. Also the ports and the addresses they default to."""

from __future__ import annotations


class Env:
    JOB = "LIVESHARD_JOB"  # the job's name (the store's key prefix)
    NAMESPACE = "LIVESHARD_NAMESPACE"
    ROLE = "LIVESHARD_ROLE"  # "coordinator" or "worker" in a pod the operator built
    POD_NAME = "LIVESHARD_POD_NAME"
    POD_UID = "LIVESHARD_POD_UID"  # announced in the worker's registration: which pod of that name it is
    NODE_NAME = "LIVESHARD_NODE_NAME"  # the worker's node (the planner's placement, from the pod's spec)
    COORDINATOR = "LIVESHARD_COORDINATOR"  # host:port of the job's store
    BIND = "LIVESHARD_BIND"  # the address the coordinator's store listens on
    PORT = "LIVESHARD_PORT"  # the coordinator's store port
    METRICS_PORT = "LIVESHARD_METRICS_PORT"
    GPUS_PER_WORKER = "LIVESHARD_GPUS_PER_WORKER"
    WORKER_INDEX = "LIVESHARD_WORKER_INDEX"
    MODEL = "LIVESHARD_MODEL"  # the model spec, JSON
    TRAINING = "LIVESHARD_TRAINING"  # the training spec, JSON (contract.training)
    CHECKPOINT_DIR = "LIVESHARD_CHECKPOINT_DIR"
    CHECKPOINT_INTERVAL_SECONDS = "LIVESHARD_CHECKPOINT_INTERVAL_SECONDS"
    CHECKPOINT_INTERVAL_MINUTES = "LIVESHARD_CHECKPOINT_INTERVAL_MINUTES"  # read when SECONDS is absent (older operators)
    CHECKPOINT_KEEP = "LIVESHARD_CHECKPOINT_KEEP"
    # the final checkpoint's fallback directory (a volume every worker sees) and its wait for space
    FALLBACK_CHECKPOINT_DIR = "LIVESHARD_FALLBACK_CHECKPOINT_DIR"
    FINAL_SAVE_PATIENCE = "LIVESHARD_FINAL_SAVE_PATIENCE"
    JOB_SECRET = "LIVESHARD_JOB_SECRET"  # the key of every store value's MAC (a per-job Secret)
    JOB_INCARNATION = "LIVESHARD_JOB_INCARNATION"  # the job's uid (run-local: a run id), bound into every MAC
    JOB_UID = "LIVESHARD_JOB_UID"  # the job object's uid (recorded in every checkpoint with the above)
    CACHE = "LIVESHARD_CACHE"  # where the built-in corpus and dataset indexes are cached
    CORPUS = "LIVESHARD_CORPUS"  # the built-in corpus (``builtin:corpus``) when prebuilt, e.g. in the image


STORE_PORT = 29400  # the coordinator's store
METRICS_PORT = 9400  # the coordinator's Prometheus endpoint in a job's pod


class Defaults:
    """Each default the commands, the worker options and the coordinator share (a test checks the
    command lines and the CRD against these)."""

    HEARTBEAT_TIMEOUT = 3.0  # seconds of silence before the coordinator declares a member dead
    TRANSITION_TIMEOUT = 120.0  # seconds a generation may take before the coordinator aborts it
    # members still training towards a switch extend its wait, up to this many transition timeouts
    TRANSITION_PROGRESS_CAP = 4
    MEMBERS_UP_TIMEOUT = 300.0  # seconds an operator plan without a deadline waits for its members to come up
    COLLECTIVE_TIMEOUT = 20.0  # seconds before a collective with a dead peer fails
    FINAL_SAVE_PATIENCE = 600.0  # seconds the final checkpoint's retries wait for space before the job fails
    STAGING_BUDGET = 64 << 20  # staging bytes per rank during a transfer
    GPU_MEMORY = 80 << 30  # each GPU's memory, when nothing says otherwise
    CHECKPOINT_INTERVAL = 1800  # seconds between the fallback checkpoints (spec.checkpoint.intervalSeconds)
