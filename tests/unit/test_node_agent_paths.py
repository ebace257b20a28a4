"""The local cluster's node agent rewrites a container's paths under a mount to the mount's host
directory, except paths under the agent's own directory: those are the host's already (the
demo's checkpoints and results, named by the job for local processes)."""

from __future__ import annotations

import json

from liveshard.dev.localcluster.node_agent import translate

AGENT = "/tmp/pytest-of-x/demo0"  # the agent's directory, in the system's /tmp
MOUNTS = {"/tmp": f"{AGENT}/pods/1234abcd/tmp", "/checkpoints": f"{AGENT}/claims/default/ckpt"}


def test_a_path_under_a_mount_is_the_mounts_directory():
    assert translate("/tmp/x/y", MOUNTS, AGENT) == f"{AGENT}/pods/1234abcd/tmp/x/y"
    assert translate("/checkpoints", MOUNTS, AGENT) == f"{AGENT}/claims/default/ckpt"
    assert translate("/tmpfoo", MOUNTS, AGENT) == "/tmpfoo"


def test_a_path_under_the_agents_directory_stays_even_under_the_pods_tmp():
    result = f"{AGENT}/results/tiny-gpt-worker-1.json"
    assert translate(result, MOUNTS, AGENT) == result
    assert translate(AGENT, MOUNTS, AGENT) == AGENT
    spec = json.dumps({"checkpoint": f"{AGENT}/checkpoints", "scratch": "/tmp/s", "n": [f"{AGENT}/a", "/tmp/b"]})
    assert json.loads(translate(spec, MOUNTS, AGENT)) == {
        "checkpoint": f"{AGENT}/checkpoints", "scratch": f"{AGENT}/pods/1234abcd/tmp/s",
        "n": [f"{AGENT}/a", f"{AGENT}/pods/1234abcd/tmp/b"]}
    # without it (the old behaviour), the result would land in the pod's emptyDir, removed with it
    assert translate(result, MOUNTS) == f"{AGENT}/pods/1234abcd/tmp{result[len('/tmp'):]}"
