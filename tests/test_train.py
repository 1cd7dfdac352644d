"""train.py end to end on a tiny random model saved to disk: the loop runs, learns, resumes.

The model is random, so it almost never answers correctly; a scripted judge supplies rewards
that differ within each group, which is all GRPO needs to produce a gradient.
"""
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import agentrl
import bench.learn
import engine
import evaluate
import grpo
import judge
import judge_backends
import report
import train
from files import read_json, read_jsonl

ROOT = Path(__file__).resolve().parents[1]


class ScriptedJudge:
    """Scores trajectory k of a group as k / n (times `scale`, for a judge on 0-10): always a
    spread, so every group is trainable."""
    cache_id = "scripted"

    def __init__(self, scale=1):
        self.calls, self.scale = 0, scale

    def complete(self, messages):
        self.calls += 1
        ids = [int(i) for i in re.search(r"Trajectory ids: ([\d, ]+)", messages[1]["content"]).group(1).split(",")]
        scores = [{"trajectory_id": i, "explanation": "scripted", "score": self.scale * i / len(ids)} for i in ids]
        return "Here you go:\n```json\n" + json.dumps({"scores": scores}) + "\n```"


def tiny_args(model_dir, out, *extra):
    return ["--model", model_dir, "--out", str(out), "--groups-per-step", "2", "--group-size", "3",
            "--max-turns", "2", "--max-new-tokens", "12", "--max-context", "1024", "--eval-size", "2",
            "--micro-batch-size", "2", "--lr", "1e-2", "--seed", "3", "--sft-steps", "0", "--eval-processes", "1", *extra]


def adapter_tensors(folder):
    return load_file(os.path.join(folder, "adapter_model.safetensors"))


@pytest.fixture
def scripted_judge(monkeypatch):
    judge = ScriptedJudge()
    monkeypatch.setattr(train, "make_judge", lambda args, model, tokenizer, device: judge)
    return judge


def test_two_steps_change_the_lora_weights(tiny_model_dir, tmp_path, scripted_judge):
    """The whole loop (rollouts, judge, advantages, update, log, checkpoint) must move the adapter."""
    out = tmp_path / "run"
    train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--eval-split", "test,test_schema"))
    assert scripted_judge.calls == 4, "each of the 2 groups of 2 steps is judged once"
    records = read_jsonl(out / "metrics.jsonl")
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["trainable_groups"] == 2 and not r["skipped"] for r in steps), steps
    evals = [r for r in records if "eval_accuracy" in r]
    assert len(evals) == 2, "eval before and after"
    for r in evals:   # both held-out splits in each evaluation record, the first under eval_*
        assert r["eval_split"] == "test" and r["eval_tasks"] == r["test_schema_tasks"] == 2
        assert {"eval_failed_submit_rate", "eval_describe_rate", "eval_turns_to_submit", "test_schema_accuracy",
                "test_schema_failed_submit_rate", "test_schema_describe_rate"} <= set(r)
    assert all({"submit_rate", "failed_submit_rate", "describe_rate", "turns_to_submit"} <= set(r) for r in steps)
    for r in steps:   # every rollout was trained on, so the two entropy estimates read the same tokens
        assert r["rollout_entropy"] > 0 and r["rollout_entropy"] == pytest.approx(r["entropy"])
    lora_b = {k: v for k, v in adapter_tensors(out / "final").items() if "lora_B" in k}
    assert lora_b and any(v.abs().max() > 0 for v in lora_b.values()), "B starts at zero and must have moved"
    lines = open(out / "trajectories" / "step_0002.jsonl").read().splitlines()
    assert len(lines) == 6 and json.loads(lines[0])["judge_explanation"] == "scripted"
    assert (out / "progress.png").stat().st_size > 0


def test_rows_cut_on_non_finite_logits_stay_out_of_the_update(tiny_model_dir, tmp_path, scripted_judge, monkeypatch):
    """A row the rollout ended on non-finite logits (fp16 overflow) is left out of its group's
    advantages and of the update, and counted; a group left with one row is not trained on."""
    real_rollout, batches = train.engine.rollout_groups, []

    def rollout_with_overflows(model, tokenizer, tasks, n, *args, **kw):
        groups = real_rollout(model, tokenizer, tasks, n, *args, **kw)
        if n > 1:                                    # training groups, not the greedy evaluation
            for group, cut in zip(groups, (1, 2)):   # group 0 keeps 2 rows, group 1 keeps 1
                for t in group.trajectories[:cut]:
                    t.stop_reason = "non_finite_logits"
        return groups

    def recording_step(model, optimizer, batch, *args, **kw):
        batches.append([t.stop_reason for g, advantages in zip(batch.groups, batch.advantages)
                        for t, a in zip(g.trajectories, advantages) if a])
        return real_step(model, optimizer, batch, *args, **kw)

    real_step = train.grpo.grpo_step
    monkeypatch.setattr(train.engine, "rollout_groups", rollout_with_overflows)
    monkeypatch.setattr(train.grpo, "grpo_step", recording_step)
    out = tmp_path / "run"
    train.main(tiny_args(tiny_model_dir, out, "--steps", "1"))
    step = next(json.loads(line) for line in open(out / "metrics.jsonl") if "reward_mean" in line)
    assert step["non_finite_trajectories"] == 3 and step["trainable_groups"] == 1 and not step["skipped"]
    assert len(batches) == 1 and len(batches[0]) == 2 and "non_finite_logits" not in batches[0]


def test_branching_grows_every_candidate_before_the_mixed_groups_are_chosen(tiny_model_dir, tmp_path,
                                                                           scripted_judge, monkeypatch):
    """--branching: each candidate is rolled out half whole, then branched up to --group-size, and
    only then are the groups to train on chosen, on all their rows, as without branching."""
    real_branch, real_mixed, seen = train.engine.branch_groups, train.mixed_first, {}

    def branch(model, tokenizer, groups, n, *args, **kw):
        seen["branched"] = [(len(g.trajectories), n) for g in groups]
        return real_branch(model, tokenizer, groups, n, *args, **kw)

    def mixed(groups, k):
        seen["chosen from"] = [len(g.trajectories) for g in groups]
        return real_mixed(groups, k)

    monkeypatch.setattr(train.engine, "branch_groups", branch)
    monkeypatch.setattr(train, "mixed_first", mixed)
    train.main(tiny_args(tiny_model_dir, tmp_path / "run", "--steps", "1", "--group-size", "4",
                         "--branching", "uniform"))
    candidates = train.CANDIDATES * 2                  # a step's candidates: CANDIDATES a group to train on
    assert seen == {"branched": [(2, 4)] * candidates, "chosen from": [4] * candidates}


def test_kill_and_resume_equals_uninterrupted(tiny_model_dir, tmp_path, scripted_judge):
    """A run stopped after step 1 and resumed must end with exactly the adapter of an unbroken run."""
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    train.main(tiny_args(tiny_model_dir, straight, "--steps", "2"))
    train.main(tiny_args(tiny_model_dir, broken, "--steps", "1"))
    # the kill: the run died during step 2, after logging it but before its checkpoint
    with open(broken / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "reward_mean": 9.0}) + "\n")
    train.main(tiny_args(tiny_model_dir, broken, "--steps", "2", "--resume"))
    a, b = adapter_tensors(straight / "final"), adapter_tensors(broken / "final")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    steps = [json.loads(line)["step"] for line in open(broken / "metrics.jsonl") if "reward_mean" in line]
    assert steps == [1, 2], "the half-done step 2 record is dropped, then redone once"


def test_resume_without_checkpoint_is_a_clear_error(tiny_model_dir, tmp_path):
    """--resume on an empty folder must say what is missing, not crash deep inside."""
    with pytest.raises(SystemExit, match="no checkpoint"):
        train.main(tiny_args(tiny_model_dir, tmp_path / "empty", "--resume", "--judge", "none"))


@pytest.mark.parametrize("argv, message", [
    (["--group-size", "1"], "group-size"),
    (["--steps", "-1"], "steps"),
    (["--temperature", "0"], "temperature"),
    (["--eval-processes", "-1"], "eval-processes"),
    (["--data", "/nonexistent/spider"], "no such folder"),
    (["--adapter", "/nonexistent/adapter"], "adapter_config.json"),
    (["--sft-steps", "4", "--max-turns", "2"], "max-turns"),
    (["--sft-steps", "4", "--max-turns", "3"], "max-turns"),          # look demonstrations take 4 turns
    (["--eval-split", " , "], "eval-split"),
    (["--eval-split", "test,val", "--train-split", "train_wide"], "needs --train-split train"),
])
def test_bad_arguments_fail_fast(argv, message, capsys):
    """Bad flags stop before any model is loaded, with a message naming the flag."""
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert message in capsys.readouterr().err


def test_help_lists_at_most_40_short_flags(capsys):
    """--help is the config's table of contents: at most 40 flags, each help line under 100
    characters, and every flag one field of train.Config."""
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = capsys.readouterr().out
    flags = {flag for flag in re.findall(r"^  (--[a-z-]+)", text, re.M) if flag != "--help"}
    assert len(flags) <= 40 and len(flags) == len(fields(train.Config)), sorted(flags)
    assert [f.name for f in fields(train.Config) if len(f.metadata["help"]) >= 100] == []
    assert all(f"--{f.name.replace('_', '-')}" in flags for f in fields(train.Config))


def test_the_loss_choices_are_the_aggregations_grpo_has(capsys):
    """--loss offers exactly grpo.AGGREGATIONS (one list, in grpo.py): each parses, nothing else does."""
    assert [train.parse_args(["--loss", name]).loss for name in grpo.AGGREGATIONS] == list(grpo.AGGREGATIONS)
    with pytest.raises(SystemExit):
        train.parse_args(["--loss", "sum"])
    err = capsys.readouterr().err
    assert "invalid choice" in err and all(name in err.split("choose from")[1] for name in grpo.AGGREGATIONS)


def test_gpu_defaults_differ_only_where_declared(monkeypatch):
    """On a GPU the defaults change exactly in GPU_DEFAULTS, to its values; the rest stay."""
    cpu = train.parse_args([])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = train.parse_args([])
    changed = {f.name for f in fields(train.Config) if getattr(cpu, f.name) != getattr(gpu, f.name)}
    assert changed == set(train.GPU_DEFAULTS) and all(getattr(gpu, k) == v for k, v in train.GPU_DEFAULTS.items())


def test_on_a_gpu_the_defaults_are_the_3b_agent_with_its_warm_start(monkeypatch):
    """A CUDA device (faked) without flags: the policy is Qwen2.5-3B-Instruct, the warm start
    still runs (its demonstrations teach the tool-call format), and both held-out splits are
    evaluated; `--model embedded` asks for the embedded model instead."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = train.parse_args([])
    assert config.model == "Qwen/Qwen2.5-3B-Instruct" and config.sft_steps == 48 and config.temperature == 1.0
    assert config.eval_splits == ["test", "test_schema"] and config.judge == "auto"
    assert train.parse_args(["--model", "embedded"]).model == "embedded"


@pytest.mark.parametrize("flag, device, environ, kind", [
    ("auto", "cuda", {}, "local"),
    ("auto", "cpu", {}, "none"),
    ("auto", "cuda", {"OPENAI_BASE_URL": "http://127.0.0.1:8000/v1"}, "http"),
    ("auto", "cpu", {"OPENAI_API_KEY": "sk-x"}, "http"),
    ("none", "cuda", {"OPENAI_API_KEY": "sk-x"}, "none"),
    ("local", "cpu", {"OPENAI_BASE_URL": "http://x/v1"}, "local"),
])
def test_the_judge_auto_picks_a_judge_server_then_the_gpu_model_then_none(flag, device, environ, kind):
    """--judge auto uses a judge server where the environment names one (RULER's setup), else the
    policy's base model on a GPU, else none; any other --judge is taken as given, and the reason
    is said."""
    chosen, why = judge_backends.judge_kind(train.parse_args(["--judge", flag]), device, environ)
    assert chosen == kind and why


def test_make_judge_says_which_judge_and_why(monkeypatch, capsys):
    """The start of a run names the judge and why it was chosen; --judge http without a model name
    asks for HTTP_JUDGE at OPENAI_BASE_URL (here a stub that answers the reachability check)."""
    monkeypatch.delenv("AGENTRL_JUDGE_MODEL", raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setattr(judge_backends.HTTPBackend, "check", lambda self: None)
    backend = train.make_judge(train.parse_args([]), None, None, torch.device("cpu"))
    out = capsys.readouterr().out
    assert backend.model == train.HTTP_JUDGE and backend.base_url == "http://127.0.0.1:9/v1"
    assert f"judge: {train.HTTP_JUDGE} at http://127.0.0.1:9/v1 (--judge auto, and OPENAI_BASE_URL" in out
    monkeypatch.delenv("OPENAI_BASE_URL")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert train.make_judge(train.parse_args([]), None, None, torch.device("cpu")) is None
    assert "judge: none, the reward is the correctness bonus alone (--judge auto on a CPU" in capsys.readouterr().out


def test_a_model_out_of_reach_is_one_line_naming_the_way_out(tmp_path):
    """Offline, a hub model that is not in the cache stops the run with one line that names
    --model PATH and the embedded model, no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "train.py", "--model", "Qwen/Qwen2.5-3B-Instruct", "--out",
                           str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot load the model 'Qwen/Qwen2.5-3B-Instruct'")
    assert "--model PATH" in last and "--model embedded" in last and "SmolLM2-135M-Instruct" in last


def test_config_round_trips_through_config_json(tiny_model_dir, tmp_path, monkeypatch):
    """The config.json a run writes reads back as the very Config it ran with (the held-out splits
    named, as the run used them)."""
    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop
    monkeypatch.setattr(train.checkpoint, "save", stop)    # config.json is written by then
    argv = tiny_args(tiny_model_dir, tmp_path / "run", "--judge", "none", "--kl-coef", "0.1")
    with pytest.raises(Stop):
        train.main(argv)
    config = train.Config(**read_json(tmp_path / "run" / "config.json"))
    assert config == train.parse_args(argv) and config.eval_split == "test" and config.kl_coef == 0.1


def test_unreachable_judge_endpoint(tiny_model_dir, tmp_path):
    """An http judge nobody answers is a clear error at start."""
    base = tiny_args(tiny_model_dir, tmp_path / "r", "--judge", "http://127.0.0.1:9/v1",
                     "--judge-model", "m", "--steps", "1")
    args = train.parse_args(base)
    with pytest.raises(SystemExit, match="unreachable"):
        train.make_judge(args, None, None, torch.device("cpu"))


def test_the_judge_flags_reach_the_backends(tiny_model_dir, tmp_path, tiny_llama, smol_tokenizer, monkeypatch, capsys):
    """--judge-max-tokens reaches the http backend, with its timeout, and the URL is --judge itself;
    the local judge (which reads probabilities, no token budget) judges with the LoRA switched off."""
    import lora
    cpu = torch.device("cpu")
    monkeypatch.setattr(judge_backends.HTTPBackend, "check", lambda self: None)    # as if it answered
    args = train.parse_args(tiny_args(tiny_model_dir, tmp_path / "r", "--judge", "http://127.0.0.1:9/v1", "--judge-model",
                                      "m", "--judge-max-tokens", "4000"))
    http = train.make_judge(args, None, None, cpu)
    assert (http.base_url, http.max_tokens, http.timeout_s) == ("http://127.0.0.1:9/v1", 4000, 460)
    args = train.parse_args(tiny_args(tiny_model_dir, tmp_path / "r", "--judge", "local"))
    lora.apply_lora(tiny_llama, r=2, alpha=4)
    local = train.make_judge(args, tiny_llama, smol_tokenizer, cpu)
    layer = next(m for m in tiny_llama.modules() if isinstance(m, lora.LoRALinear))
    with local.adapter_off():
        assert not layer.enabled
    assert layer.enabled
    with pytest.raises(SystemExit):
        train.parse_args(tiny_args(tiny_model_dir, tmp_path / "r", "--judge", "htp://x"))
    assert "--judge 'htp://x'" in capsys.readouterr().err


def test_a_judge_on_another_scale_shows_in_the_log_and_metrics(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A judge answering on 0-10 keeps its ranking (every group still trainable) and shows at
    once: each group corrected once, then rescaled, in the step's line and in metrics.jsonl."""
    judge = ScriptedJudge(scale=10)
    monkeypatch.setattr(train, "make_judge", lambda args, model, tokenizer, device: judge)
    out = tmp_path / "run"
    train.main(tiny_args(tiny_model_dir, out, "--steps", "1"))
    (record,) = [r for r in read_jsonl(out / "metrics.jsonl") if "reward_mean" in r]
    assert record["judge_rescaled_groups"] == 2 and record["judge_corrections"] == 2 and judge.calls == 4
    assert record["judge_failed_groups"] == 0 and record["trainable_groups"] == 2
    assert "judge: 0 groups failed, 2 rescaled, 2 corrections" in capsys.readouterr().out
    lines = read_jsonl(out / "trajectories" / "step_0001.jsonl")
    assert all(line["judge_rescaled"] == "0-10" for line in lines)
    assert sorted(line["judge_score"] for line in lines[:3]) == pytest.approx([1 / 3, 2 / 3, 1])


def rloo(group, rewards):
    """RLOO's estimator (Ahmadian et al. 2024, arXiv:2402.14740), as a fork would write it: each
    trajectory's baseline is the mean reward of the others in its group, on every token."""
    kept = [r for r in rewards if r is not None]
    return [None if r is None else [r - (sum(kept) - r) / (len(kept) - 1)] * len(t.token_ids)
            for t, r in zip(group.trajectories, rewards)]


def test_an_advantage_estimator_plugs_in_where_a_fork_would_put_it(tiny_model_dir, tmp_path, scripted_judge):
    """train.main(argv, estimator=f): the step trains on f's advantages, one float a token; RLOO's,
    written in this file, gives r_i - mean of the others = n / (n - 1) (r_i - mean), not GRPO's
    (r_i - mean) / std. The update runs and moves the adapter, and trajectories/ logs RLOO's values."""
    out = tmp_path / "run"
    train.main(tiny_args(tiny_model_dir, out, "--steps", "1"), estimator=rloo)
    (step,) = [r for r in read_jsonl(out / "metrics.jsonl") if "reward_mean" in r]
    assert not step["skipped"] and step["trainable_groups"] == 2 and step["forwarded_sequences"] > 0
    logged = [json.loads(line) for line in open(out / "trajectories" / "step_0001.jsonl")]
    for g in (0, 1):
        rewards = [t["reward"] for t in logged if t["group"] == g]
        mean, n = sum(rewards) / len(rewards), len(rewards)
        for t, r in zip([t for t in logged if t["group"] == g], rewards):
            assert t["advantage"] and t["advantage"] == pytest.approx([n / (n - 1) * (r - mean)] * len(t["advantage"]))
        best = max(logged, key=lambda t: (t["group"] == g, t["reward"]))
        assert best["advantage"][0] != pytest.approx((best["reward"] - mean) / statistics.stdev(rewards))  # not GRPO's
    lora_b = [v for k, v in adapter_tensors(out / "final").items() if "lora_B" in k]
    assert any(v.abs().max() > 0 for v in lora_b), "B starts at zero and must have moved"


def test_the_reward_function_is_a_parameter(tiny_model_dir, tmp_path):
    """train.main(argv, score=f): the step's rewards are f's (how a benchmark scripts them), given the
    groups, the judge backend, the rubric, the bonus and the judge cache."""
    import judge
    seen = []

    def spread(groups, judge_backend, rubric, bonus):
        seen.append((len(groups), judge_backend, bonus))
        unscored = judge.JudgeResult(scores=None, explanations=[], scored=False, attempts=0, error="scripted")
        return [[k / len(g.trajectories) for k in range(len(g.trajectories))] for g in groups], [unscored] * len(groups), 0
    out = tmp_path / "run"
    train.main(tiny_args(tiny_model_dir, out, "--steps", "1", "--judge", "none", "--bonus", "2"), score=spread)
    (record,) = [r for r in read_jsonl(out / "metrics.jsonl") if "reward_mean" in r]
    assert seen == [(2, None, 2.0)] and record["trainable_groups"] == 2 and record["reward_mean"] == pytest.approx(1 / 3)


def test_bonus_is_added_to_scores_already_in_0_1():
    """The correctness bonus keeps its weight after a rescale: a 0-10 judge's 10/3, 20/3, 10 are
    read as 1/3, 2/3, 1 before the bonus, so the one correct trajectory, ranked last by the
    judge, still gets the highest reward (clamping made it 2, 1, 1; unscaled, 4.3, 6.7, 10)."""
    conversations = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{k}"}] for k in range(3)]
    group = SimpleNamespace(trajectories=[SimpleNamespace(correct=k == 0) for k in range(3)],
                            tree=judge.conversation_tree(conversations))
    rewards, results, failed = train.score_groups([group], ScriptedJudge(scale=10), "rubric", 1.0)
    assert rewards == [pytest.approx([1 / 3 + 1, 2 / 3, 1])] and results[0].rescaled == "0-10" and failed == 0
    assert report.judge_counters(results) == {"judge_rescaled_groups": 1, "judge_corrections": 1}


def test_task_sampling_prefers_mixed_tiers():
    """With no task seen yet, tiers near 50% success are sampled most: they give mixed groups."""
    import random
    tasks = {tier: [SimpleNamespace(id=tier[0])] for tier in ("easy", "medium", "hard")}
    stats = {"tiers": {"easy": 1.0, "medium": 0.5, "hard": 0.0}, "tasks": {}}
    picks = [t.id for t in train.sample_tasks(tasks, stats, 2000, random.Random(0))]
    assert picks.count("m") > 3 * picks.count("e") and picks.count("m") > 3 * picks.count("h")


def test_task_sampling_prefers_frontier_tasks_and_still_explores():
    """Of 100 tasks, the two whose last group was mixed are drawn far more often than the rest, never
    twice in one step; the solved and the never-solved ones are still drawn now and then; with
    frontier_share=0 the frontier gets no preference."""
    import random
    tasks = {"medium": [SimpleNamespace(id=f"t{i}") for i in range(100)]}
    stats = {"tiers": {}, "tasks": {"t0": 0.5, "t1": 0.25, "t2": 1.0, "t3": 0.0}}
    steps = [[t.id for t in train.sample_tasks(tasks, stats, 4, random.Random(seed))] for seed in range(500)]
    picks = [tid for step in steps for tid in step]
    assert picks.count("t0") > 400 and picks.count("t1") > 300          # in most steps
    assert all(step.count("t0") <= 1 and step.count("t1") <= 1 for step in steps)
    others = [tid for tid in picks if tid not in ("t0", "t1")]
    assert len(set(others)) > 90 and 0 < picks.count("t2") < 30            # everything else, uniformly
    flat = [t.id for seed in range(500) for t in train.sample_tasks(tasks, stats, 4, random.Random(seed), frontier_share=0)]
    assert flat.count("t0") < 60


def test_task_stats_record_the_last_pass_rate_per_task():
    group = SimpleNamespace(task=SimpleNamespace(id="q", difficulty="easy"),
                            trajectories=[SimpleNamespace(correct=c) for c in (True, False, False, True)])
    stats = {"tiers": {}, "tasks": {"q": 1.0}}
    train.update_task_stats(stats, [(group.task, train.pass_rate(group))])
    assert stats["tasks"] == {"q": 0.5} and stats["tiers"]["easy"] == pytest.approx(0.7 * 0.5 + 0.3 * 0.5)


def scripted_group(task_id, corrects):
    return SimpleNamespace(task=SimpleNamespace(id=task_id, difficulty="easy"),
                           trajectories=[SimpleNamespace(correct=c) for c in corrects])


def test_mixed_first_keeps_the_groups_with_signal_in_the_order_drawn():
    """Pass rates 0, 1, 1/2, 1/4, 0: the two mixed groups come first, in draw order, then the others."""
    groups = [scripted_group(f"q{i}", c) for i, c in enumerate([[0, 0], [1, 1], [1, 0], [0, 0, 0, 1], [0, 0]])]
    assert [g.task.id for g in train.mixed_first(groups, 2)] == ["q2", "q3"]
    assert [g.task.id for g in train.mixed_first(groups, 3)] == ["q2", "q3", "q0"]
    assert [g.task.id for g in train.mixed_first(groups[:2], 2)] == ["q0", "q1"]   # none mixed: as drawn


def test_selection_finds_mixed_groups_where_a_plain_draw_rarely_does():
    """A scripted policy over 100 tasks of one tier: 80 it never solves, 5 it always solves, 15 it
    solves 15% of the time (groups of 8, sampled). The trainer's steps 1) and 2), the pass rates fed
    back, keeping 2 groups a step, in 100 runs of 4 steps: with CANDIDATES tasks per group kept,
    many more steps train on a mixed group than when only the 2 kept are drawn; and a step keeps a
    mixed group whenever it rolled one out."""
    import random
    rates = {f"t{i}": 0.0 if i < 80 else 1.0 if i < 85 else 0.15 for i in range(100)}
    tasks = {"easy": [SimpleNamespace(id=tid, difficulty="easy") for tid in rates]}

    def steps_with_signal(per_group, runs=100, steps=4):
        found = 0
        for run in range(runs):
            rng, stats = random.Random(run), {"tiers": {}, "tasks": {}}
            for step in range(steps):
                draw = train.sample_tasks(tasks, stats, per_group * 2, random.Random(run * 1000 + step))
                rolled = [scripted_group(t.id, [rng.random() < rates[t.id] for _ in range(8)]) for t in draw]
                kept = train.mixed_first(rolled, 2)
                rolled_mixed = any(0 < train.pass_rate(g) < 1 for g in rolled)
                assert len(kept) == 2 and rolled_mixed == any(0 < train.pass_rate(g) < 1 for g in kept)
                found += rolled_mixed
                train.update_task_stats(stats, [(g.task, train.pass_rate(g)) for g in rolled])
        return found / (runs * steps)
    with_selection, plain = steps_with_signal(train.CANDIDATES), steps_with_signal(1)
    assert with_selection > plain + 0.15 and plain < 0.45, (with_selection, plain)


@pytest.mark.parametrize("extra", [[], ["--update", "rft"]])
def test_grpo_and_the_rft_control_run_and_log(tiny_model_dir, tmp_path, scripted_judge, monkeypatch, extra):
    """GRPO takes one optimizer step per batch; --update rft one supervised step on the correct
    rollouts (here every even rollout is made correct); each logs it."""
    real = engine.rollout_groups

    def some_correct(*args, **kwargs):
        groups = real(*args, **kwargs)
        for g in groups:
            for i, t in enumerate(g.trajectories):
                t.correct = i % 2 == 0
        return groups
    monkeypatch.setattr(engine, "rollout_groups", some_correct)
    out = tmp_path / "run"
    train.main(tiny_args(tiny_model_dir, out, "--steps", "1", *extra))
    step = next(json.loads(line) for line in open(out / "metrics.jsonl") if "reward_mean" in line)
    assert not step["skipped"] and step["mixed_group_rate"] == 1.0 and step["mixed_candidates"] == 4
    if "rft" in extra:
        assert step["sft_loss"] > 0 and step["tokens"] > 0 and "kl_old" not in step
    else:
        assert step["forwarded_sequences"] > 0 and "kl_old" in step and "clip_frac_high" in step


def test_warm_start_then_grpo(tiny_model_dir, tmp_path, scripted_judge, monkeypatch):
    """--sft-steps trains on gold demonstrations first, saves them as their own adapter, as the
    step-0 checkpoint and as start/ (so RL, and a resume, start from it), and evaluates where RL
    starts. RL draws its tasks from the ones demonstrated, and a resume knows them again. The KL
    term's reference is that start, not the base model: at the first step the policy is the
    reference (KL exactly 0); after it, and after a resume, it has moved away."""
    demonstrated, real = [], train.sft_batches
    monkeypatch.setattr(train, "sft_batches", lambda *a: demonstrated.append(real(*a)) or demonstrated[-1])
    out = tmp_path / "run"
    args = ["--sft-steps", "2", "--max-new-tokens", "130", "--max-turns", "4", "--kl-coef", "0.1"]
    train.main(tiny_args(tiny_model_dir, out, "--steps", "1", *args))
    records = read_jsonl(out / "metrics.jsonl")
    shown = {task.id for batch in demonstrated[0] for task in batch}
    assert 2 <= len(shown) <= 4 and {r["task_id"] for r in read_jsonl(out / "trajectories" / "step_0001.jsonl")} <= shown
    assert [r["sft_step"] for r in records if "sft_step" in r] == [1, 2]
    assert all(r["sft_loss"] > 0 and not r["skipped"] and r["sft_dropped"] == 0 for r in records if "sft_step" in r)
    assert [r.get("phase") for r in records if "eval_accuracy" in r] == ["sft", None]
    sft = adapter_tensors(out / "sft")
    assert any(v.abs().max() > 0 for k, v in sft.items() if "lora_B" in k), "SFT must move the adapter"
    assert (out / "checkpoints" / "step_0000" / "adapter_model.safetensors").exists()
    assert all(torch.equal(v, sft[k]) for k, v in adapter_tensors(out / "start").items())
    for label in ("sft", "step_0001"):     # every evaluation's episodes, one line per held-out task
        episodes = read_jsonl(out / "evals" / f"{label}_test.jsonl")
        assert len(episodes) == 2 and all(e["messages"] and e["task_id"] for e in episodes)
    train.main(tiny_args(tiny_model_dir, out, "--steps", "2", "--resume", *args))
    assert demonstrated[1] == demonstrated[0]
    assert {r["task_id"] for r in read_jsonl(out / "trajectories" / "step_0002.jsonl")} <= shown
    kl = [json.loads(line)["kl"] for line in open(out / "metrics.jsonl") if "reward_mean" in line]
    assert kl[0] == 0.0 and kl[1] > 0, kl


def test_a_run_that_evaluates_on_val_never_trains_on_it(tiny_model_dir, tmp_path, monkeypatch):
    """With val among the evaluation splits, the tasks RL draws from (with no warm start) are the
    train split less the validation slice; without it, the whole train split. (The warm start's
    come from the same tasks: sft_batches.)"""
    class Stop(Exception):
        pass
    trained_on = []

    def capture(tasks_by_tier, *rest):
        trained_on.append({task.id for tier in tasks_by_tier.values() for task in tier})
        raise Stop
    monkeypatch.setattr(train, "sample_tasks", capture)
    for split in ("test", "val"):
        with pytest.raises(Stop):
            train.main(tiny_args(tiny_model_dir, tmp_path / split, "--eval-split", split, "--judge", "none"))
    everything, without_val = trained_on
    val = {task.id for task in train.sql_env.load_tasks(split="val")}
    assert len(val) == train.sql_env.VAL_SIZE and val < everything and without_val == everything - val


def test_val_scores_are_refused_from_an_adapter_or_a_resume_that_trained_on_val(tmp_path, capsys):
    """An adapter whose run trained on the val tasks cannot be evaluated or trained on val; a run
    cannot be resumed with val added to or dropped from its evaluation splits (what it trained on
    would change part way)."""
    def run(name, eval_splits):
        os.makedirs(tmp_path / name / "final")
        (tmp_path / name / "config.json").write_text(json.dumps({"eval_split": ",".join(eval_splits)}))
        (tmp_path / name / "final" / "adapter_config.json").write_text("{}")
        return str(tmp_path / name)
    trained_on_val, held_out = run("all", ["test"]), run("held", ["val"])
    with pytest.raises(SystemExit):
        train.parse_args(["--adapter", os.path.join(trained_on_val, "final"), "--eval-split", "val"])
    assert "trained on the val tasks" in capsys.readouterr().err
    assert train.parse_args(["--adapter", os.path.join(held_out, "final"), "--eval-split", "val"]).adapter
    assert train.parse_args(["--adapter", os.path.join(trained_on_val, "final"), "--eval-split", "test"]).adapter
    for out, splits in ((held_out, "test"), (trained_on_val, "val")):
        with pytest.raises(SystemExit):
            train.parse_args(["--resume", "--out", out, "--eval-split", splits])
        assert "resume it with the same --eval-split" in capsys.readouterr().err
    assert train.parse_args(["--resume", "--out", held_out, "--eval-split", "val"]).resume


def test_warm_start_with_no_fitting_demonstration_is_a_clear_error(tiny_model_dir, tmp_path):
    """Demonstrations longer than --max-new-tokens cannot be imitated: say so instead of looping."""
    with pytest.raises(SystemExit, match="no gold demonstration fits"):
        train.main(tiny_args(tiny_model_dir, tmp_path / "r", "--sft-steps", "1", "--max-turns", "4", "--judge", "none"))


def test_only_the_newest_checkpoints_stay(tiny_model_dir, tmp_path):
    """A long run must not fill the disk: older step folders are pruned, `latest` stays valid."""
    out = tmp_path / "run"
    train.main(tiny_args(tiny_model_dir, out, "--steps", "3", "--judge", "none"))
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_0002", "step_0003"]
    assert (out / "checkpoints" / "latest").read_text() == "step_0003"
    train.main(tiny_args(tiny_model_dir, out, "--steps", "1", "--judge", "none"))  # a new run in the same folder
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_0000", "step_0001"]


def test_a_run_with_forked_evaluations_reports_its_time_and_memory(tiny_model_dir, tmp_path, capsys, forks):
    """--eval-processes 2: the run evaluates in forked processes (both evaluations, before and after);
    its summary gives each phase's minutes, read from the records, and the peak summed memory."""
    train.main(tiny_args(tiny_model_dir, tmp_path / "run", "--steps", "2", "--judge", "none", "--eval-processes", "2"))
    assert forks == [2] * 2             # at the start and at the end
    out = capsys.readouterr().out.splitlines()
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if "time_eval" in r] == [0, 2]
    minutes = {name: sum(r[key] for r in records if key in r and marker in r) / 60 for name, key, marker in
               [("evaluations", "time_eval", "time_eval"), ("RL", "time_step", "reward_mean")]}
    time_line = next(line for line in out if line.startswith("time:"))
    assert (f"warm start 0.0 (0 steps), evaluations {minutes['evaluations']:.1f} (2), "
            f"RL {minutes['RL']:.1f} (2 steps)") in time_line, time_line
    memory = next(line for line in out if line.startswith("memory:"))
    peak = float(memory.split()[1])
    if os.path.isdir("/proc"):
        assert "this process and the ones it forked together" in memory and 0.1 < peak < 8, memory


def test_eval_dtype_reaches_the_evaluations_only(tiny_model_dir, tmp_path, monkeypatch):
    """--eval-dtype bf16 (the CPU default): every held-out evaluation decodes greedily with bf16
    weights and KV cache (engine.Sampling); GRPO's rollouts sample the fp32 policy (on this CPU, bf16
    rollouts measured slower: BENCHMARKS.md). --eval-dtype fp32 keeps evaluations in fp32."""
    seen, rollout_groups = [], engine.rollout_groups

    def recording(model, tokenizer, tasks, n, sampling, *args, **kwargs):
        seen.append((sampling.greedy, sampling.weight_dtype, sampling.cache_dtype))
        return rollout_groups(model, tokenizer, tasks, n, sampling, *args, **kwargs)
    monkeypatch.setattr(engine, "rollout_groups", recording)
    train.main(tiny_args(tiny_model_dir, tmp_path / "run", "--steps", "1", "--judge", "none"))
    assert {(dtype, cache) for greedy, dtype, cache in seen if greedy} == {(torch.bfloat16, torch.bfloat16)}
    assert {(dtype, cache) for greedy, dtype, cache in seen if not greedy} == {(None, None)}
    seen.clear()
    train.main(tiny_args(tiny_model_dir, tmp_path / "run2", "--steps", "1", "--judge", "none", "--eval-dtype", "fp32"))
    assert {(dtype, cache) for greedy, dtype, cache in seen if greedy} == {(torch.float32, torch.float32)}


def test_eval_only_on_either_split(tiny_model_dir, tmp_path, capsys):
    """--eval-split names either held-out split (or both); the first one's metrics are the eval_*
    keys, and the printout has one line per split. Both splits draw the same question positions."""
    args = train.parse_args(tiny_args(tiny_model_dir, tmp_path / "r", "--eval-only", "--eval-split", "test_schema"))
    record = train.launch(args)
    assert record["eval_split"] == "test_schema" and record["eval_tasks"] == 2 and "test_accuracy" not in record
    both = train.launch(train.parse_args(tiny_args(tiny_model_dir, tmp_path / "r", "--eval-only", "--eval-split", "test,test_schema")))
    assert both["eval_split"] == "test" and both["test_schema_tasks"] == 2
    assert evaluate.split_metrics(both, "test_schema")["eval_accuracy"] == both["test_schema_accuracy"]
    out = capsys.readouterr().out
    assert "  test:        accuracy=" in out and "  test_schema: accuracy=" in out and "failed_submit_rate=" in out
    kept = read_json(tmp_path / "r" / "eval_only.json")               # the last evaluation's record, to pair
    assert kept["eval_outcomes"] == both["eval_outcomes"] and kept["test_schema_outcomes"] == both["test_schema_outcomes"]
    bench.learn.bench_pair(SimpleNamespace(paths=[str(tmp_path / "r")] * 2))     # the data it names has these tasks' templates
    assert capsys.readouterr().out.count("+0.0 points [+0.0, +0.0] by task, [+0.0, +0.0] by template") == 2
    episodes = read_jsonl(tmp_path / "r" / "evals" / "eval_only_test_schema.jsonl")
    assert "".join("1" if e["correct"] else "0" for e in episodes) == both["test_schema_outcomes"]


def test_the_step_line_shows_the_signal_the_reward_and_the_update():
    """One line a step: mixed groups of those rolled out, the kept groups' reward (mean and spread)
    beside their accuracy, every candidate's accuracy apart, the states several trajectories share
    and the share of later turns taken from them (what step credit would compare, whether it is on
    or not), the clipped share of tokens, whether the update ran (and why not), the judge's
    agreement where it has one."""
    record = {"step": 3, "mixed_candidates": 3, "candidate_groups": 4, "trainable_groups": 2, "reward_mean": 0.4375,
              "reward_std": 0.496, "kept_accuracy": 0.4375, "train_accuracy": 0.34375, "skipped": False,
              "clip_frac_low": 0.004,
              "clip_frac_high": 0.008, "judge_agreement": 0.75, "judge_agreement_groups": 2, "time_step": 61.2,
              "judge_failed_groups": 0, "judge_rescaled_groups": 0, "judge_corrections": 0,
              "shared_states": 3, "shared_state_size": 2.5, "shared_turn_share": 0.6}
    assert report.step_line(record, 4) == ("step 3/4 | mixed groups 3/4, 2 trained on | kept groups: reward 0.44 ± "
                                          "0.50, accuracy 0.44 | every candidate: accuracy 0.34 | shared states 3 (2.5 "
                                          "trajectories each, 60% of later turns) | clipped 1.2% of "
                                          "tokens | update applied | judge agreement 0.75 (2 groups) | 61 s")
    skipped = {**record, "skipped": True, "skip_reason": "no trainable group", "judge_agreement": None}
    assert "| update skipped (no trainable group) | 61 s" in report.step_line(skipped, 4)


def test_the_mixed_group_rate_counts_mixed_groups_not_trainable_ones():
    """mixed_group_rate: the kept groups with right and wrong rollouts, over the kept groups. A judge
    can make an all-right group trainable (its scores differ), which is not a mixed group."""
    def group(task_id, corrects):
        return agentrl.make_group(SimpleNamespace(id=task_id, difficulty="easy"), [agentrl.Trajectory(
            task_id, [], [1, 2], [0, 1], [0.0, -1.0], "SELECT 1", bool(c), "submitted", 1, 1, 0) for c in corrects])
    mixed, all_right = group("a", [1, 0, 1]), group("b", [1, 1, 1])
    unscored = judge.JudgeResult(scores=None, explanations=[], scored=False, attempts=0, error="none")
    step = train.Step(1, [(mixed.task, 2 / 3), (all_right.task, 1.0)], [mixed, all_right], [[1, 0, 1], [1, 0.5, 0]],
                      [unscored] * 2, 0, [[None] * 3] * 2, {"trainable_groups": 2, "no_signal_groups": 0,
                                                            "too_small_groups": 0, "non_finite_trajectories": 0},
                      {"skipped": False}, {"time_step": 1.0})
    record = report.step_record(step)
    assert record["trainable_groups"] == 2 and record["mixed_group_rate"] == 0.5


def test_judge_agreement_per_step_and_the_warning_when_it_is_a_coin():
    """A step's agreement: the mean over scored groups with both right and wrong rollouts (here 1.0
    and 0.0: 0.5 over 2 groups; the all-wrong and the unscored group do not count). The warning
    comes once enough groups say the judge ranks like a coin, not before, and not for a good judge."""
    def group(*correct):
        return SimpleNamespace(trajectories=[SimpleNamespace(correct=c) for c in correct])
    groups = [group(True, False), group(True, False), group(False, False), group(True, False)]
    results = [SimpleNamespace(scored=True, scores=[0.9, 0.1]), SimpleNamespace(scored=True, scores=[0.1, 0.9]),
               SimpleNamespace(scored=True, scores=[0.5, 0.2]), SimpleNamespace(scored=False, scores=None)]
    assert report.judge_agreement(groups, results) == {"judge_agreement": 0.5, "judge_agreement_groups": 2}
    coin = {"judge_agreement": 0.55, "judge_agreement_groups": 4}
    assert report.judge_noise_warning([coin]) is None                        # 4 groups: too few to say
    assert "55% of the time" in report.judge_noise_warning([coin, coin])
    assert report.judge_noise_warning([{**coin, "judge_agreement": 0.9}] * 3) is None
    assert report.judge_noise_warning([{"judge_agreement": None, "judge_agreement_groups": 0}] * 9) is None
