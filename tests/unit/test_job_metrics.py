"""The coordinator's Prometheus metrics: values in the exposition text, a real scrape, goodput."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from liveshard.runtime.control.metrics import GoodputTracker, JobMetrics


def samples(metrics: JobMetrics | bytes) -> dict[tuple[str, frozenset], float]:
    text = (metrics.exposition() if isinstance(metrics, JobMetrics) else metrics).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: JobMetrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, frozenset({"job": metrics.job, **labels}.items()))]


def test_progress_gauges_in_the_exposition():
    m = JobMetrics("llama-a")
    m.observe_progress(step=120, train_iters=1000, loss=4.25, tokens_per_second=12300.0, world_size=8,
                       generation=3, consumed_samples=3840)
    assert value(m, "liveshard_job_step") == 120
    assert value(m, "liveshard_job_train_iters") == 1000
    assert value(m, "liveshard_job_loss") == 4.25
    assert value(m, "liveshard_job_tokens_per_second") == 12300.0
    assert value(m, "liveshard_job_world_size") == 8
    assert value(m, "liveshard_job_generation") == 3
    assert value(m, "liveshard_job_consumed_samples") == 3840
    # unknown values keep the last known one
    m.observe_progress(step=121, train_iters=None, loss=None, tokens_per_second=None, world_size=8,
                       generation=3, consumed_samples=None)
    assert value(m, "liveshard_job_step") == 121 and value(m, "liveshard_job_loss") == 4.25


def test_generations_by_outcome_and_phase_histogram():
    m = JobMetrics("j")
    assert value(m, "liveshard_job_reconfigurations_total", outcome="committed") == 0  # present from the start
    m.observe_generation("committed", {"prepare": 3.0, "transfer": 0.4, "commit": 0.3, "downtime": 0.8})
    m.observe_generation("committed", {"prepare": 2.0, "transfer": 1.5, "commit": 0.2, "downtime": 1.9,
                                       "invented": 9.0})
    m.observe_generation("aborted: w3: transfer: RuntimeError: boom", {"prepare": 1.0, "transfer": 50.0})
    assert value(m, "liveshard_job_reconfigurations_total", outcome="committed") == 2
    assert value(m, "liveshard_job_reconfigurations_total", outcome="aborted") == 1
    name = "liveshard_job_reconfiguration_seconds"
    assert value(m, name + "_count", phase="downtime") == 2
    assert value(m, name + "_sum", phase="downtime") == pytest.approx(2.7)
    assert value(m, name + "_sum", phase="transfer") == pytest.approx(1.9)  # not the aborted 50 s
    assert value(m, name + "_bucket", phase="downtime", le="1.0") == 1
    assert value(m, name + "_bucket", phase="downtime", le="2.0") == 2
    assert not any(dict(labels).get("phase") == "invented" for _, labels in samples(m))
    with pytest.raises(ValueError, match="outcome"):
        m.observe_generation("rejected: no plan", {})


def test_goodput_ratio():
    m = JobMetrics("j")
    m.observe_goodput(productive_seconds=90.0, wall_seconds=100.0)
    assert value(m, "liveshard_job_goodput_ratio") == pytest.approx(0.9)
    m.observe_goodput(productive_seconds=100.2, wall_seconds=100.0)
    assert value(m, "liveshard_job_goodput_ratio") == 1.0
    m.observe_goodput(productive_seconds=0.0, wall_seconds=0.0)  # nothing to divide by: unchanged
    assert value(m, "liveshard_job_goodput_ratio") == 1.0


def test_goodput_tracker_counts_steps_between_samples_and_uncounts_lost_ones():
    g = GoodputTracker()
    assert g.update(step=10, step_seconds=1.0, now=1000.0) == (0.0, 0.0)  # the start
    assert g.update(step=14, step_seconds=1.0, now=1004.0) == (4.0, 4.0)
    assert g.update(step=14, step_seconds=1.0, now=1010.0) == (4.0, 10.0)  # a 6 s reconfiguration
    assert g.update(step=20, step_seconds=2.0, now=1022.0) == (16.0, 22.0)
    # restored from a checkpoint at step 16: 4 of the 10 counted steps are lost, at 1.6 s each
    productive, wall = g.update(step=16, step_seconds=None, now=1030.0)
    assert productive == pytest.approx(16.0 - 4 * 1.6) and wall == 30.0


def test_observe_heartbeats_takes_the_newest_step_and_the_last_stage_loss():
    m = JobMetrics("j")
    members = ("w0", "w1", "w2", "w3")
    beats = {
        "w0": {"step": 41, "loss": None, "step_seconds": 0.9, "generation": 2},
        "w1": {"step": 42, "loss": None, "step_seconds": 1.0, "generation": 2},
        "w2": {"step": 42, "loss": 3.5, "step_seconds": 1.25, "generation": 2, "consumed_samples": 42 * 16},
        "w3": {"step": None, "loss": None, "step_seconds": None, "generation": 2},  # building its model
        "gone": {"step": 99, "loss": 0.1, "step_seconds": 9.0},  # not in the world: ignored
    }
    m.observe_heartbeats(beats, members, generation=2, train_iters=500, tokens_per_step=16 * 1024, now=100.0)
    assert value(m, "liveshard_job_step") == 42
    assert value(m, "liveshard_job_loss") == 3.5
    assert value(m, "liveshard_job_tokens_per_second") == pytest.approx(16 * 1024 / 1.25)  # the slowest rank
    assert value(m, "liveshard_job_world_size") == 4 and value(m, "liveshard_job_generation") == 2
    assert value(m, "liveshard_job_train_iters") == 500
    assert value(m, "liveshard_job_consumed_samples") == 42 * 16
    for hb in beats.values():
        if hb["step"] is not None:
            hb["step"] += 8
    m.observe_heartbeats(beats, members, generation=2, now=120.0)
    assert value(m, "liveshard_job_goodput_ratio") == pytest.approx(8 * 1.25 / 20.0)


def test_observe_heartbeats_before_any_step_does_nothing():
    m = JobMetrics("j")
    m.observe_heartbeats({"w0": {"step": None}}, ["w0"], generation=0, now=1.0)
    assert ("liveshard_job_step", frozenset({("job", "j")})) not in samples(m)


def test_two_jobs_in_one_process_do_not_clash_and_stay_off_the_default_registry():
    a, b = JobMetrics("a"), JobMetrics("b")
    a.observe_progress(1, 10, 2.0, 5.0, 2, 0, 8)
    b.observe_progress(7, 70, 1.0, 9.0, 4, 1, 56)
    assert value(a, "liveshard_job_step") == 1 and value(b, "liveshard_job_step") == 7
    assert not any(k[1] == frozenset({("job", "b")}) for k in samples(a))
    assert not any(f.name.startswith("liveshard_job_") for f in REGISTRY.collect())


def test_serve_answers_a_scrape():
    m = JobMetrics("scraped")
    m.observe_progress(5, 50, 6.5, 100.0, 2, 1, 40)
    m.observe_generation("committed", {"downtime": 0.5})
    server = m.serve(0, addr="127.0.0.1")  # port 0: a free port
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            body = response.read()
    finally:
        server.shutdown()
        server.server_close()
    got = samples(body)
    assert got[("liveshard_job_step", frozenset({("job", "scraped")}))] == 5
    assert got[("liveshard_job_loss", frozenset({("job", "scraped")}))] == 6.5
    assert got[("liveshard_job_reconfiguration_seconds_count",
                frozenset({("job", "scraped"), ("phase", "downtime")}))] == 1


def test_device_speeds_stragglers_and_adaptive_switches_are_exported():
    m = JobMetrics("j")
    health = {"members": {"w0": {"speed": 1.0}, "w1": {"speed": 0.45}}, "stragglers": ["w1"],
              "adaptive": {"switches": 2}}
    m.observe_speeds(health)
    text = generate_latest(m.registry).decode()
    assert 'liveshard_device_relative_speed{device="w1",job="j"} 0.45' in text
    assert 'liveshard_device_straggler{device="w1",job="j"} 1.0' in text
    assert 'liveshard_device_straggler{device="w0",job="j"} 0.0' in text
    assert 'liveshard_job_adaptive_switches_total{job="j"} 2.0' in text
    m.observe_speeds({"members": {"w0": {"speed": 1.0}}, "stragglers": [], "adaptive": {"switches": 2}})
    text = generate_latest(m.registry).decode()
    assert 'device="w1"' not in text and 'liveshard_job_adaptive_switches_total{job="j"} 2.0' in text
