"""``liveshard plan`` for a newcomer (issue #26 item 6): the sequence length it plans for is stated
and never the model's maximum by default; a GPU count ruled out by the sequence length says so;
MoE models get expert parallelism where it pays; GPUs left standby come with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from liveshard.runtime.cli import main
from liveshard.runtime.commands.plan import DEFAULT_SEQ_LENGTH
from liveshard.runtime.contract.jobspec import read_spec
from liveshard.runtime.planner.cost_model import Hardware
from liveshard.runtime.planner.pods import Candidate, plan_for
from liveshard.runtime.planner.search import GPU, Constraints, plan_parallelism
from liveshard.runtime.presets import PRESETS

GiB = 2**30
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def fleet(n: int, per_node: int = 8, memory: int = 80 * GiB) -> list[GPU]:
    return [GPU(f"n{i // per_node}/{i % per_node}", f"n{i // per_node}", memory) for i in range(n)]


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def one_line_error(capsys, *argv: str) -> str:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def bubble(plan, global_batch: int, micro_batch: int = 1) -> float:
    cfg = plan.config
    m = global_batch // (cfg.dp * micro_batch)
    return (cfg.pp - 1) / (m + cfg.pp - 1)


# ---- the sequence length ------------------------------------------------------------------------

def test_default_seq_length_is_stated_not_the_models_maximum(capsys):
    spec = PRESETS["qwen3-235b-a22b"]
    assert spec.max_sequence_length > DEFAULT_SEQ_LENGTH == 4096
    out = plan_json(capsys, "--model", "qwen3-235b-a22b", "--gpus", "1024")
    assert out["seq_length"] == DEFAULT_SEQ_LENGTH and "default" in out["seq_length_source"]
    assert f"{DEFAULT_SEQ_LENGTH}-token sequences" in out["explanation"][0]
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16"]) == 0
    text = capsys.readouterr().out
    assert f"sequence length {DEFAULT_SEQ_LENGTH} tokens: the default, not the model's maximum 8192" in text


def test_help_states_the_default_seq_length(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert str(DEFAULT_SEQ_LENGTH) in " ".join(capsys.readouterr().out.split())


def test_a_model_shorter_than_the_default_plans_at_its_maximum(capsys):
    out = plan_json(capsys, "--model", "tiny-gpt", "--gpus", "4")
    assert out["seq_length"] == PRESETS["tiny-gpt"].max_sequence_length < DEFAULT_SEQ_LENGTH
    assert "maximum" in out["seq_length_source"]


def test_job_gives_seq_length_and_the_rest(capsys):
    out = plan_json(capsys, "--job", str(EXAMPLES / "tiny-cpu.yaml"))
    assert out["seq_length"] == 32 and "the job's seqLength" in out["seq_length_source"]
    assert out["model"] == "tiny-llama" and out["gpus_given"] == 4  # workers.max x gpusPerWorker
    out = plan_json(capsys, "--job", str(EXAMPLES / "tiny-cpu.yaml"), "--seq-length", "16")
    assert out["seq_length"] == 16 and out["seq_length_source"] == "--seq-length"


def test_job_without_seq_length_says_it_runs_at_the_models_maximum(capsys, tmp_path):
    job = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    del job["spec"]["training"]["seqLength"]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    out = plan_json(capsys, "--job", str(path))
    assert out["seq_length"] == PRESETS["tiny-llama"].max_sequence_length
    assert "sets no seqLength" in out["seq_length_source"]


def test_seq_length_that_rules_out_the_gpus_is_named_with_the_fix(capsys):
    err = one_line_error(capsys, "--model", "qwen3-235b-a22b", "--gpus", "512", "--seq-length", "40960")
    assert "--seq-length: at 40960 tokens per sequence" in err and "needs >= 560 GPUs" in err
    fix = err.split("(fix: --seq-length ")[1]
    fits = int(fix.split()[0])
    assert fits < 40960 and f"at {fits} it fits on 512" in err
    assert main(["plan", "--model", "qwen3-235b-a22b", "--gpus", "512", "--seq-length", str(fits)]) == 0


def test_memory_shortage_not_from_the_sequence_stays_a_gpus_error(capsys):
    err = one_line_error(capsys, "--model", "llama3-70b", "--gpus", "8")
    assert err.startswith("liveshard plan: error: --gpus: llama3-70b needs >= ") and "--seq-length" not in err


@pytest.mark.parametrize(("argv", "words"), [
    ([], "--model: is required without --job"),
    (["--model", "llama3-8b"], "--gpus: is required without --job"),
    (["--job", "/nonexistent/job.yaml"], "--job:"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq-length", "0"], "--seq-length: must be a positive integer"),
])
def test_bad_input_is_one_line(capsys, argv, words):
    assert words in one_line_error(capsys, *argv)


# ---- expert parallelism and the pipeline bubble ---------------------------------------------------

def test_expert_matmuls_with_few_tokens_or_narrow_slices_are_priced_slower():
    hw = Hardware()
    wide = hw.expert_gemm_slowdown(4096, 4096, 4096)
    assert wide < 0.1
    assert hw.expert_gemm_slowdown(64, 1536, 4096) > 1.0  # 64 tokens per expert: bound by the weights
    assert hw.expert_gemm_slowdown(512, 1536, 4096) < hw.expert_gemm_slowdown(64, 1536, 4096)
    assert hw.expert_gemm_slowdown(256, 384, 4096) > hw.expert_gemm_slowdown(256, 1536, 4096)  # expert TP 4


def test_the_explanation_names_the_expert_matmul_cost():
    plan = plan_parallelism(PRESETS["qwen3-235b-a22b"], fleet(512), Constraints(seq_length=4096))
    line = next(x for x in plan.explanation if x.startswith("experts: "))
    assert "tokens per expert" in line and "x their FLOP time" in line


@pytest.mark.parametrize("gpus", [512, 1024])
def test_qwen3_235b_unconstrained_uses_expert_parallelism(gpus):
    spec = PRESETS["qwen3-235b-a22b"]
    plan = plan_parallelism(spec, fleet(gpus), Constraints(seq_length=4096))
    assert plan.config.ep > 1 and (plan.config.etp or plan.config.tp) == 1
    assert any(line.startswith(f"EP={plan.config.ep}") for line in plan.explanation)


def test_qwen3_235b_on_1024_gpus_with_a_real_batch_has_a_small_bubble():
    spec = PRESETS["qwen3-235b-a22b"]
    c = Constraints(seq_length=4096, global_batch=2048)  # 8M tokens per step, as examples/qwen3-235b-moe.yaml
    plan = plan_parallelism(spec, fleet(1024), c)
    assert plan.config.ep > 1
    assert bubble(plan, c.global_batch) < 0.25


def test_a_large_bubble_is_explained_and_fewer_stages_are_priced(capsys):
    # 256 sequences over 1024 GPUs leave few micro-batches per DP rank: any pipeline idles a lot.
    out = plan_json(capsys, "--model", "qwen3-235b-a22b", "--gpus", "1024")
    line = next(x for x in out["explanation"] if x.startswith("pipeline: bubble"))
    assert "large: only" in line and "larger global batch" in line
    fewer = out["fewer_stages"]
    assert fewer["config"] is not None and fewer["bubble"] <= 0.25 and fewer["slower"] > 0


# ---- standby GPUs come with the reason --------------------------------------------------------------

def tiny_cpu_job(**parallelism):
    raw = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())["spec"]
    raw["parallelism"] = {**raw["parallelism"], **parallelism}
    return read_spec({**raw, "image": raw.get("image") or "local"})


def test_tiny_cpu_workers_on_one_node_all_train():
    """With the distributed optimizer (state sharded over DP), four workers on one node all
    train: the cost model finds nothing to gain from fewer."""
    job = tiny_cpu_job(distributedOptimizer=True, minDataParallel=1)
    assignment = plan_for(job, [Candidate(f"w{i}", "node-0") for i in range(4)])
    assert assignment.world_size == 4 and not assignment.standby and assignment.standby_reason == ""


def test_the_tiny_example_as_shipped_keeps_two_copies_of_the_state():
    """examples/tiny-cpu.yaml: a replicated optimizer and minDataParallel 2, so a node lost
    without notice loses nothing; workers left standing by say why in one line."""
    job = tiny_cpu_job()
    assert job.parallelism.min_dp == 2 and not job.parallelism.dist_opt
    for nodes in (1, 4):
        assignment = plan_for(job, [Candidate(f"w{i}", f"node-{i % nodes}") for i in range(4)])
        assert assignment.plan.config.dp >= 2, assignment
        assert assignment.world_size == 4 or assignment.standby_reason.count("\n") == 0 < len(assignment.standby_reason)


def test_tiny_cpu_workers_left_standby_say_why():
    job = tiny_cpu_job()
    assignment = plan_for(job, [Candidate(f"w{i}", f"node-{i}") for i in range(4)])
    if assignment.world_size == 4:
        return  # uses every worker asked for: nothing to explain
    reason = assignment.standby_reason
    assert reason.count("\n") == 0 and reason.startswith(f"{len(assignment.standby)} of 4 GPUs standby")
    # which alternative, and by how much, in the cost model's terms
    assert "cost model" in reason and "dp=4" in reason and "x as long per step" in reason and "DP" in reason
    assert reason == assignment.plan.explanation[1]  # second line: kept by callers that keep the first few


def test_standby_for_the_batch_says_the_batch(capsys):
    out = plan_json(capsys, "--model", "tiny-gpt", "--gpus", "4", "--global-batch", "3", "--tp", "1", "--pp", "1")
    assert out["world_size"] == 3 and len(out["standby"]) == 1
    assert "dp must divide the 3 micro-batches" in out["standby_reason"]


def test_standby_for_max_gpus_says_the_cap(capsys):
    out = plan_json(capsys, "--model", "llama3-8b", "--gpus", "16", "--max-gpus", "8")
    assert out["standby_reason"] == "8 of 16 GPUs standby: max_gpus caps the world at 8"


def test_human_output_prints_the_standby_reason(capsys):
    assert main(["plan", "--job", str(EXAMPLES / "tiny-cpu.yaml"), "--gpus-per-node", "1"]) == 0
    text = capsys.readouterr().out
    if "standby:" in text:
        assert "standby because: " in text and "0.000 s" not in text  # tiny steps are printed in ms or µs
        assert "µs" in text or " ms" in text
