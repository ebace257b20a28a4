"""Hugging Face weights in and out, checked against ``transformers`` itself.

Tiny random models are built offline with ``transformers`` (Llama with GQA, untied embeddings
and Llama 3.1 rope scaling; Qwen3 with qk-norm and tied embeddings; Qwen3-MoE with top-k
routing), imported into megatron-core models of several layouts (tp, pp, dp, ep, uneven layer
splits), and the megatron logits are compared with ``transformers``' logits on the same tokens
(fp32). ``liveshard convert`` round trips are compared bit for bit, and the export is loaded back
by ``transformers.AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from liveshard.dev.procpool import GlooPool  # noqa: E402
from liveshard.runtime.hf.config import spec_from_hf_config  # noqa: E402
from liveshard.runtime.parallel import ParallelConfig  # noqa: E402
from liveshard.runtime.spec import ModelSpec  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 304  # 16 * 19: no padding rows at tp <= 16, as with real vocabularies
SEQ, BATCH = 12, 2


def _make(kind: str, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    torch.manual_seed({"llama": 1, "qwen3": 2, "qwen3_moe": 3}[kind])
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                          num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=50000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    elif kind == "qwen3":
        cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=72, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=64,
                          tie_word_embeddings=True)
    else:
        cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    path = out / kind
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: _make(kind, root) for kind in ("llama", "qwen3", "qwen3_moe")}


@pytest.fixture(scope="module")
def pool():
    p = GlooPool(4, preload=("liveshard.runtime.megatron.build", __name__), timeout_s=240)
    yield p
    p.close()


def _tokens() -> Any:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def _hf_logits(path: Path, tokens: Any, labels: bool = False) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        if labels:
            return model(tokens, labels=tokens).loss
        return model(tokens).logits


def _spec(path: Path) -> ModelSpec:
    return spec_from_hf_config(json.loads((path / "config.json").read_text()), params_dtype="fp32")


# ---- jobs (every rank of a pool world) -----------------------------------------------------------
def logits_job(rank: int, world: int, spec_data: dict, cfg_text: str, source: str, tokens: Any,
               megatron_dir: str | None = None) -> Any:
    """Full logits (and the per-token loss) of the imported model, from the last stage's TP rank 0."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from liveshard.runtime.agent.checkpoint import load_weights
    from liveshard.runtime.hf.weights import load_hf
    from liveshard.runtime.megatron import build

    spec = ModelSpec.from_dict(spec_data)
    built = build.build_model(spec, ParallelConfig.parse(cfg_text), hidden_dropout=0.0, attention_dropout=0.0)
    try:
        if megatron_dir:
            load_weights(built, megatron_dir)
        else:
            load_hf(built.model, spec, source)
        model = built.model.eval()
        b, s = tokens.shape
        pos = torch.arange(s).unsqueeze(0).expand(b, -1)
        mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
        labels = torch.roll(tokens, -1, dims=1)

        def step(_it: Any, m: Any) -> Any:
            logits = m(tokens, pos, mask)
            losses = m(tokens, pos, mask, labels=labels) if ps.is_pipeline_last_stage() else logits

            def collect(output: Any, non_loss_data: bool = False) -> Any:
                return (output, losses)
            return logits, collect

        with torch.no_grad():
            out = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=[model],
                                              num_microbatches=1, seq_length=s, micro_batch_size=b,
                                              forward_only=True, collect_non_loss_data=True)
        if not ps.is_pipeline_last_stage():
            return None
        logits, losses = out[0]
        tp_group = ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
        torch.distributed.all_gather(parts, logits.contiguous(), group=tp_group)
        if ps.get_tensor_model_parallel_rank() or ps.get_data_parallel_rank():
            return None
        return torch.cat(parts, dim=-1)[..., :spec.vocab_size], losses[:, :-1].mean()
    finally:
        del built
        build.destroy()


def _last(results: list[Any]) -> Any:
    found = [r for r in results if r is not None]
    assert len(found) == 1
    return found[0]


# ---- logits equal transformers' in several layouts --------------------------------------------------
CASES = [
    ("llama", "tp=1,pp=1,dp=1"),
    ("llama", "tp=2,pp=1,dp=1"),
    ("llama", "tp=1,pp=2,dp=1,layers=2+1"),
    ("llama", "tp=2,pp=2,dp=1,layers=1+2"),
    ("qwen3", "tp=2,pp=1,dp=2"),
    ("qwen3", "tp=1,pp=2,dp=2,layers=3+1"),
    ("qwen3_moe", "tp=1,pp=1,dp=2,ep=2"),
    ("qwen3_moe", "tp=1,pp=2,dp=2,ep=2"),
]


@pytest.mark.parametrize("kind,cfg_text", CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_imported_logits_equal_transformers(pool: GlooPool, hf_models: dict, kind: str, cfg_text: str) -> None:
    path = hf_models[kind]
    spec = _spec(path)
    tokens = _tokens()
    logits, loss = _last(pool.run(logits_job, spec.to_dict(), cfg_text, str(path), tokens,
                                  world=ParallelConfig.parse(cfg_text).world_size))
    expected = _hf_logits(path, tokens)
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-4
    # the training loss on this batch: megatron's per-token cross entropy against transformers'
    assert abs(loss.item() - _hf_logits(path, tokens, labels=True).item()) <= 1e-5


# ---- liveshard convert: import, export, round trip ------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "liveshard.runtime.cli", "convert", *args, "--no-progress"],
                          capture_output=True, text=True, timeout=600)


def _tensors(directory: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_convert_round_trip_is_bit_exact_and_loads_in_transformers(pool: GlooPool, hf_models: dict, tmp_path: Path) -> None:
    """Qwen3-MoE into pp=2 with expert parallelism and back through two writer processes and
    several files; the import also loads with plain megatron-core into another layout."""
    src = hf_models["qwen3_moe"]
    ckpt, out = tmp_path / "megatron", tmp_path / "hf"
    layout = "pp=2,dp=2,ep=2"
    done = _cli("--from", f"hf:{src}", "--to", str(ckpt), "--parallel", layout)
    assert done.returncode == 0, done.stderr[-2000:]
    # no third-party warning (megatron-core's, torch's FutureWarnings) from it or its processes
    assert "Warning" not in done.stderr, done.stderr[-2000:]
    meta = json.loads((ckpt / "liveshard.json").read_text())
    assert meta["contents"] == "model" and ParallelConfig.parse(meta["config"]) == ParallelConfig.parse(layout)
    done = _cli("--from", str(ckpt), "--to", f"hf:{out}", "--max-shard-size", "60KB", "--procs", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "model.safetensors.index.json").exists()
    from liveshard.runtime.hf.weights import _file_mode

    # readable by whoever the umask lets read an ordinary file (safetensors itself writes 0600)
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == {f.name: _file_mode() for f in out.iterdir()}
    _assert_same_tensors(src, out)
    tokens = _tokens()
    assert torch.equal(_hf_logits(src, tokens), _hf_logits(out, tokens))
    other = "tp=1,pp=1,dp=2,ep=2"
    logits, _ = _last(pool.run(logits_job, _spec(src).to_dict(), other, "", tokens, str(ckpt),
                               world=ParallelConfig.parse(other).world_size))
    assert (logits - _hf_logits(src, tokens)).abs().max().item() <= 1e-4


def _assert_same_tensors(a: Path, b: Path) -> None:
    before, after = _tensors(a), _tensors(b)
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert torch.equal(t, after[name]), name


def test_print_model_gives_the_spec_of_the_weights(hf_models: dict) -> None:
    import yaml

    done = _cli("--from", f"hf:{hf_models['qwen3']}", "--print-model")
    assert done.returncode == 0, done.stderr
    model = yaml.safe_load(done.stdout)["model"]
    assert "numLayers" in model and "num_layers" not in model  # the CRD's names, ready for spec.model
    spec = ModelSpec.from_dict({**model, "paramsDtype": "fp32"})
    assert spec == _spec(hf_models["qwen3"]).__class__(**{**_spec(hf_models["qwen3"]).to_dict(), "name": spec.name})


@pytest.mark.parametrize("problem", ["architecture", "missing-shard", "shape", "tp-heads", "not-empty"])
def test_bad_inputs_are_one_line_and_exit_2(hf_models: dict, tmp_path: Path, problem: str) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(hf_models["llama"], src)
    config = json.loads((src / "config.json").read_text())
    target, extra = tmp_path / "out", []
    if problem == "architecture":
        config["architectures"] = ["GPT2LMHeadModel"]
        expected = "architectures"
    elif problem == "missing-shard":
        names = list(_tensors(src))
        (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
        weight_map = {name: "model-00001-of-00002.safetensors" for name in names}
        weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"  # a shard never downloaded
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        expected = "model-00002-of-00002.safetensors"
    elif problem == "shape":
        config["intermediate_size"] = 96
        expected = "has shape"
    elif problem == "tp-heads":
        extra = ["--parallel", "tp=4"]
        expected = "tp"
    else:
        target.mkdir()
        (target / "x").write_text("")
        expected = "not empty"
    (src / "config.json").write_text(json.dumps(config))
    done = _cli("--from", f"hf:{src}", "--to", str(target), *extra)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("liveshard convert: error:")]
    assert len(lines) == 1 and expected in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


# ---- jobs that start from Hugging Face or megatron weights (run-local --job) -------------------------
def _run_job(tmp_path: Path, name: str, spec: dict, parallel: str, events: str = "", mode: str | None = None) -> dict:
    import yaml

    job = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob", "metadata": {"name": name},
           "spec": {"image": "local", "workers": {"max": 2, "gpusPerWorker": 1}, **spec}}
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(job))
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "liveshard.runtime.cli", "run-local", "--job", str(tmp_path / f"{name}.yaml"),
           "--procs", "2", "--parallel", parallel, "--quiet", "--workdir", str(tmp_path / name), "--result", str(out),
           "--events", events]
    if mode:
        cmd += ["--mode", mode]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def _training(**kw: Any) -> dict:
    return {"data": {"mock": True}, "globalBatch": 4, "seqLength": 16, "precision": "fp32",
            "optimizer": {"lr": 1e-3}, "schedule": {"warmupIters": 1, "decayStyle": "linear"}, **kw}


LLAMA_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                "ffn_hidden_size", "vocab_size", "max_sequence_length", "gated_linear_unit", "normalization",
                "add_bias_linear", "position_embedding_type", "rotary_base", "rope_scaling", "rope_scaling_factor",
                "layernorm_epsilon", "share_embeddings_and_output_weights", "make_vocab_size_divisible_by")


@pytest.fixture(scope="module")
def llama_runs(hf_models: dict, tmp_path_factory) -> dict[str, Any]:
    """The tiny Llama converted once to a megatron checkpoint, then three 4-step jobs: from the
    Hugging Face weights at tp=2 switching live to pp=2 at step 2, the same switch through a
    checkpoint, and from the converted checkpoint at pp=2 throughout."""
    import dataclasses

    tmp = tmp_path_factory.mktemp("llama-jobs")
    src = hf_models["llama"]
    converted = tmp / "llama-megatron"
    done = _cli("--from", f"hf:{src}", "--to", str(converted), "--parallel", "dp=1")
    assert done.returncode == 0, done.stderr[-2000:]
    model = {k: v for k, v in dataclasses.asdict(_spec(src)).items() if k in LLAMA_FIELDS}
    hf_weights = {"format": "huggingface", "path": str(src)}
    runs: dict[str, Any] = {"tmp": tmp, "model": model, "converted": converted}
    for name, weights, parallel, events, mode in (
            ("live", hf_weights, "tp=2,pp=1,dp=1", "2:parallel=tp=1,pp=2,dp=1,layers=2+1", "live"),
            ("checkpoint", hf_weights, "tp=2,pp=1,dp=1", "2:parallel=tp=1,pp=2,dp=1,layers=2+1", "checkpoint"),
            ("megatron", {"format": "megatron", "path": str(converted)}, "tp=1,pp=2,dp=1,layers=2+1", "", "live")):
        runs[name] = _run_job(tmp, name, {"model": model, "training": _training(trainIters=4, initialWeights=weights)},
                              parallel, events=events, mode=mode)
        runs[name]["log"] = "".join(f.read_text() for f in sorted((tmp / name).glob("*w0.log")))
    return runs


@pytest.mark.long
def test_a_job_starts_from_initial_weights_in_either_format_at_any_layout(llama_runs: dict, hf_models: dict) -> None:
    """``spec.training.initialWeights``: the first world loads them into its own layout. Hugging
    Face weights at tp=2 and the same weights converted to a megatron checkpoint, at pp=2, train
    to the same losses (a live switch on the way changes only the summation order)."""
    hf, meg = llama_runs["live"], llama_runs["megatron"]
    assert [s["step"] for s in hf["steps"]] == [1, 2, 3, 4]
    assert "loaded initial weights (huggingface)" in hf["log"]
    assert "loaded initial weights (megatron)" in meg["log"]
    # step 1: the same weights in two layouts; later steps also carry Adam's amplification of
    # summation-order differences (and a live switch)
    assert hf["steps"][0]["loss"] == pytest.approx(meg["steps"][0]["loss"], rel=1e-6)
    for a, b in zip(hf["steps"], meg["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    # the conversion the megatron job started from is itself bit-exact: back to Hugging Face
    out = llama_runs["tmp"] / "converted-hf"
    done = _cli("--from", str(llama_runs["converted"]), "--to", f"hf:{out}")
    assert done.returncode == 0, done.stderr[-2000:]
    _assert_same_tensors(hf_models["llama"], out)


@pytest.mark.long
def test_export_after_a_live_reconfiguration_equals_export_of_the_checkpoint_path(llama_runs: dict) -> None:
    """The same job through the same layout change, live and through a checkpoint: the final
    weights exported as Hugging Face safetensors are bit for bit the same."""
    outs = []
    for mode in ("live", "checkpoint"):
        run = llama_runs[mode]
        assert [e["outcome"] for e in run["events"]] == ["committed"]
        out = llama_runs["tmp"] / f"{mode}-hf"
        done = _cli("--from", run["final_checkpoint"], "--to", f"hf:{out}")
        assert done.returncode == 0, done.stderr[-2000:]
        outs.append(out)
    _assert_same_tensors(*outs)


@pytest.mark.long
def test_resume_continues_a_megatron_lm_save_with_its_optimizer_state(llama_runs: dict) -> None:
    """``spec.training.resume`` on a Megatron-LM save root (``latest_checkpointed_iteration.txt``,
    ``iter_NNNNNNN/``, no liveshard.json, common state never read): weights, Adam state, step and
    LR schedule continue as a full liveshard restore of the same checkpoint does."""
    import shutil

    tmp, final = llama_runs["tmp"], Path(llama_runs["live"]["final_checkpoint"])
    root = tmp / "megatron-lm"
    shutil.copytree(final, root / "iter_0000004")
    (root / "iter_0000004" / "liveshard.json").unlink()
    (root / "iter_0000004" / "common.pt").write_bytes(b"not a pickle: never read")
    (root / "latest_checkpointed_iteration.txt").write_text("4\n")
    model = llama_runs["model"]
    runs = {name: _run_job(tmp, name, {"model": model, "training": _training(trainIters=6, resume={"path": path})},
                           "tp=2,pp=1,dp=1")
            for name, path in (("theirs", str(root)), ("ours", str(final)))}
    theirs, ours = runs["theirs"], runs["ours"]
    assert [s["step"] for s in theirs["steps"]] == [5, 6]
    assert [s["samples"] for s in theirs["steps"]] == [s["samples"] for s in ours["steps"]]
    for a, b in zip(theirs["steps"], ours["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["lr"] == pytest.approx(b["lr"], rel=1e-9)


def test_initial_weights_of_another_model_are_one_line_before_any_process_starts(hf_models: dict, tmp_path: Path) -> None:
    import yaml

    job = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob", "metadata": {"name": "wrong"},
           "spec": {"model": {"preset": "tiny-llama"}, "image": "local", "workers": {"max": 1},
                    "training": _training(trainIters=2, initialWeights={"path": str(hf_models["qwen3"])})}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    done = subprocess.run([sys.executable, "-m", "liveshard.runtime.cli", "run-local", "--job", str(tmp_path / "job.yaml"),
                           "--workdir", str(tmp_path / "w"), "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "liveshard run-local: error: spec.training.initialWeights: model." in done.stderr
