"""evaluate.py: greedy held-out evaluation, its record's layout, and forked evaluations
(--eval-processes) that give what one process gives."""
import json
import os

import pytest
import torch

import engine
import evaluate
import lora


def test_behaviour_counts_by_hand():
    """The behaviour counters of an evaluation or a step: of 4 trajectories, 3 submit (one of them a
    query that fails to run), 2 call describe_table; turns to submission average the 3 submitters.
    Nothing submitted: the per-submission figures are None, not a made-up 0."""
    from agentrl import Trajectory

    def traj(stop, turns, describes, failed):
        return Trajectory("t", [], [], [], [], None, False, stop, turns, turns, 0, describes, failed)
    trajectories = [traj("submitted", 2, 0, True), traj("submitted", 4, 1, False), traj("submitted", 3, 2, False),
                    traj("max_turns", 4, 0, False)]
    assert evaluate.behaviour(trajectories) == {"submit_rate": 0.75, "failed_submit_rate": 1 / 3, "describe_rate": 0.5,
                                                "turns_to_submit": 3.0}
    none = evaluate.behaviour([traj("max_turns", 4, 1, False)])
    assert none["failed_submit_rate"] is None and none["turns_to_submit"] is None and none["describe_rate"] == 1.0


def test_a_record_reads_back_per_split():
    """The first split's metrics sit under eval_*, another split's under its own name; split_metrics
    gives either back under eval_*, and {} for a split the record does not hold (an older record)."""
    first = {"eval_accuracy": 0.5, "eval_tasks": 2, "eval_accuracy_by_tier": {"easy": 0.5}}
    record = {"eval_split": "test", **first, "test_schema_accuracy": 0.0, "test_schema_tasks": 2,
              "test_schema_accuracy_by_tier": {"easy": 0.0}}
    assert evaluate.split_metrics(record, "test") == first
    assert evaluate.split_metrics(record, "test_schema") == {"eval_accuracy": 0.0, "eval_tasks": 2,
                                                             "eval_accuracy_by_tier": {"easy": 0.0}}
    assert evaluate.split_metrics(record, "val") == {}


def test_held_out_subsets_are_the_same_positions_whatever_the_split(splits):
    """load_eval_sets draws a split's subset with a seed of its own: test and test_schema (the same
    questions on another schema) get the same positions, and a second draw the same tasks."""
    sets = evaluate.load_eval_sets("default", ["test", "test_schema"], 5)
    again = evaluate.load_eval_sets("default", ["test"], 5)
    positions = {split: [splits[split].index(t) for t in tasks] for split, tasks in sets.items()}
    assert len(sets["test"]) == 5 and positions["test"] == positions["test_schema"]
    assert [t.id for t in again["test"]] == [t.id for t in sets["test"]]
    assert len(evaluate.load_eval_sets("default", ["test"], 0)["test"]) == len(splits["test"])


def test_a_forked_evaluation_that_dies_leaves_the_model_as_it_was(splits, smol_tokenizer, monkeypatch):
    """A child killed mid-evaluation (out of memory, say) is an error naming it, and the model the
    run goes on with is unmerged and back in train mode."""
    from conftest import build_tiny_model
    import agentrl
    model = build_tiny_model("llama")
    layers = lora.apply_lora(model, r=4, alpha=8) and [m for m in model.modules() if isinstance(m, lora.LoRALinear)]
    monkeypatch.setattr(engine, "rollout_groups", lambda *args, **kwargs: os._exit(3))
    model.train()
    with pytest.raises(RuntimeError, match="died without a result"):
        evaluate.evaluate(model, smol_tokenizer, splits["test"][:2], agentrl.Limits(), processes=2)
    assert model.training and all(m.merged is None for m in layers)


@pytest.mark.parametrize("weight_dtype", [None, torch.bfloat16])
def test_evaluation_in_forked_processes_equals_one_process(weight_dtype, splits, smol_tokenizer, forks, tmp_path,
                                                           monkeypatch):
    """--eval-processes 2: the same episodes, in task order, as in the run's own process,
    and the forks really ran. Both at one thread; the shares' batches are narrower, so greedy
    choices could only differ on a near-tie of logits, which these 5 tasks do not have. The forks
    find the LoRA merged: they share the parent's merged weights instead of building their own,
    in bf16 too (--eval-dtype bf16)."""
    from conftest import build_tiny_model
    import agentrl
    model, tasks = build_tiny_model("llama"), splits["test"][:5]
    layers = lora.apply_lora(model, r=4, alpha=8) and [m for m in model.modules() if isinstance(m, lora.LoRALinear)]
    rollout_groups = engine.rollout_groups

    def merged_before(*args, **kwargs):
        assert os.getpid() == parent or all(m.merged is not None for m in layers), "a fork merged the LoRA itself"
        assert all(m.merged.dtype == (weight_dtype or torch.float32) for m in layers if m.merged is not None)
        return rollout_groups(*args, **kwargs)
    parent = os.getpid()
    monkeypatch.setattr(engine, "rollout_groups", merged_before)
    limits = agentrl.Limits(max_turns=2, max_new_tokens=12, max_context=1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = evaluate.evaluate(model, smol_tokenizer, tasks, limits, path=str(tmp_path / "one.jsonl"),
                                weight_dtype=weight_dtype)
        two = evaluate.evaluate(model, smol_tokenizer, tasks, limits, path=str(tmp_path / "two.jsonl"),
                                processes=2, weight_dtype=weight_dtype)
    finally:
        torch.set_num_threads(threads)
    assert forks == [2] and one == two
    assert (tmp_path / "one.jsonl").read_text() == (tmp_path / "two.jsonl").read_text()
    assert [json.loads(line)["task_id"] for line in open(tmp_path / "two.jsonl")] == [t.id for t in tasks]


def test_mcnemar_p_and_the_paired_line_on_a_hand_computed_case():
    """8 tasks: 1 solved by both, 6 gained, 1 lost. Accuracy 2/8 -> 7/8, +5 of 8 = +62.5 points;
    McNemar looks at the 7 discordant tasks only: p = 2 * (C(7,0) + C(7,1)) / 2^7 = 16/128."""
    before = {f"q{i}": o for i, o in enumerate([1, 1, 0, 0, 0, 0, 0, 0])}
    after = {f"q{i}": o for i, o in enumerate([1, 0, 1, 1, 1, 1, 1, 1])}
    mean, (low, high), p = evaluate.paired_difference(list(before.values()), list(after.values()))
    assert mean == pytest.approx(0.625) and p == pytest.approx(0.125) and low < 0.625 < high
    line = evaluate.paired_line(before, after)
    assert line.startswith("0.250 -> 0.875 on 8 tasks: +62.5 points [") and line.endswith(
        "McNemar p=0.125, 6 gained, 1 lost")


def test_paired_difference_on_a_known_example():
    """100 tasks, 30 solved before; after, 10 more solved and none lost: +10 points, McNemar's exact
    p = 2 * 0.5^10, and a 95% interval that excludes 0 and holds 0.10 (its sd is about 3 points)."""
    before = [1] * 30 + [0] * 70
    after = [1] * 40 + [0] * 60
    mean, (low, high), p = evaluate.paired_difference(before, after)
    assert mean == pytest.approx(0.10) and p == pytest.approx(2 / 1024)
    assert 0.02 < low < 0.10 < high < 0.18


def test_paired_difference_sees_no_gain_when_gains_and_losses_cancel():
    """Ten tasks gained and ten lost: the mean is 0, the interval straddles it, McNemar's p is 1.
    The same accuracies unpaired would say nothing either, but pairing is what makes it exact."""
    before = [1] * 10 + [0] * 10 + [1] * 20 + [0] * 60
    after = [0] * 10 + [1] * 10 + [1] * 20 + [0] * 60
    mean, (low, high), p = evaluate.paired_difference(before, after)
    assert mean == 0 and low < 0 < high and p == pytest.approx(1.0)


def test_paired_difference_needs_the_same_tasks():
    with pytest.raises(AssertionError, match="paired"):
        evaluate.paired_difference([1, 0], [1])


def test_a_cluster_bootstrap_widens_the_interval_of_gains_from_one_template():
    """10 templates of 10 questions. All 10 gains in one template: tasks as independent draws say
    +10 points, clearly above 0; resampling templates leaves that one out of about a third of the
    draws (0.9^10), so the interval reaches 0. One gain in each template: every draw of templates
    gives exactly +10, an interval narrower than the tasks'."""
    templates = [f"t{k // 10}" for k in range(100)]
    before = [0] * 100
    one = [1] * 10 + [0] * 90
    _, (low, high), _ = evaluate.paired_difference(before, one)
    assert 0.03 < low < 0.10 < high
    mean, (low, high), _ = evaluate.paired_difference(before, one, clusters=templates)
    assert mean == pytest.approx(0.10) and low == 0.0 and high > 0.2
    spread = [1 if k % 10 == 0 else 0 for k in range(100)]
    _, (low, high), _ = evaluate.paired_difference(before, spread, clusters=templates)
    assert low == pytest.approx(0.10) and high == pytest.approx(0.10)
