"""Bad input is one line naming the field or file and the fix, exit 2; never a traceback.

The commands run in this process (``liveshard.dev.cli.run_cli``: an exception that escapes the CLI
fails the test). ``run-local --check`` runs every check ``run-local`` makes before it starts a
process, and starts none. The property tests feed random and mutated job manifests, JSON-lines
corpora, Hugging Face configs and safetensors headers to ``run-local --job``, ``prepare-data``
and ``convert`` and accept two outcomes only: success, or exit 2 with one line on stderr.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import struct
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from liveshard.dev.cli import run_cli

JOB: dict[str, Any] = {
    "apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob", "metadata": {"name": "fuzz"},
    "spec": {"model": {"preset": "tiny-gpt"}, "workers": {"max": 2, "gpusPerWorker": 1},
             "parallelism": {"tp": [1, 2]},
             "training": {"data": {"mock": True}, "trainIters": 6, "globalBatch": 4, "microBatch": 1,
                          "seqLength": 32, "precision": "fp32",
                          "optimizer": {"lr": 1e-3, "minLr": 1e-4, "weightDecay": 0.0, "adamBeta1": 0.9,
                                        "adamBeta2": 0.95, "adamEps": 1e-8, "clipGrad": 1.0},
                          "schedule": {"warmupIters": 1, "decayStyle": "cosine"}, "seed": 7,
                          "eval": {"interval": 0, "iters": 2}}}}

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
              "tie_word_embeddings": False, "torch_dtype": "float32"}


def _one_line_or_success(result, command: str) -> None:
    """Success, or exit 2 with exactly one line: ``liveshard COMMAND: error: ...``."""
    with contextlib.suppress(InvalidArgument):  # outside a property test there is nothing to note
        note(f"exit {result.returncode}; stderr: {result.stderr!r}")
    assert result.returncode in (0, 2), result.stderr
    if result.returncode == 2:
        # an old flag spelling's deprecation warning may come first: one error line
        lines = [x for x in result.stderr.strip().splitlines() if not x.startswith(f"liveshard {command}: warning: ")]
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith(f"liveshard {command}: error: "), lines[0]


def _bad(result, command: str, *words: str) -> str:
    """Exit 2, one line, naming every one of ``words``."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    _one_line_or_success(result, command)
    line = result.stderr.strip()
    for w in words:
        assert w in line, (w, line)
    return line


def _write_job(path: Path, job: dict) -> Path:
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _set(tree: dict, keys: tuple[str, ...], value: Any) -> dict:
    out = copy.deepcopy(tree)
    node = out
    for k in keys[:-1]:
        node = node[k]
    if value is _DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return out


_DELETE = object()


def _paths(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if not isinstance(tree, dict):
        return []
    out = []
    for k, v in tree.items():
        out.append((*prefix, k))
        out += _paths(v, (*prefix, k))
    return out


# ---- run-local --job: examples -------------------------------------------------------------------
def _training(tmp_path: Path, **fields: Any) -> Path:
    job = copy.deepcopy(JOB)
    for dotted, value in fields.items():
        job = _set(job, ("spec", "training", *dotted.split("__")), value)
    return _write_job(tmp_path / "job.yaml", job)


def test_the_base_manifest_is_valid(tmp_path):
    r = run_cli("run-local", "--job", str(_write_job(tmp_path / "job.yaml", JOB)), "--check")
    assert r.returncode == 0, r.stderr
    assert "nothing was started" in r.stdout


@pytest.mark.parametrize("field,value,words", [
    ("optimizer__lr", math.inf, ("spec.training.optimizer.lr", "finite", "fix:")),
    ("optimizer__lr", math.nan, ("spec.training.optimizer.lr", "finite")),
    ("optimizer__lr", 50.0, ("spec.training.optimizer.lr", "<= 1")),
    ("optimizer__adamBeta1", 1.0, ("spec.training.optimizer.adamBeta1", "< 1")),
    ("optimizer__adamBeta2", -0.1, ("spec.training.optimizer.adamBeta2", ">= 0")),
    ("optimizer__adamEps", 0.0, ("spec.training.optimizer.adamEps", "> 0")),
    ("optimizer__adamEps", -math.inf, ("spec.training.optimizer.adamEps", "finite")),
    ("optimizer__clipGrad", math.inf, ("spec.training.optimizer.clipGrad", "finite")),
    ("trainIters", 10**18, ("spec.training.trainIters", "sane", "fix:")),
    ("trainIters", 1e18, ("spec.training.trainIters", "integer")),
    ("seqLength", 0, ("spec.training.seqLength", ">= 1")),
    ("seqLength", -32, ("spec.training.seqLength", ">= 1")),
    ("seqLength", 10**12, ("spec.training.seqLength", "sane")),
    ("globalBatch", 2**40, ("spec.training.globalBatch", "sane")),
    ("seed", 2**40, ("spec.training.seed", "numpy")),
    ("initialLossScale", math.inf, ("spec.training.initialLossScale", "finite")),
])
def test_absurd_numbers_are_one_line_naming_the_field(tmp_path, field, value, words):
    r = run_cli("run-local", "--job", str(_training(tmp_path, **{field: value})), "--check")
    _bad(r, "run-local", *words)


def test_a_horizon_of_too_many_samples_names_train_iters(tmp_path):
    # 10^7 steps are a sane count alone, but not of 2^20 sequences each (10^13 samples)
    r = run_cli("run-local", "--job", str(_training(tmp_path, trainIters=10**7, globalBatch=2**20)), "--check")
    _bad(r, "run-local", "spec.training.trainIters", "samples", "horizon")


def test_more_steps_than_the_sample_index_fits_in_memory_are_refused():
    from liveshard.runtime.contract.training import read_training
    from liveshard.runtime.data.datasets import check_index_memory

    training = read_training({"data": {"mock": True}, "trainIters": 10**6, "globalBatch": 1024})
    check_index_memory(training, processes=1, memory_bytes=1 << 45)  # 32 TiB: fits
    with pytest.raises(Exception) as e:
        check_index_memory(training, processes=4, memory_bytes=16 << 30)
    assert e.value.field == "spec.training.trainIters" and "4 process(es)" in str(e.value)
    assert "16.0 GiB" in str(e.value) and "fewer steps" in str(e.value)


def test_the_sample_index_is_checked_by_run_local(tmp_path):
    r = run_cli("run-local", "--job", str(_training(tmp_path, trainIters=10**8, globalBatch=64)), "--check")
    _bad(r, "run-local", "spec.training.trainIters", "sample index", "GiB")


@pytest.mark.parametrize("args,words", [
    (("--workers", "0"), ("--workers", ">= 1")),
    (("--workers", "100000"), ("--workers", "at most")),
    (("--parallel", "tp=2,pp=2,dp=2"), ("--parallel", "needs 8 workers")),
    (("--parallel", "tp=banana"), ("parallel.tp",)),
    (("--events", "3:explode=1"), ("--events", "unknown event kind")),
    (("--events", "9:leave=1"), ("--events", "before the last step")),
    (("--stretch", "inf"), ("--stretch", "finite")),
    (("--checkpoint-every", "-1"), ("--checkpoint-every",)),
    (("--mode", "checkpoint", "--events", "3:kill=1"), ("--checkpoint-every", "periodic")),
])
def test_run_local_flags_are_one_line(tmp_path, args, words):
    r = run_cli("run-local", "--job", str(_write_job(tmp_path / "job.yaml", JOB)), *args, "--check")
    _bad(r, "run-local", *words)


@pytest.mark.parametrize("flag,value,words", [
    ("--lr", "inf", ("--lr", "finite")),
    ("--lr", "nan", ("--lr", "finite")),
    ("--steps", str(10**18), ("--train-iters", "sane")),
    ("--seq-length", "0", ("--seq-length",)),
])
def test_flags_that_override_the_job_are_named_by_their_flag(tmp_path, flag, value, words):
    r = run_cli("run-local", "--job", str(_write_job(tmp_path / "job.yaml", JOB)), flag, value, "--check")
    _bad(r, "run-local", *words)


def test_non_utf8_manifest_names_the_file_and_the_byte(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(yaml.safe_dump(JOB).encode().replace(b"fuzz", b"fu\xffzz"))
    _bad(run_cli("run-local", "--job", str(path), "--check"), "run-local", "--job", str(path), "not UTF-8", "fix:")


def test_manifest_nested_past_any_sane_depth(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("kind: ElasticTrainingJob\nspec: " + "[" * 5_000 + "]" * 5_000 + "\n")
    _bad(run_cli("run-local", "--job", str(path), "--check"), "run-local", "--job", "nest")


def test_non_utf8_model_file_names_it(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_bytes(b"preset: tiny-gpt\nname: \xc3\x28\n")
    r = run_cli("run-local", "--job", str(_write_job(tmp_path / "job.yaml", JOB)), "--model", str(path), "--check")
    _bad(r, "run-local", "model", str(path), "not UTF-8")


# ---- run-local: events it can refuse before any process starts -----------------------------------
@pytest.mark.parametrize("events,words", [
    ("3:parallel=tp=3,pp=1,dp=1", ("--events", "3:parallel=tp=3", "attention heads")),  # tp not dividing heads
    ("3:parallel=tp=1,pp=1,dp=4", ("--events", "needs 4 workers", "2 at that step")),  # more than the job has
    ("2:leave=1 3:parallel=tp=2,pp=1,dp=1", ("--events", "needs 2 workers", "1 at that step")),
    ("3:parallel=tp=1,pp=3,dp=1", ("--events", "pp")),  # layers that do not split into 3 stages
    ("3:parallel=tp=1,pp=1,dp=2,dp_split=3+2", ("--events",)),  # a DP split the batch cannot take
    ("2:leave=7", ("--events", "rank 7")),
])
def test_impossible_events_are_refused_before_anything_starts(tmp_path, events, words):
    workdir = tmp_path / "run"
    # a world of both workers (the planner's own choice for this job is one of them, one standing by)
    r = run_cli("run-local", "--job", str(_write_job(tmp_path / "job.yaml", JOB)), "--events", events,
                "--parallel", "tp=1,pp=1,dp=2", "--workdir", str(workdir))
    _bad(r, "run-local", *words)
    assert not workdir.exists()  # no coordinator, no worker, no log


def test_a_possible_parallel_event_passes_the_check(tmp_path):
    r = run_cli("run-local", "--job", str(_write_job(tmp_path / "job.yaml", JOB)), "--events",
                "3:parallel=tp=2,pp=1,dp=1", "--check")
    assert r.returncode == 0, r.stderr


# ---- run-local --job: property ------------------------------------------------------------------
_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(min_value=-3, max_value=3), max_size=2),
    st.sampled_from([0, -1, 1, 2, 3, 10**18, 1e-300, 1e300, "1e18", "nan", ".inf", "tp=2", "mock", "fp8"]))
_MUTATIONS = st.lists(st.tuples(st.sampled_from(_paths(JOB)), st.one_of(st.just(_DELETE), _VALUES)),
                      min_size=1, max_size=3)
_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(mutations=_MUTATIONS)
def test_mutated_manifests_are_valid_or_one_line(mutations):
    job = JOB
    for keys, value in mutations:
        try:
            job = _set(job, keys, value)
        except (KeyError, TypeError, AttributeError):  # an earlier mutation replaced a parent
            continue
    with tempfile.TemporaryDirectory() as d:
        path = _write_job(Path(d) / "job.yaml", job)
        _one_line_or_success(run_cli("run-local", "--job", str(path), "--check"), "run-local")


@_SETTINGS
@given(data=st.data())
def test_byte_damaged_manifests_are_valid_or_one_line(data):
    raw = bytearray(yaml.safe_dump(JOB, sort_keys=False).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw)))
        what = data.draw(st.sampled_from(["insert", "delete", "truncate"]))
        if what == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=4))
        elif what == "delete":
            del raw[at:at + data.draw(st.integers(1, 8))]
        else:
            del raw[at:]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "job.yaml"
        path.write_bytes(bytes(raw))
        _one_line_or_success(run_cli("run-local", "--job", str(path), "--check"), "run-local")


# ---- prepare-data --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox", "jumps over the lazy dog"] * 20, trainer)
    directory = tmp_path_factory.mktemp("tok")
    tok.save(str(directory / "tokenizer.json"))
    return directory


def _prepare(tokenizer_dir: Path, corpus: Path, out: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_cli("prepare-data", "--input", str(corpus), "--tokenizer", str(tokenizer_dir),
                       "--output-prefix", str(out / "data"), "--no-progress")


@pytest.mark.parametrize("content,words", [
    ("[" * 100_000 + "]" * 100_000 + "\n", ("corpus.jsonl:1", "nested too deeply", "fix:")),
    ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n", ("corpus.jsonl:1", "nested too deeply")),
    ('{"text": "ok"}\n{"text": "a\\ud800b"}\n', ("corpus.jsonl:2", "surrogate")),
    ('{"text": "x", "n": ' + "9" * 5000 + "}\n", ("corpus.jsonl:1", "not valid JSON")),
    ('{"text": "ok"}\n{"text": "a\tb"}\n', ("corpus.jsonl:2", "invalid control character (a raw tab", "column 12")),
])
def test_pathological_json_is_one_line_naming_file_and_line(tmp_path, tokenizer_dir, content, words):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(content)
    _bad(_prepare(tokenizer_dir, corpus, tmp_path / "out"), "prepare-data", *words)
    assert not (tmp_path / "out").exists()


_JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20))
_JSON = st.recursive(_JSON_LEAF, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                         st.dictionaries(st.text(max_size=6), kids, max_size=3)),
                     max_leaves=8)
_LINE = st.one_of(
    st.builds(lambda t: json.dumps({"text": t}), st.text(max_size=30)),
    st.builds(json.dumps, _JSON),
    st.builds(lambda n: "[" * n + "]" * n, st.integers(0, 50_000)),
    st.builds(lambda t: json.dumps({"text": t}).replace("\\\\", "\\"), st.text(max_size=10)),
    st.text(max_size=30).map(lambda t: t.replace("\n", " ")))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_LINE, max_size=5), junk=st.one_of(st.just(b""), st.binary(max_size=6)))
def test_random_corpora_are_prepared_or_one_line(tokenizer_dir, lines, junk):
    with tempfile.TemporaryDirectory() as d:
        corpus = Path(d) / "corpus.jsonl"
        corpus.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + junk)
        _one_line_or_success(_prepare(tokenizer_dir, corpus, Path(d) / "out"), "prepare-data")


# ---- convert -------------------------------------------------------------------------------------
def _hf_dir(directory: Path, config: dict | None = None) -> Path:
    """A complete tiny Hugging Face Llama directory (config.json and one safetensors file)."""
    import torch
    from safetensors.torch import save_file

    from liveshard.runtime.hf.config import spec_from_hf_config
    from liveshard.runtime.hf.names import hf_tensors

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or TINY_LLAMA))
    spec = spec_from_hf_config(TINY_LLAMA, params_dtype="fp32")
    save_file({t.name: torch.zeros(t.shape) for t in hf_tensors(spec)}, str(directory / "model.safetensors"))
    return directory


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    return _hf_dir(tmp_path_factory.mktemp("hf") / "model")


def _import(source: Path, target: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_cli("convert", "--from", f"hf:{source}", "--to", str(target), "--no-progress")


def _occupied(tmp_path: Path) -> Path:
    """An import target that is refused last, after every input check (no process starts)."""
    target = tmp_path / "occupied"
    target.mkdir(exist_ok=True)
    (target / "x").write_text("x")
    return target


def test_the_tiny_checkpoint_passes_every_input_check(tmp_path, hf_model):
    _bad(_import(hf_model, _occupied(tmp_path)), "convert", "--to", "not empty")


@pytest.mark.parametrize("lie", ["offsets past the end", "header length", "shape", "dtype", "not json", "name"])
def test_a_lying_safetensors_header_is_one_line_naming_the_file(tmp_path, hf_model, lie):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(hf_model, model)
    shard = model / "model.safetensors"
    header, data = _header(shard)
    name = next(k for k in header if k != "__metadata__")
    if lie == "offsets past the end":
        header[name]["data_offsets"][1] += 1 << 30
        _write_header(shard, header, data)
    elif lie == "header length":
        _write_header(shard, header, data, length=1 << 60)
    elif lie == "shape":  # a shape whose bytes are not the bytes the offsets give
        header[name]["shape"] = [header[name]["shape"][0] * 1000, *header[name]["shape"][1:]]
        _write_header(shard, header, data)
    elif lie == "dtype":  # integers where the weights are
        header[name]["dtype"] = "I32"
        _write_header(shard, header, data)
    elif lie == "not json":
        shard.write_bytes(struct.pack("<Q", 16) + b"{not json at all" + data)
    else:  # the index names a tensor the shard does not hold
        (model / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {**{k: "model.safetensors" for k in header if k != "__metadata__"},
                            "model.embed_tokens.weight": "other.safetensors"}}))
        (model / "other.safetensors").write_bytes(shard.read_bytes())
        _write_header(model / "other.safetensors", {k: v for k, v in header.items() if k != "model.embed_tokens.weight"},
                      data)
    line = _bad(_import(model, _occupied(tmp_path)), "convert", "safetensors", "fix:")
    assert "Traceback" not in line


@pytest.mark.parametrize("content,words", [
    (b'{"architectures": ["LlamaForCausalLM"], "hidden_size": \xff}', ("config.json", "not UTF-8")),
    (b"[" * 100_000 + b"]" * 100_000, ("config.json", "nests too deeply")),
    (b"[1, 2]", ("config.json", "not a JSON object")),
    (json.dumps({**TINY_LLAMA, "hidden_size": "big"}).encode(), ("config.json",)),
    (json.dumps({**TINY_LLAMA, "num_attention_heads": [4]}).encode(), ("config.json",)),
    (json.dumps({**TINY_LLAMA, "hidden_size": 1e400}).encode(), ("config.json",)),
])
def test_every_convert_input_config_is_one_line(tmp_path, content, words):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_bytes(content)
    _bad(run_cli("convert", "--from", f"hf:{model}", "--print-model"), "convert", *words)


@pytest.mark.parametrize("args,words", [
    (("--from", "hf:/nonexistent/x", "--print-model"), ("config.json", "not found")),
    (("--from", "/nonexistent/ckpt", "--to", "hf:/tmp/x"), ()),
    (("--from", "hf:/nonexistent/x"), ("--to", "required")),
    (("--from", "hf:/a", "--to", "hf:/b"), ("--to", "one side")),
    (("--from", "hf:/a", "--to", "/b", "--procs", "0"), ("--procs",)),
    (("--from", "hf:/a", "--to", "/b", "--parallel", "tp=x"), ("parallel",)),
    (("--from", "/a", "--to", "hf:/b", "--max-shard-size", "lots"), ()),
])
def test_convert_flags_and_paths_are_one_line(args, words):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = run_cli("convert", *args)
    _bad(r, "convert", *words)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(st.tuples(st.sampled_from(sorted(TINY_LLAMA)), st.one_of(st.just(_DELETE), _VALUES)),
                          min_size=1, max_size=3))
def test_mutated_hugging_face_configs_are_read_or_one_line(mutations):
    config = dict(TINY_LLAMA)
    for key, value in mutations:
        config = _set(config, (key,), value)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(config))
        _one_line_or_success(run_cli("convert", "--from", f"hf:{d}", "--print-model"), "convert")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_safetensors_are_checked_or_one_line(hf_model, data):
    import shutil

    header, payload = _header(hf_model / "model.safetensors")
    names = sorted(k for k in header if k != "__metadata__")
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(names))
        key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "drop"]))
        if key == "drop":
            header.pop(name, None)
            continue
        if name not in header:
            continue
        header[name][key] = data.draw(st.one_of(
            _VALUES, st.lists(st.integers(min_value=-1, max_value=2**40), max_size=3),
            st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F64"])))
    payload = payload[:data.draw(st.integers(0, len(payload)))] if data.draw(st.booleans()) else payload
    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "model"
        shutil.copytree(hf_model, model)
        try:
            _write_header(model / "model.safetensors", header, payload)
        except (TypeError, ValueError):  # a value JSON cannot write (nan is written; sets are not drawn)
            return
        r = _import(model, _occupied(Path(d)))
        _one_line_or_success(r, "convert")
        assert r.returncode == 2  # the occupied target is refused at the latest


@pytest.mark.parametrize("argv,words", [
    (["run-local", "--workers", "x"], ("--workers", "invalid int value")),
    (["run-local", "--mode", "fast"], ("--mode", "choose from")),
    (["convert"], ("--from", "required")),
    (["prepare-data", "--input"], ("--input",)),
    (["no-such-command"], ("COMMAND", "invalid choice")),
])
def test_flags_argparse_cannot_read_are_one_line_too(capsys, argv, words):
    from liveshard.runtime.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error:" in err and "--help" in err, err
    for w in words:
        assert w in err, (w, err)
