"""Each image's install replayed in a fresh virtualenv, then run far enough to prove its pods' imports.

No Docker daemon here, so the Dockerfiles cannot be built. Instead each test module run:

* reads from ``images/<image>/Dockerfile`` the extras (``.[operator]``, ``liveshard-*.whl[runtime]``)
  and the other requirements (``megatron-core==${MEGATRON_CORE_VERSION}``) of its ``pip install``;
* builds the project's wheel once (non-editable, from a copy of the repository's package sources);
* creates one isolated virtualenv per image (no ``--system-site-packages``) and installs into it
  what the Dockerfile installs: for the worker image ``torch==2.13.0`` first (the CPU wheel on this
  machine's disk; an unpinned torch would download GBs), then the rest with torch pinned, as the
  Dockerfile's ``-c /tmp/torch-pin.txt`` does. The two venvs are built concurrently;
* runs the pods' entry points in them: the worker image's coordinator reads a real
  ElasticTrainingJob from the API emulator (served by this test's own venv, over HTTP) and
  publishes the plan the job's status carries; the operator image imports the operator and runs
  the planner, without torch.

(``tests/unit/test_images.py`` checks statically that each Dockerfile COPYs every package folder
the wheel is built from: the venvs here are built from the repository's sources.)

The venv tests are marked ``slow`` (about two to three minutes on a 2-core machine, mostly pip).
The venvs are built with ``pip --python`` (the test venv's pip installing into the new venv, which
has none of its own) and ``--no-compile`` (byte code is written on first import instead): together
that saves a few tens of seconds a run on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import tomllib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from liveshard.dev.dockerfile import instructions
from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the CPU wheel on local disk: never let pip pick a torch by itself
NS = "default"
# Dev tooling (the `local` / `test` extras): never in an image.
DEV_ONLY = ("kmock", "matplotlib")
# aiohttp is dev tooling too, but kopf (operator) and recent kubernetes clients (both images) require it
# themselves: it may be present only through them.
AIOHTTP_REQUIRERS = {"kopf", "kubernetes", "aiohttp-retry"}


# ---- what the Dockerfiles install ------------------------------------------------------------------
def resolve(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


# the project in a pip install: `.[EXTRAS]` (a source tree) or `.../liveshard-*.whl)[EXTRAS]` (a wheel)
PROJECT = re.compile(r"(?:^\.|liveshard[^\s\[]*)\[([\w,.-]+)\]$")
OPTIONS_WITH_VALUE = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url",
                      "-f", "--find-links", "--target", "-t", "--prefix", "--root"}


@dataclass(frozen=True)
class ImageInstall:
    image: str
    extras: tuple[str, ...]
    requirements: tuple[str, ...]  # named beside the project in the same pip install

    @property
    def needs_torch(self) -> bool:
        return "runtime" in self.extras


def shell_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line (quotes respected), split at ``&&``, ``||``, ``;``, ``|``."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lex:
        if token in ("&&", "||", ";", "|", "&"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def image_install(image: str) -> ImageInstall:
    """The extras and requirements of the Dockerfile's ``pip install`` of the project."""
    dockerfile = ROOT / "images" / image / "Dockerfile"
    instrs = instructions(dockerfile)
    args = dict(a.split("=", 1) for k, a in instrs if k == "ARG" and "=" in a)
    found = []
    for kind, command in instrs:
        if kind != "RUN":
            continue
        for words in shell_commands(resolve(command, args)):
            if "pip" not in words or "install" not in words:
                continue
            words = words[words.index("install") + 1:]
            extras: tuple[str, ...] = ()
            requirements: list[str] = []
            skip = False
            for word in words:
                if skip:
                    skip = False
                elif word in OPTIONS_WITH_VALUE:
                    skip = True
                elif word.startswith("-"):
                    continue
                elif m := PROJECT.search(word):
                    extras = tuple(e.strip() for e in m.group(1).split(",") if e.strip())
                else:
                    requirements.append(word)
            if extras:
                found.append(ImageInstall(image, extras, tuple(requirements)))
    assert len(found) == 1, f"{dockerfile}: expected one pip install of the project with extras, found {found}"
    unresolved = [r for r in found[0].requirements if "$" in r]
    assert not unresolved, f"{dockerfile}: requirements with unresolved build args: {unresolved}"
    return found[0]


def test_the_dockerfiles_install_the_expected_extras():
    assert image_install("operator").extras == ("operator",)
    worker = image_install("worker")
    assert worker.extras == ("runtime",)
    assert any(r.startswith("megatron-core") for r in worker.requirements)


# ---- building the venvs ------------------------------------------------------------------------------
def sh(cmd: list[str], *, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd``; on failure, fail the test with its output."""
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if res.returncode != 0:
        pytest.fail(f"{shlex.join(cmd)} exited {res.returncode}\n--- stdout\n{res.stdout[-6000:]}\n"
                    f"--- stderr\n{res.stderr[-6000:]}", pytrace=False)
    return res


def stage_sources(dest: Path) -> Path:
    """A copy of what the wheel is built from: pyproject.toml, the readme and every package folder.

    Built from a copy so that no build/ or *.egg-info is written into the shared working tree."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dest.mkdir(parents=True)
    shutil.copy2(ROOT / "pyproject.toml", dest)
    readme = meta["project"].get("readme")
    if isinstance(readme, str):
        shutil.copy2(ROOT / readme, dest)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in sorted(set(meta["tool"]["setuptools"]["package-dir"].values())):
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)
    return dest


def build_wheel(workdir: Path, timings: dict[str, float]) -> Path:
    started = time.monotonic()
    src = stage_sources(workdir / "src")
    out = workdir / "wheels"
    sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(src)])
    timings["wheel"] = time.monotonic() - started
    (wheel,) = out.glob("liveshard-*.whl")
    return wheel


def build_venv(install: ImageInstall, wheel: Path, dest: Path, timings: dict[str, float]) -> Path:
    """A fresh, isolated venv with what the image's Dockerfile installs."""
    started = time.monotonic()
    sh([sys.executable, "-m", "venv", "--without-pip", str(dest)])
    python = dest / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-compile"]
    extra: list[str] = []
    if install.needs_torch:
        # The image keeps its base's torch: install ours first, then pin it (the Dockerfile's -c).
        sh([*pip, TORCH])
        version = sh([str(python), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                     env=venv_env(dest), cwd=dest).stdout.strip()
        pin = dest.parent / f"{install.image}-torch-pin.txt"
        pin.write_text(f"torch=={version.split('+')[0]}\n")
        extra = ["-c", str(pin)]
        timings[f"{install.image}: torch"] = time.monotonic() - started
    sh([*pip, *extra, *install.requirements, f"{wheel}[{','.join(install.extras)}]"])
    timings[f"{install.image}: venv"] = time.monotonic() - started
    return dest


def venv_env(venv: Path) -> dict[str, str]:
    """The environment of a process of the image: the venv's bin first, nothing of the test's venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PYTHONNOUSERSITE"] = "1"
    return env


@pytest.fixture(scope="module")
def venvs(tmp_path_factory):
    """image -> Future of its venv; both are built at once (the operator's is ready first)."""
    workdir = tmp_path_factory.mktemp("images")
    timings: dict[str, float] = {}
    started = time.monotonic()
    wheel = build_wheel(workdir, timings)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="venv") as pool:
        futures: dict[str, Future[Path]] = {
            image: pool.submit(build_venv, image_install(image), wheel, workdir / f"venv-{image}", timings)
            for image in ("worker", "operator")  # the slow one first
        }
        yield futures
        for f in futures.values():
            f.exception()  # wait for both before the tmp dir may go
    timings["all builds"] = time.monotonic() - started
    print("\nimage venv build timings (s):", ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))


def run_in(venv: Path, cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return sh(cmd, env=venv_env(venv), cwd=cwd, timeout=timeout)


def python_in(venv: Path, script: str, cwd: Path, *args: str, timeout: float = 300) -> dict:
    """Run ``script`` in the venv; it prints one JSON object as its last line."""
    res = run_in(venv, [str(venv / "bin" / "python"), "-c", textwrap.dedent(script), *args], cwd, timeout)
    return json.loads(res.stdout.strip().splitlines()[-1])


CHECK_PACKAGES = """
    import importlib.metadata as md, importlib.util, json, re, sys

    def requirers(dist_name):
        out = []
        for dist in md.distributions():
            for req in dist.requires or ():
                if re.search(r"\\bextra\\s*==", req):
                    continue  # only for an extra of that package's: not installed through it here
                if re.split(r"[\\s;\\[<>=!~(]", req, maxsplit=1)[0].lower().replace("_", "-") == dist_name:
                    out.append(dist.metadata["Name"].lower())
        return sorted(set(out))

    names = sys.argv[1:]
    print(json.dumps({
        "prefix": sys.prefix,
        "liveshard": __import__("liveshard.runtime").runtime.__file__,
        "present": {n: importlib.util.find_spec(n) is not None for n in names},
        "aiohttp_requirers": requirers("aiohttp"),
    }))
"""


def check_isolated_and_lean(venv: Path, cwd: Path, absent: tuple[str, ...]) -> None:
    """liveshard comes from the venv (not the repository), and dev tooling is not installed."""
    out = python_in(venv, CHECK_PACKAGES, cwd, *absent, "aiohttp")
    assert Path(out["prefix"]) == venv
    assert Path(out["liveshard"]).is_relative_to(venv), out["liveshard"]
    present = [n for n in absent if out["present"][n]]
    assert not present, f"{venv.name}: importable but must not be: {present}"
    if out["present"]["aiohttp"]:
        requirers = set(out["aiohttp_requirers"])
        assert requirers and requirers <= AIOHTTP_REQUIRERS, f"aiohttp is installed, required by {requirers}"


# ---- the API server (in this test's venv) ------------------------------------------------------------
def create_job(kube, name: str, **spec) -> dict:
    import kubernetes.client as k8s

    custom = k8s.CustomObjectsApi(kube.api_client())
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ElasticTrainingJob", "metadata": {"name": name},
            "spec": {"model": {"preset": "tiny-gpt"}, "image": "liveshard/worker:dev",
                     "workers": {"max": 4, "gpusPerWorker": 2}, "training": {"data": {"mock": True}, "trainIters": 1000, "globalBatch": 64}, **spec}}
    return custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)


def write_plan(kube, job: str, plan: dict) -> None:
    import kubernetes.client as k8s

    custom = k8s.CustomObjectsApi(kube.api_client())
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, PLURAL, job, {"status": {"plan": plan}})


def job_status(kube, job: str) -> dict:
    import kubernetes.client as k8s

    custom = k8s.CustomObjectsApi(kube.api_client())
    return custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job).get("status") or {}


# ---- the operator image ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.long
def test_operator_image_imports_without_torch_or_dev_tooling(venvs, tmp_path):
    venv = venvs["operator"].result()
    out = python_in(venv, """
        import json
        import liveshard.operator.command, liveshard.operator.handlers, liveshard.operator.reconcile
        print(json.dumps({"ok": True}))
    """, tmp_path)
    assert out == {"ok": True}
    check_isolated_and_lean(venv, tmp_path, absent=("torch", *DEV_ONLY))


@pytest.mark.slow
@pytest.mark.long
def test_operator_image_commands_run(venvs, tmp_path):
    venv = venvs["operator"].result()
    liveshard = str(venv / "bin" / "liveshard")
    run_in(venv, [liveshard, "--help"], tmp_path)  # the Dockerfile's own smoke check
    assert "usage: liveshard operator" in run_in(venv, [liveshard, "operator", "--help"], tmp_path).stdout
    res = run_in(venv, [liveshard, "plan", "--model", "llama3-70b", "--gpus", "64", "--json"], tmp_path)
    plan = json.loads(res.stdout)
    assert plan["world_size"] == 64 and plan["config"]


# ---- the worker image (worker and coordinator pods) ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.long
def test_worker_image_imports_without_dev_tooling(venvs, tmp_path):
    venv = venvs["worker"].result()
    out = python_in(venv, """
        import json
        import liveshard.runtime.commands.worker, liveshard.runtime.agent.worker
        import liveshard.runtime.megatron.build, liveshard.runtime.coordinator
        import liveshard.runtime.coordinator.kube_source
        import torch, megatron.core, kubernetes
        print(json.dumps({"torch": torch.__version__}))
    """, tmp_path)
    assert out["torch"].startswith(TORCH.split("==")[1])
    check_isolated_and_lean(venv, tmp_path, absent=DEV_ONLY)


@pytest.mark.slow
@pytest.mark.long
def test_worker_image_commands_start(venvs, tmp_path):
    venv = venvs["worker"].result()
    liveshard = str(venv / "bin" / "liveshard")
    run_in(venv, [liveshard, "--help"], tmp_path)  # the Dockerfile's own smoke check
    assert "usage: liveshard coordinator" in run_in(venv, [liveshard, "coordinator", "--help"], tmp_path).stdout
    assert "usage: liveshard worker" in run_in(venv, [liveshard, "worker", "--help"], tmp_path).stdout


@pytest.mark.slow
@pytest.mark.long
def test_worker_image_plan_source_reads_the_job(venvs, kube, tmp_path):
    """The coordinator's KubePlanSource, from the worker venv, against the API server."""
    venv = venvs["worker"].result()
    job = "image-source"
    create_job(kube, job, training={"data": {"mock": True}, "trainIters": 1000, "globalBatch": 16})
    write_plan(kube, job, {"generation": 1, "config": "tp=1,pp=1,dp=2", "members": ["p-0"],
                           "gpusPerWorker": 2, "reason": "initial"})
    out = python_in(venv, """
        import json, sys, time
        from liveshard.runtime.contract.keys import Keys
        from liveshard.runtime.coordinator.kube_source import KubePlanSource
        from liveshard.runtime.control.kubeapi import make_api_client
        from liveshard.runtime.control.store import JobStore, serve_store

        url, namespace, job = sys.argv[1:]
        store = JobStore(serve_store("127.0.0.1", 0), job, b"image-test-secret")
        source = KubePlanSource(store, job, namespace, api=make_api_client(server=url), poll_interval=0.0)
        obj = source.read_job()
        before = source.poll()  # its workers have not registered: nothing to hand on yet
        for w in ("p-0/0", "p-0/1"):
            store.register_member(w, {"pid": 1})
            store.set_json(Keys.heartbeat(w), {"time": time.time(), "state": "waiting"})
        request = source.poll()
        print(json.dumps({"name": obj["metadata"]["name"], "spec": obj["spec"], "before": repr(before),
                          "members": list(request.members) if request else None,
                          "config": request.config if request else None}))
    """, tmp_path, kube.url, NS, job, timeout=300)
    assert out["name"] == job and out["spec"]["training"]["globalBatch"] == 16
    assert out["before"] == "None"
    assert out["members"] == ["p-0/0", "p-0/1"] and out["config"] == "tp=1,pp=1,dp=2"


@pytest.mark.slow
@pytest.mark.long
def test_worker_image_coordinator_reads_the_job_and_publishes_its_plan(venvs, kube, tmp_path):
    """``liveshard coordinator --source kubernetes`` as the coordinator pod runs it (kubeconfig in
    place of the service account): it reads the job, serves the store, and publishes the plan the
    job's status carries once its workers (played by this test) have registered."""
    from liveshard.dev.ports import free_port
    from liveshard.runtime.contract.keys import SECRET_ENV, Keys
    from liveshard.runtime.control.store import JobStore, connect_store

    venv = venvs["worker"].result()
    job = "image-coord"
    create_job(kube, job, training={"data": {"mock": True}, "trainIters": 1000, "globalBatch": 16})
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    port = free_port()
    log = (tmp_path / "coordinator.log").open("w+")
    proc = subprocess.Popen(
        [str(venv / "bin" / "liveshard"), "coordinator", "--source", "kubernetes", "--kubeconfig", str(kubeconfig),
         "--namespace", NS, "--job-name", job, "--model", "tiny-gpt", "--host", "127.0.0.1", "--port", str(port)],
        env={**venv_env(venv), SECRET_ENV: "image-test-secret"}, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)

    def output() -> str:
        log.flush()
        log.seek(0)
        return log.read()[-6000:]

    try:
        deadline = time.monotonic() + 180  # torch + megatron imports, byte code written on first use
        while True:
            assert proc.poll() is None, f"the coordinator exited {proc.returncode}:\n{output()}"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break  # it serves the store only after reading the job
            assert time.monotonic() < deadline, f"the coordinator's store did not come up:\n{output()}"
            time.sleep(0.5)
        store = JobStore(connect_store("127.0.0.1", port), job, b"image-test-secret")
        workers = (f"{job}-worker-0/0", f"{job}-worker-0/1")

        def beat() -> None:
            for w in workers:
                store.set_json(Keys.heartbeat(w), {"time": time.time(), "state": "waiting"})

        for w in workers:
            store.register_member(w, {"pid": 1, "host": "127.0.0.1", "time": time.time()})
        beat()
        write_plan(kube, job, {"generation": 1, "config": "tp=2,pp=1,dp=1", "members": [f"{job}-worker-0"],
                               "gpusPerWorker": 2, "reason": "initial"})
        deadline = time.monotonic() + 60
        while store.latest_generation() < 0:
            assert proc.poll() is None, f"the coordinator exited {proc.returncode}:\n{output()}"
            status = job_status(kube, job)
            assert "abortedGeneration" not in status, f"plan aborted: {status.get('abortReason')}\n{output()}"
            assert time.monotonic() < deadline, f"no plan published:\n{output()}"
            beat()
            time.sleep(0.3)
        plan = store.plan(store.latest_generation())
        assert plan is not None and tuple(plan.members) == workers, plan
        assert "operator plan 1" in plan.reason
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
