"""bench/trl.py: one GRPO step, ours and TRL's GRPOTrainer, on a tiny random model and the generated
database. Skipped where TRL or peft is not installed (an optional extra of this bench alone)."""
import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")


def test_both_sides_sample_and_train_the_same_step(tiny_model_dir, splits, tmp_path, monkeypatch):
    """Each side samples its groups on the same tasks and trains on them: a benchmark whose side did
    nothing, or counted what it did inconsistently, would print a ratio of nothing. Scripted rewards
    (k / n for the k-th trajectory of a group): a random model solves no task."""
    from bench import trl as bench_trl
    monkeypatch.chdir(tmp_path)                    # runs/bench_trl/... under the test's folder
    config = bench_trl.bench_config(seed=0, group_size=4, max_turns=2, max_new_tokens=8, micro_batch_size=4)
    tasks = bench_trl.bench_tasks(config)
    assert len(tasks) == config.groups_per_step == 2
    results = {side: bench_trl.run_side(side, tiny_model_dir, config, scripted=True)
               for side in bench_trl.SIDES}
    for side, r in results.items():
        rollouts = len(tasks) * config.group_size
        assert r["trajectories"] == rollouts, side
        assert rollouts <= r["turns"] <= rollouts * config.max_turns, side
        assert 0 < r["sampled_tokens"] <= r["turns"] * config.max_new_tokens, side
        assert r["trained_trajectories"] == rollouts, side            # every group mixed: all trained
        assert 0 < r["trained_tokens"] <= r["loss_tokens"], side
        assert 0 < r["forwarded_tokens"] <= r["forwarded_positions"], side
        assert r["rollout_s"] > 0 and r["update_s"] > 0 and r["peak_gib"] > 0, side
        assert not r["skipped"], side
    ours, theirs = results["ours"], results["trl"]
    assert ours["trained_tokens"] == ours["sampled_tokens"]      # ours trains exactly what it sampled
    # TRL trains what it sampled and the <|im_end|> generate() wrote after each </tool_call>
    assert theirs["trained_tokens"] == theirs["sampled_tokens"] + theirs["closing_eos"]
    assert ours["prompt_tokens"] == theirs["prompt_tokens"]
    # TRL forwards every trajectory whole, its prompt included; ours a group's shared turns once
    prompts = sum(theirs["prompt_tokens"]) * config.group_size
    assert theirs["forwarded_tokens"] >= theirs["trained_tokens"] + prompts
