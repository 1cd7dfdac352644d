"""evaluate.py: greedy held-out evaluation, its record's layout, and forked evaluations
(--eval-processes) that give what one process gives."""
import json
import os

import pytest
import torch

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
    monkeypatch.setattr(agentrl, "rollout_groups", lambda *args, **kwargs: os._exit(3))
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
    rollout_groups = agentrl.rollout_groups

    def merged_before(*args, **kwargs):
        assert os.getpid() == parent or all(m.merged is not None for m in layers), "a fork merged the LoRA itself"
        assert all(m.merged.dtype == (weight_dtype or torch.float32) for m in layers if m.merged is not None)
        return rollout_groups(*args, **kwargs)
    parent = os.getpid()
    monkeypatch.setattr(agentrl, "rollout_groups", merged_before)
    limits = agentrl.Limits(max_turns=2, max_new_tokens=12, max_context=1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = evaluate.evaluate(model, smol_tokenizer, tasks, limits, path=str(tmp_path / "one.jsonl"), draft=2,
                                weight_dtype=weight_dtype)
        two = evaluate.evaluate(model, smol_tokenizer, tasks, limits, path=str(tmp_path / "two.jsonl"), draft=2,
                                processes=2, weight_dtype=weight_dtype)
    finally:
        torch.set_num_threads(threads)
    assert forks == [2] and one == two
    assert (tmp_path / "one.jsonl").read_text() == (tmp_path / "two.jsonl").read_text()
    assert [json.loads(line)["task_id"] for line in open(tmp_path / "two.jsonl")] == [t.id for t in tasks]

