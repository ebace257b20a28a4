"""The real ``liveshard`` command as a subprocess: bad input is one line and exit 2 before anything
starts; a run that finished exits 0; a dead job exits 1 saying why; an event the coordinator
refuses ends the run at once with the coordinator's reason."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from liveshard.dev.localrun import driver
from liveshard.dev.localrun.driver import RunSpec, run_local
from liveshard.dev.localrun.events import parse_events
from liveshard.runtime.errors import RunFailed

JOB = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob", "metadata": {"name": "exit"},
       "spec": {"model": {"preset": "tiny-gpt"}, "workers": {"max": 2, "gpusPerWorker": 1},
                "training": {"data": {"mock": True}, "trainIters": 5, "globalBatch": 4, "seqLength": 32,
                             "precision": "fp32", "optimizer": {"lr": 1e-3, "minLr": 1e-4, "weightDecay": 0.0},
                             "schedule": {"warmupIters": 1}}}}


def liveshard(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    # cwd outside the repository: its operator/ folder would shadow the standard library's
    return subprocess.run([sys.executable, "-m", "liveshard.runtime.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _one_line(r: subprocess.CompletedProcess, code: int, command: str, *words: str) -> str:
    assert r.returncode == code, (r.returncode, r.stderr[-3000:])
    lines = [x for x in r.stderr.splitlines() if x.startswith(f"liveshard {command}: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _job(tmp_path: Path, **training) -> Path:
    job = json.loads(json.dumps(JOB))
    job["spec"]["training"].update(training)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


# ---- bad input: exit 2, one line, nothing started -----------------------------------------------
def test_bad_numbers_and_bytes_in_the_manifest(tmp_path):
    r = liveshard("run-local", "--job", str(_job(tmp_path, optimizer={"lr": float("inf")})), cwd=tmp_path)
    line = _one_line(r, 2, "run-local", "error:", "spec.training.optimizer.lr", "finite", "fix:")
    assert r.stderr.strip() == line  # nothing else: no process was started
    r = liveshard("run-local", "--job", str(_job(tmp_path, trainIters=10**18)), cwd=tmp_path)
    _one_line(r, 2, "run-local", "spec.training.trainIters", "sane")
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(_job(tmp_path).read_bytes().replace(b"exit", b"ex\xfe\xffit"))
    _one_line(liveshard("run-local", "--job", str(bad), cwd=tmp_path), 2, "run-local", str(bad), "UTF-8")


def test_an_impossible_parallel_event_is_refused_before_any_process_starts(tmp_path):
    workdir = tmp_path / "run"
    t0 = time.monotonic()
    r = liveshard("run-local", "--job", str(_job(tmp_path)), "--events", "2:parallel=tp=3,pp=1,dp=1",
                  "--workdir", str(workdir), cwd=tmp_path)
    _one_line(r, 2, "run-local", "--events", "2:parallel=tp=3", "attention heads", "fix:")
    assert not workdir.exists() and time.monotonic() - t0 < 60


def test_prepare_data_on_json_nested_100000_deep(tmp_path):
    corpus = tmp_path / "deep.jsonl"
    corpus.write_text('{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    tok = tmp_path / "tok"
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator(["some text"] * 10, trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"],
                                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                                  show_progress=False))
    tok.mkdir()
    t.save(str(tok / "tokenizer.json"))
    r = liveshard("prepare-data", "--input", str(corpus), "--tokenizer", str(tok), "--output-prefix",
                  str(tmp_path / "out" / "data"), "--no-progress", cwd=tmp_path)
    _one_line(r, 2, "prepare-data", f"{corpus}:2", "nested too deeply")
    assert not (tmp_path / "out").exists()


def test_convert_with_a_lying_safetensors_header(tmp_path):
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "float32"}))
    shard = model / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(128, 32)}, str(shard))
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["model.embed_tokens.weight"]["data_offsets"][1] *= 1000  # claims bytes the file does not have
    text = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    r = liveshard("convert", "--from", f"hf:{model}", "--to", str(tmp_path / "out"), "--no-progress", cwd=tmp_path)
    _one_line(r, 2, "convert", str(shard), "not a valid safetensors file", "fix:")
    assert not (tmp_path / "out").exists()


# ---- runs: 0 when finished, 1 when not ------------------------------------------------------------
@pytest.mark.long
@pytest.mark.slow
def test_a_finished_run_exits_0(tmp_path):
    r = liveshard("run-local", "--job", str(_job(tmp_path)), "--procs", "2",
                  "--workdir", str(tmp_path / "run"), "--result", str(tmp_path / "run.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "run.json").read_text())
    assert [s["step"] for s in report["steps"]] == [1, 2, 3, 4, 5] and report["final_checkpoint"]
    # the console: a line per step, no third-party warning; a worker's log starts with its own lines
    assert "step 5/5" in r.stderr and "Warning" not in r.stderr, r.stderr[-3000:]
    head = (tmp_path / "run" / "w0.log").read_text().splitlines()[:5]
    assert not [line for line in head if "Warning" in line or " megatron." in line], head


@pytest.mark.slow
def test_a_dead_job_exits_1_and_says_what_to_do(tmp_path):
    """tp=2 on two workers and no checkpoint: a kill takes half of every weight with it. The run
    cannot go on; the coordinator says why and run-local passes it on, with the fix."""
    r = liveshard("run-local", "--job", str(_job(tmp_path, trainIters=6)), "--procs", "2", "--parallel",
                  "tp=2,pp=1,dp=1", "--events", "3:kill=1", "--quiet", "--workdir", str(tmp_path / "run"),
                  "--result", str(tmp_path / "run.json"), cwd=tmp_path)
    _one_line(r, 1, "run-local", "failed:", "NoSurvivingCopy", "--checkpoint-every")


@pytest.mark.slow
def test_an_event_the_coordinator_refuses_is_reported_at_once(tmp_path, monkeypatch):
    """An event run-local could not judge up front (here: its check turned off) is refused by the
    coordinator; the run ends with the coordinator's reason, not a 60 s wait for a plan."""
    monkeypatch.setattr(driver, "_check_parallel_event", lambda run, ev, workers: workers)
    run = RunSpec.mock("tiny-gpt", workers=2, parallel="tp=1,pp=1,dp=2", steps=6, global_batch=4,
                       events=parse_events("2:parallel=tp=3,pp=1,dp=1"), workdir=str(tmp_path / "run"))
    with pytest.raises(RunFailed, match=r"the coordinator refused 'config change to tp=3,pp=1,dp=1': .*tp=3"):
        run_local(run)  # the wait for a plan would have ended in RunTimedOut ("published no plan") after 60 s
    assert "plan request rejected" in (tmp_path / "run" / "coordinator.log").read_text()
