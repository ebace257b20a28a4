"""What only a GPU can tell: the runtime's CUDA and NCCL paths on one device, in a few minutes.

``python -m liveshard.dev.gpu_check [--out gpu_check.json]`` runs each part in its own process
(a part that hangs or crashes costs only its own timeout) and prints one line per part:

- ``env``: torch, CUDA, the device, NCCL, NVML, megatron-core and TransformerEngine versions.
- ``layout``: megatron-core's GPT built on the device (TransformerEngine's modules where they
  import, else megatron's local ones and TransformerEngine's parameter structure) has exactly
  the regions and gradient buffers of the pure ``vps.layout.Layout``.
- ``run_local``: ``run-local`` with one worker on the device trains through a stop that saves a
  checkpoint and a resume that restores it; its losses and final state are compared with an
  uninterrupted run.
- ``nccl_world``: a world of one on NCCL: ``torch.distributed.split_group`` of an eagerly
  initialised parent, then the next world's communicators built ahead
  (``comms.world.build_world_ahead``) and handed over to ``init_process_group`` and megatron's
  ``initialize_model_parallel``; a collective on every group.
- ``nccl_shrink``: the NCCL path of a leave, as far as one device allows: the NCCL version and
  whether torch exposes ``shrink_group`` (NCCL >= 2.27), ``split_group`` (>= 2.18) and a grow; an
  eager world (``init_process_group("nccl", device_id=...)``, world size 1) and a split of it,
  timed; then the world object's lifecycle (``comms.world.World``: made from scratch, megatron's
  groups configured, a collective, a shrink made to fail, the fallback's world made again, a
  collective, shut down), each step timed. A world of one has nobody to shrink away: the shrink
  itself needs two GPUs.
- ``pack``: the transfer executor's pack and unpack (``transfer.packing``) of a real transition
  plan's chunks, against the device's own copy bandwidth for the same bytes.
- ``health``: NVML's health reading (``telemetry.gpu_health``) and the CUDA-event compute clock
  (``agent.compute_clock.ComputeClock``) against a synchronised wall clock.

Each line is ``PASS``, ``FAIL`` (with the reason) or ``SKIP`` (what is missing); the JSON has
every figure. The whole check stays within ``--budget`` seconds (8 minutes): a part gets at most
what is left, and a part with less than ``MIN_PART_SECONDS`` left is SKIP. Exit 0 when no part failed (and, with ``--require-gpu``, a GPU was there).
``--cpu`` runs the same parts on the CPU with gloo (a dry run of this script, not a GPU check).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
BUDGET_SECONDS = 480.0  # the whole check: 8 minutes
MIN_PART_SECONDS = 20  # a part with less than this left is skipped


class Skipped(Exception):
    """A part that cannot run here (its reason says what is missing)."""


def _device() -> Any:
    import torch

    if os.environ.get("LIVESHARD_GPU_CHECK_CPU") == "1":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Skipped("no CUDA device (run with --cpu for a dry run on the CPU)")
    return torch.device("cuda", 0)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _world_of_one(device: Any) -> Any:
    """The default process group of a world of one: NCCL, eagerly initialised, on a GPU."""
    import torch.distributed as dist

    from liveshard.dev.ports import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1,
                            **kwargs)
    return store


def _train_steps(built: Any, device: Any, steps: int = 4, batch: int = 4, seq: int = 32) -> list[float]:
    """``steps`` optimizer steps of ``built`` (a world of one) on one fixed batch; each step's loss."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = torch.randint(0, built.spec.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(5))
    data = data.to(device)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)

    def forward_step(data_iterator: Any, model: Any) -> Any:
        tokens, labels = next(data_iterator)
        output = model(tokens, position_ids, causal, labels=labels)
        return output, lambda per_token: (per_token.float().mean(), {"lm loss": per_token.float().mean().detach()})

    losses = []
    for _ in range(steps):
        built.ddp.zero_grad_buffer()
        built.optimizer.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([(data[:, :-1].contiguous(), data[:, 1:].contiguous())]),
            model=built.chunks, num_microbatches=1, seq_length=seq, micro_batch_size=batch, forward_only=False)
        ok, _, _ = built.optimizer.step()
        if not ok:
            raise RuntimeError("the optimizer step was skipped")
        losses.append(round(float(out[0]["lm loss"]), 5))
    return losses


def _judged(figures: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """A part's figures, with its failure when it found problems."""
    if problems:
        figures["failure"] = "; ".join(problems)
    return figures


# ---- parts ------------------------------------------------------------------------------------
def part_env() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                           "cuda_available": torch.cuda.is_available()}
    for dist_name in ("megatron-core", "transformer-engine", "nvidia-ml-py"):
        try:
            out[dist_name] = md.version(dist_name)
        except md.PackageNotFoundError:
            out[dist_name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                   cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
    return out


def part_layout() -> dict[str, Any]:
    import dataclasses

    from liveshard.runtime.megatron import build, extract
    from liveshard.runtime.parallel import ParallelConfig
    from liveshard.runtime.presets import PRESETS
    from liveshard.runtime.vps.layout import Layout

    device = _device()
    _world_of_one(device)
    build.compat.install()
    te = build.transformer_engine_available()
    out: dict[str, Any] = {"device": str(device), "transformer_engine": te, "cases": {}}
    cases = [("tiny-llama", "tp=1,pp=1,dp=1"), ("gpt-125m", "tp=1,pp=1,dp=1,dist_opt,bucket=4000000")]
    for preset, cfg_text in cases:
        cfg = ParallelConfig.parse(cfg_text)
        for impl in ("local", "transformer_engine"):
            spec = dataclasses.replace(PRESETS[preset], transformer_impl=impl, params_dtype="bf16")
            layer_spec = None
            if impl == "transformer_engine" and not te:  # TransformerEngine's structure, megatron's modules
                from liveshard.dev.fused_layer_spec import fused_layer_spec

                layer_spec = fused_layer_spec(spec)
            t0 = time.perf_counter()
            built = build.build_model(spec, cfg, seed=7, layer_spec=layer_spec)
            try:
                on = {str(p.device) for p in built.model.parameters()}
                live = sorted(extract.live_regions(built, 0))
                live_buffers = [(b.expert, b.dp_size, b.buckets, b.params) for b in extract.grad_buffers(built)]
            finally:
                del built
                build.destroy()
            layout = Layout(spec, cfg)
            pure = sorted(layout.regions(0))
            pure_buffers = [
                (bool(b.params and b.params[0].param.expert), b.dp_size, tuple(b.buckets),
                 tuple(sorted(((bp.param.name, bp.start, bp.bucket) for bp in b.params), key=lambda t: t[1])))
                for b in layout.buffers(0)]
            name = f"{preset} {cfg_text} {impl}" + ("" if impl == "local" or te else " (structure only)")
            out["cases"][name] = {
                "regions": len(live), "equal": live == pure and bool(live), "buffers_equal": live_buffers == pure_buffers,
                "only_live": [str(tuple(r)) for r in sorted(set(live) - set(pure))][:4],
                "only_pure": [str(tuple(r)) for r in sorted(set(pure) - set(live))][:4],
                "parameters_on": sorted(on), "build_seconds": round(time.perf_counter() - t0, 2)}
    bad = [n for n, c in out["cases"].items() if not (c["equal"] and c["buffers_equal"])]
    off_device = [n for n, c in out["cases"].items() if c["parameters_on"] != [str(device)] and device.type == "cuda"]
    if bad or off_device:
        out["failure"] = f"layout differs: {bad}" if bad else f"parameters not on {device}: {off_device}"
    return out


def part_run_local() -> dict[str, Any]:
    from liveshard.dev.localrun.driver import RunSpec, run_local
    from liveshard.dev.localrun.events import parse_events

    device = _device()
    steps, batch = 8, 8
    model = "gpt-125m" if device.type == "cuda" else "tiny-llama"
    out: dict[str, Any] = {"device": str(device), "model": model}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        reports = {}
        for name, events in (("stopped", "4:stop=resume"), ("plain", "")):
            t0 = time.perf_counter()
            reports[name] = run_local(RunSpec.mock(
                model, workers=1, parallel="tp=1,pp=1,dp=1", steps=steps, global_batch=batch,
                seq_length=128 if device.type == "cuda" else 32,
                micro_batch=2, precision="bf16", events=parse_events(events), mode="live",
                workdir=os.path.join(tmp, name), checkpoint_every=3))
            out[f"{name}_seconds"] = round(time.perf_counter() - t0, 1)
    stopped, plain = reports["stopped"], reports["plain"]
    got = [s["step"] for s in stopped["steps"]]
    losses = [s["loss"] for s in stopped["steps"]]
    event = (stopped.get("events") or [{}])[0]
    out.update(steps=got, losses=losses, plain_losses=[s["loss"] for s in plain["steps"]],
               stop_outcome=event.get("outcome"), stop_phases=event.get("phases"),
               losses_equal=losses == [s["loss"] for s in plain["steps"]],
               state_equal=bool(stopped.get("checksums")) and stopped.get("checksums") == plain.get("checksums"),
               step_seconds=[s.get("seconds") for s in stopped["steps"]])
    problems = []
    if got != list(range(1, steps + 1)):
        problems.append(f"steps {got}")
    if not all(isinstance(x, float) and 0 < x < 20 for x in losses) or not losses[-1] < losses[0]:
        problems.append(f"losses {losses}")
    if event.get("outcome") != "committed":
        problems.append(f"the stop ended {event.get('outcome')}")
    return _judged(out, problems)


def part_nccl_world() -> dict[str, Any]:
    import dataclasses

    import torch
    import torch.distributed as dist

    from liveshard.runtime.comms import world as worlds
    from liveshard.runtime.megatron import build
    from liveshard.runtime.parallel import ParallelConfig
    from liveshard.runtime.spec import load_model

    device = _device()
    out: dict[str, Any] = {"device": str(device)}
    store = _world_of_one(device)
    # a group split off an eagerly initialised parent (what a leave's new world derives from)
    t0 = time.perf_counter()
    try:
        child = dist.split_group(split_ranks=[[0]])
        t = torch.ones(4, device=device)
        dist.all_reduce(t, group=child)
        _sync(device)
        out["split_group"] = {"ok": bool(t.sum().item() == 4), "seconds": round(time.perf_counter() - t0, 4)}
    except Exception as e:  # gloo has no split; reported, judged below for NCCL only
        out["split_group"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:200]}
    dist.destroy_process_group()

    # the next world's communicators built ahead, handed over to torch.distributed and megatron
    build.compat.install()
    cfg = ParallelConfig.parse("tp=1,pp=1,dp=1")
    timeout = 60.0
    requests = build.group_requests(cfg, 0, timeout)
    ahead = worlds.build_world_ahead(store, "gen/ahead/", 0, 1, requests, timeout)
    out["ahead_seconds"] = round(ahead.seconds, 4)
    t0 = time.perf_counter()
    worlds.init_training_world(store, "gen/world/", 0, 1, timeout, ahead=ahead)
    build.init_parallel(cfg, ahead, timeout=timeout)
    out["made_from_ahead_seconds"] = round(time.perf_counter() - t0, 4)
    from megatron.core import parallel_state as ps

    groups = {"world": None, "tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
              "dp": ps.get_data_parallel_group(), "mp": ps.get_model_parallel_group()}
    sums = {}
    for name, group in groups.items():
        t = torch.full((8,), 2.0, device=device)
        dist.all_reduce(t, group=group)
        sums[name] = float(t[0].item())
    out.update(backend=dist.get_backend(), requests=len(requests), handed=ahead.handed,
               missed=[r.desc for r in ahead.missed], collectives=sums)
    # megatron trains on the handed-over world (its groups' backend is named AHEAD, not "nccl")
    spec = dataclasses.replace(load_model("tiny-llama"), params_dtype="bf16")
    built = build.build_model(spec, ParallelConfig.parse("tp=1,pp=1,dp=1,dist_opt"), seed=3, init_parallel_state=False)
    try:
        out["losses_on_handed_over"] = _train_steps(built, device)
    finally:
        del built
    try:  # a group split off the handed-over world (leave without a new rendezvous)
        child = dist.split_group(split_ranks=[[0]])
        t = torch.ones(2, device=device)
        dist.all_reduce(t, group=child)
        out["split_of_handed_over"] = {"ok": True}
    except Exception as e:
        out["split_of_handed_over"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:200]}
    build.destroy()
    worlds.destroy_training_world()
    problems = []
    if device.type == "cuda" and not out["split_group"]["ok"]:
        problems.append(f"split_group: {out['split_group'].get('error')}")
    if out["handed"] == 0 or out["missed"]:
        problems.append(f"handed {out['handed']}, made at the commit {out['missed']}")
    if any(v != 2.0 for v in sums.values()):
        problems.append(f"collectives {sums}")
    trained = out["losses_on_handed_over"]
    if not (all(0 < x < 20 for x in trained) and trained[-1] < trained[0]):
        problems.append(f"training on the handed-over world: losses {trained}")
    if out["backend"] != worlds.AHEAD:
        problems.append(f"backend {out['backend']}")
    return _judged(out, problems)


def _version_tuple(v: Any) -> tuple[int, ...] | None:
    if isinstance(v, tuple):
        return tuple(int(x) for x in v)
    if isinstance(v, int):  # NCCL_VERSION_CODE: 22703 for 2.27.3
        return (v // 10000, v // 100 % 100, v % 100)
    return None


def part_nccl_shrink() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from liveshard.runtime.comms import world as worlds
    from liveshard.runtime.megatron import build
    from liveshard.runtime.parallel import ParallelConfig

    device = _device()
    out: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    nccl = None
    if device.type == "cuda":
        nccl = _version_tuple(torch.cuda.nccl.version())
    out["nccl_version"] = ".".join(map(str, nccl)) if nccl else None
    grow = sorted(n for n in dir(dist) if "grow" in n.lower())
    out["api"] = {"shrink_group": hasattr(dist, "shrink_group"), "split_group": hasattr(dist, "split_group"),
                  "grow": grow}
    out["nccl_carries"] = {"shrink (>= 2.27)": bool(nccl and nccl >= (2, 27)),
                           "split (>= 2.18)": bool(nccl and nccl >= (2, 18)),
                           "grow (>= 2.29)": bool(nccl and nccl >= (2, 29))}
    steps: dict[str, float] = {}

    def timed(name: str, work: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return work()
        finally:
            _sync(device)
            steps[name] = round(time.perf_counter() - t0, 4)

    def all_reduce_ok(group: Any = None) -> bool:
        t = torch.full((4,), 3.0, device=device)
        dist.all_reduce(t, group=group)
        _sync(device)
        return bool(t.sum().item() == 12.0)

    # the eager world: what split_group and shrink_group need (a bound device)
    store = timed("eager_world", lambda: _world_of_one(device))
    default = dist.distributed_c10d._get_default_group()
    out["bound_device"] = str(default.bound_device_id) if default.bound_device_id is not None else None
    out["supports_shrinking"] = worlds.supports_shrinking() if hasattr(worlds, "supports_shrinking") else None
    out["world_collective_ok"] = all_reduce_ok()
    try:
        child = timed("split_group", lambda: dist.split_group(split_ranks=[[0]]))
        out["split_collective_ok"] = all_reduce_ok(child)
    except Exception as e:  # gloo refuses a split (no bound device)
        out["split_error"] = f"{type(e).__name__}: {e}"[:200]
    dist.destroy_process_group()

    # the world object's lifecycle through a fallback (comms.world.World), else torch directly
    problems: list[str] = []
    World = getattr(worlds, "World", None)
    cfg = ParallelConfig.parse("tp=1,pp=1,dp=1")
    if World is not None and hasattr(World, "recreate"):
        out["lifecycle"] = "comms.world.World"
        build.compat.install()
        world = timed("world_scratch", lambda: World.scratch(store, "check/scratch/", 0, 1, 60.0))
        timed("world_configure", lambda: build.init_parallel(cfg, None, timeout=60.0))
        out["configured_collective_ok"] = all_reduce_ok()
        os.environ[worlds.SHRINK_FAULT_ENV] = "fail"
        try:
            timed("shrink_made_to_fail", lambda: world.shrink([1], "check/shrunk/", 10.0))
            problems.append("a shrink made to fail did not raise")
        except worlds.ShrinkFailed as e:
            out["shrink_failed_as_made"] = str(e)[:120]
        finally:
            os.environ.pop(worlds.SHRINK_FAULT_ENV, None)
        out["errored_after_failed_shrink"] = world.errored()
        timed("fallback_shutdown", lambda: worlds.shutdown_current())
        out["errored_after_shutdown"] = world.errored()
        again = timed("world_recreate", lambda: World.recreate(store, "check/again/", 0, 1, 60.0, name="check/again/"))
        # megatron's groups as a shrink makes them, by their members only (comms.groups): on an eager
        # NCCL world one split_group per kind of group
        from collections import Counter

        from liveshard.runtime.comms import groups as member_groups

        made_before = Counter(member_groups.MADE)
        timed("recreated_configure", lambda: build.init_parallel(cfg, None, timeout=60.0, members_only=True))
        out["members_only_steps"] = dict(Counter(member_groups.MADE) - made_before)
        out["recreated_collective_ok"] = all_reduce_ok()
        out["recreated_is_current"] = World.current() is again
        timed("recreated_shutdown", lambda: again.shutdown())
        out["errored_at_end"] = again.errored()
        if not out["configured_collective_ok"] or not out["recreated_collective_ok"]:
            problems.append("a collective on the world object's world was wrong")
        if out["errored_after_failed_shrink"] or not out["errored_after_shutdown"] or not out["errored_at_end"] \
                or not out["recreated_is_current"]:
            problems.append(f"lifecycle states: {out}")
    else:  # no world object in this tree: torch's own calls, the same sequence
        out["lifecycle"] = "torch.distributed directly (no comms.world.World in this tree)"
        timed("world_scratch", lambda: _world_of_one(device))
        timed("world_recreate", lambda: (dist.destroy_process_group(), _world_of_one(device)))
        out["recreated_collective_ok"] = all_reduce_ok()
        dist.destroy_process_group()
    out["seconds"] = steps
    if device.type == "cuda":
        if not out["nccl_carries"]["shrink (>= 2.27)"] or not out["api"]["shrink_group"]:
            problems.append(f"no shrink: NCCL {out['nccl_version']}, torch shrink_group {out['api']['shrink_group']}")
        if out["bound_device"] is None or "split_error" in out or not out.get("split_collective_ok"):
            problems.append(f"the eager world: bound {out['bound_device']}, split {out.get('split_error', 'ok')}")
        if out["supports_shrinking"] is False:
            problems.append("the eager NCCL world does not support shrinking")
        if "members_only_steps" in out and "split" not in out["members_only_steps"]:
            problems.append(f"megatron's groups by their members only did not split: {out['members_only_steps']}")
    return _judged(out, problems)


def part_pack() -> dict[str, Any]:
    import torch

    from liveshard.dev.reshard.reference import check_reference, fill_reference
    from liveshard.runtime.parallel import ParallelConfig
    from liveshard.runtime.spec import load_model
    from liveshard.runtime.transfer import packing, rounds
    from liveshard.runtime.transfer.storage import allocate
    from liveshard.runtime.vps.devices import DeviceMap
    from liveshard.runtime.vps.schedule import schedule
    from liveshard.runtime.vps.transition import plan_transition

    device = _device()
    model = "gpt-125m" if device.type == "cuda" else "tiny-llama"
    old, new = ParallelConfig.parse("tp=2,pp=1,dp=1"), ParallelConfig.parse("tp=1,pp=1,dp=1")
    # device 1 leaves: everything it holds is packed there and unpacked on device 0
    plan = plan_transition(load_model(model), old, new, DeviceMap(2, 8, {1}, 0))
    sched = schedule(plan, 1 << 30)
    sent = [ch for ch in sched.chunks if plan.copies[ch.copy].src == 1 and plan.copies[ch.copy].dst == 0]
    source = fill_reference(plan.old_layout, 1, device)
    dest = allocate(plan.new_layout, 0, device)
    size = packing.buffer_size(sent)
    data = sum(ch.nbytes for ch in sent)
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    plain_src = torch.empty(size, dtype=torch.uint8, device=device)
    plain_dst = torch.empty(size, dtype=torch.uint8, device=device)

    def timed(fn: Callable[[], None], repeat: int = 5) -> float:
        fn()
        _sync(device)
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        return best

    pack_s = timed(lambda: packing.pack(buf, sent, plan, source))
    unpack_s = timed(lambda: packing.unpack(buf, sent, plan, dest))
    copy_s = timed(lambda: plain_dst.copy_(plain_src))
    # the rest of the new rank's state is device 0's own (copied in place), then every region checks
    fill = fill_reference(plan.old_layout, 0, device)
    for ci, c in enumerate(plan.copies):
        if (c.src, c.dst) != (0, 0):
            continue
        ch = rounds.whole_copy(plan, ci)
        for state in plan.groups[c.group].states:
            packing.piece(dest, state, c.dst_view, c.dst_rel, ch).copy_(
                packing.piece(fill, state, c.src_view, c.src_rel, ch))
    mismatches = check_reference(plan.new_layout, 0, dest)
    gbps = lambda s: round(data / s / 1e9, 1)  # noqa: E731 - bytes moved once, per second
    out = {"device": str(device), "model": model, "chunks": len(sent), "bytes": data, "staging_bytes": size,
           "pack_GBps": gbps(pack_s), "unpack_GBps": gbps(unpack_s), "device_copy_GBps": gbps(copy_s),
           "pack_vs_copy": round(copy_s / pack_s, 3), "unpack_vs_copy": round(copy_s / unpack_s, 3),
           "mismatched_regions": len(mismatches)}
    if mismatches:
        out["failure"] = f"{len(mismatches)} regions differ after pack/unpack: {mismatches[:3]}"
    return out


def part_health() -> dict[str, Any]:
    import torch

    from liveshard.runtime import telemetry
    from liveshard.runtime.agent.compute_clock import ComputeClock

    device = _device()
    out: dict[str, Any] = {"device": str(device)}
    health = telemetry.gpu_health()
    out["nvml"] = health
    n = 8192 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    clock = ComputeClock(cuda=device.type == "cuda")
    reps = 20
    for _ in range(3):
        a @ b  # warm-up
    _sync(device)
    results = []
    # on a GPU the clock is the kernels' time (synchronised wall time around them); on a CPU the
    # training thread's CPU time
    now = time.perf_counter if device.type == "cuda" else time.thread_time
    for _ in range(3):
        clock.begin_step()
        t0 = now()
        segment = clock("forward-compute")
        segment.start()
        for _ in range(reps):
            a @ b
        segment.stop()
        clock("forward-send").start()  # not compute: ignored
        measured = clock.end_step()
        _sync(device)
        wall = now() - t0
        results.append((measured, wall))
    measured, wall = min(results)
    out.update(compute_seconds=round(measured, 5), wall_seconds=round(wall, 5),
               agreement=round(measured / wall, 3), tflops=round(2 * n**3 * reps / measured / 1e12, 1))
    problems = []
    if device.type == "cuda":
        if not health or "error" in health:
            problems.append(f"NVML: {health}")
        elif health.get("sm_clock_mhz", 0) <= 0:
            problems.append(f"NVML clock {health}")
        elif set(health.get("throttle", ())) & telemetry.HARDWARE_THROTTLE:
            problems.append(f"the GPU is throttled: {health['throttle']}")
    if not 0.8 <= out["agreement"] <= 1.05:
        problems.append(f"compute clock {measured:.4f} s against {wall:.4f} s of wall time")
    return _judged(out, problems)


PARTS: dict[str, tuple[Callable[[], dict[str, Any]], int]] = {  # name: (part, timeout seconds)
    "env": (part_env, 60),
    "health": (part_health, 90),
    "pack": (part_pack, 120),
    "nccl_world": (part_nccl_world, 150),
    "nccl_shrink": (part_nccl_shrink, 120),
    "layout": (part_layout, 150),
    "run_local": (part_run_local, 300),
}


# ---- running the parts --------------------------------------------------------------------------
def _run_part(name: str, result_path: str) -> int:
    """In the part's own process: run it and write its verdict."""
    part, _ = PARTS[name]
    t0 = time.perf_counter()
    try:
        figures = part()
        verdict = FAIL if "failure" in figures else PASS
        reason = figures.pop("failure", "")
    except Skipped as e:
        verdict, reason, figures = SKIP, str(e), {}
    except Exception as e:
        import traceback

        verdict, reason, figures = FAIL, f"{type(e).__name__}: {e}"[:400], {"traceback": traceback.format_exc()[-2000:]}
    record = {"part": name, "verdict": verdict, "reason": reason, "seconds": round(time.perf_counter() - t0, 1),
              "figures": figures}
    with open(result_path, "w") as f:
        json.dump(record, f, default=str)
    return 0


def _spawn(name: str, cpu: bool, limit: float | None = None) -> dict[str, Any]:
    _, timeout = PARTS[name]
    if limit is not None:
        timeout = max(1, min(timeout, int(limit)))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cpu:
        env["LIVESHARD_GPU_CHECK_CPU"] = "1"
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "liveshard.dev.gpu_check", "--part", name, "--result", path],
                              env=env, timeout=timeout, capture_output=True, text=True)
        with open(path) as f:
            text = f.read()
        if text:
            return json.loads(text)
        return {"part": name, "verdict": FAIL, "seconds": round(time.perf_counter() - t0, 1), "figures": {},
                "reason": f"its process ended {proc.returncode} without a verdict: {proc.stderr.strip()[-300:]}"}
    except subprocess.TimeoutExpired:
        return {"part": name, "verdict": FAIL, "seconds": timeout, "figures": {},
                "reason": f"no verdict within {timeout} s"}
    finally:
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m liveshard.dev.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_check.json", help="the JSON with every part's figures")
    p.add_argument("--parts", default=",".join(PARTS), help=f"a comma-separated subset of {', '.join(PARTS)}")
    p.add_argument("--cpu", action="store_true", help="run the parts on the CPU with gloo (a dry run)")
    p.add_argument("--require-gpu", action="store_true", help="exit 1 when no GPU was there")
    p.add_argument("--budget", type=float, default=BUDGET_SECONDS,
                   help="seconds the whole check may take (default 480: 8 minutes)")
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part:
        return _run_part(args.part, args.result)
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"--parts: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    records = []
    start = time.monotonic()
    for name in names:
        left = args.budget - (time.monotonic() - start)
        if left < MIN_PART_SECONDS:
            record = {"part": name, "verdict": SKIP, "seconds": 0.0, "figures": {},
                      "reason": f"the check's {args.budget:.0f} s budget is spent"}
        else:
            record = _spawn(name, args.cpu, left)
        records.append(record)
        print(f"{record['verdict']} {name} ({record['seconds']} s){': ' + record['reason'] if record['reason'] else ''}",
              flush=True)
    gpu = any(r["part"] == "env" and r["figures"].get("cuda_available") for r in records)
    report = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu_dry_run": args.cpu, "parts": records}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    failed = [r["part"] for r in records if r["verdict"] == FAIL]
    print(f"{'FAIL' if failed else 'PASS'} gpu_check: {len(records) - len(failed)} of {len(records)} parts without "
          f"failure{'; failed: ' + ', '.join(failed) if failed else ''} -> {args.out}")
    return 1 if failed or (args.require_gpu and not gpu) else 0


if __name__ == "__main__":
    sys.exit(main())
