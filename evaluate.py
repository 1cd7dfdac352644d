"""Greedy evaluation on held-out splits: what train.py reports as held-out accuracy.

    sets = load_eval_sets("default", ["test", "test_schema"], size=32)   # {split: tasks}, fixed subsets
    record = evaluate_splits(model, tokenizer, sets, limits, run_dir, "sft")
    print(format_evals(record, list(sets)))

Contract:
- One greedy trajectory per task (engine.Sampling(greedy=True)): the same model and tasks give
  the same outcomes, whatever the training seed. The subset of a split is drawn with a seed of
  its own (load_eval_sets), so runs with different --seed, and the splits test and test_schema
  (the same questions on another schema), evaluate the same question positions.
- An evaluation record is flat: the first split's metrics under eval_* keys (eval_accuracy,
  eval_accuracy_by_tier, eval_outcomes, ...), each other split's under its own name
  (test_schema_accuracy, ...), and eval_split naming the first. split_metrics reads any split
  back under the eval_* keys. eval_task_ids with eval_outcomes ("1"/"0" per task, in order)
  make two records comparable task by task.
- Under torchrun each process evaluates a contiguous share of the tasks and every process gets
  the whole record (parallel.shard, parallel.gather); only rank 0 writes episode files.
- On a CPU, `processes` > 1 forks that many one-thread processes, each with a share of the tasks
  (parallel.forked), and `weight_dtype` sets the weights' and the KV cache's precision while
  decoding; a GPU runs in one process at the model's own precision.
"""
import json
import math
import os
import random

import numpy as np

import torch

import agentrl
import engine
import lora
import parallel
import sql_env
from files import write_text_atomic

WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}   # --eval-dtype


def load_eval_sets(data, splits, size):
    """{split: tasks}: each split of `data` (sql_env.load_tasks), or `size` of its tasks drawn with
    a seed of their own (0: all of them)."""
    sets = {}
    for split in splits:
        tasks = sql_env.load_tasks(data, split)
        sets[split] = random.Random(0).sample(tasks, min(size, len(tasks))) if size else tasks
    return sets


def behaviour(trajectories):
    """What the agent does, counted: how often it submits; of its submissions, how many are a query
    that fails to run (often one whose last run just failed: submitted anyway); how often it looks
    at a table with describe_table; the turns it takes to submit. None where nothing was submitted."""
    submitted = [t for t in trajectories if t.stop_reason == "submitted"]
    return {
        "submit_rate": len(submitted) / len(trajectories),
        "failed_submit_rate": (sum(t.failed_submission for t in submitted) / len(submitted)
                               if submitted else None),
        "describe_rate": sum(t.num_describe_calls > 0 for t in trajectories) / len(trajectories),
        "turns_to_submit": sum(t.num_turns for t in submitted) / len(submitted) if submitted else None,
    }


def episode_record(task, t):
    """One episode as the run folder keeps it (trajectories/, evals/): the task, what was
    submitted, whether it was right, why it ended, and the conversation."""
    return {"task_id": task.id, "difficulty": task.difficulty, "question": task.question,
            "gold_sql": task.gold_sql, "submitted_sql": t.submitted_sql, "correct": t.correct,
            "stop_reason": t.stop_reason, "messages": t.messages}


def on_cpu_only(weight_dtype, device):
    """The weights' precision while generating (--eval-dtype; Sampling.weight_dtype) applies on a
    CPU; a GPU runs the model in half precision already (lora.precision_for): None."""
    return weight_dtype if device.type == "cpu" else None


def evaluate(model, tokenizer, tasks, limits, max_rows=16, path=None, processes=1, weight_dtype=None):
    """Greedy, one trajectory per task: execution accuracy overall and by tier, turns, tool errors,
    and the behaviour counters, under eval_* keys. All tasks go through one engine call, `max_rows`
    episodes at a time, a finished episode's place taken by the next task (continuous batching);
    the KV cache is rows x context, so `max_rows` bounds the memory. path: a .jsonl file to write
    every episode to (episode_record). processes: on a CPU, that many forked
    processes of one thread each, each with a contiguous share of the tasks and its own `max_rows`
    (parallel.forked). weight_dtype: the weights' and the KV cache's precision while decoding
    (Sampling.weight_dtype and cache_dtype), on a CPU only."""
    mine = parallel.shard(tasks)                      # this process's share of the tasks (all of them in one)
    # weights and KV cache in weight_dtype: a bf16 cache halves an evaluation's largest buffer, and
    # greedy decoding records no log-prob that a forward would have to match
    dtype = on_cpu_only(weight_dtype, model.device)
    greedy = engine.Sampling(greedy=True, weight_dtype=dtype, cache_dtype=dtype)

    def episodes(share):
        return [g.trajectories[0] for g in engine.rollout_groups(model, tokenizer, share, 1, greedy, limits,
                                                                  max_rows=max_rows)]
    if processes > 1 and model.device.type == "cpu":
        was_training = model.training
        # merged once, here, as generation runs (lora_merged): the children read these weights
        model.eval()
        merged = lora.lora_merged(model, greedy.weight_dtype)
        try:
            with merged:
                # no process reads the weights the merged copies replace until the next training step:
                # their pages (the model's file, mapped) leave this one, and so every child's count
                parallel.release_file_pages([layer.base_layer.weight for layer in merged.layers])
                trajectories = [t for share in parallel.forked(episodes, mine, processes) for t in share]
        finally:                # a child that died leaves the model as it found it
            model.train(was_training)
    else:
        trajectories = episodes(mine)
    # every process's, in task order
    trajectories = [t for share in parallel.gather(trajectories) for t in share]
    if path and parallel.is_main():
        write_text_atomic(path, "".join(json.dumps(episode_record(task, t)) + "\n"
                                        for task, t in zip(tasks, trajectories)))
    by_tier = {}
    for task, t in zip(tasks, trajectories):
        by_tier.setdefault(task.difficulty, []).append(t.correct)
    calls = sum(t.num_tool_calls for t in trajectories)
    return {
        "eval_accuracy": sum(t.correct for t in trajectories) / len(trajectories),
        "eval_accuracy_by_tier": {tier: sum(v) / len(v) for tier, v in sorted(by_tier.items())},
        "eval_mean_turns": sum(t.num_turns for t in trajectories) / len(trajectories),
        "eval_tool_error_rate": sum(t.num_tool_errors for t in trajectories) / max(calls, 1),
        "eval_tasks": len(trajectories),
        "eval_task_ids": [task.id for task in tasks],               # with eval_outcomes: paired comparisons
        "eval_outcomes": "".join("1" if t.correct else "0" for t in trajectories),
        **{"eval_" + k: v for k, v in behaviour(trajectories).items()},
    }


def evaluate_splits(model, tokenizer, eval_sets, limits, run_dir=None, label=None, **options):
    """One evaluation record for every held-out split of eval_sets ({split: tasks}), as the module
    docstring lays it out. With run_dir, the episodes go to run_dir/evals/<label>_<split>.jsonl.
    options: evaluate's processes and weight_dtype."""
    record = {}
    for i, (split, tasks) in enumerate(eval_sets.items()):
        path = os.path.join(run_dir, "evals", f"{label}_{split}.jsonl") if run_dir else None
        metrics = evaluate(model, tokenizer, tasks, limits, path=path, **options)
        record.update(metrics if i == 0 else {split + k[len("eval"):]: v for k, v in metrics.items()})
    return {"eval_split": next(iter(eval_sets)), **record}


def split_metrics(record, split):
    """One split's metrics from an evaluation record, under the eval_* keys ({} if it has none)."""
    suffixes = [k[len("eval"):] for k in record if k.startswith("eval_") and k != "eval_split"]
    name = "eval" if split == record.get("eval_split", split) else split
    return {"eval" + suffix: record[name + suffix] for suffix in suffixes if name + suffix in record}


def format_eval(metrics):
    """One split's metrics (eval_* keys) as one line."""
    def rate(key):
        return "-" if metrics.get(key) is None else f"{metrics[key]:.2f}"
    tiers = " ".join(f"{tier}={acc:.2f}" for tier, acc in metrics["eval_accuracy_by_tier"].items())
    return (f"accuracy={metrics['eval_accuracy']:.3f} ({metrics['eval_tasks']} tasks) | {tiers} | "
            f"turns={metrics['eval_mean_turns']:.2f} | tool_error_rate={metrics['eval_tool_error_rate']:.2f}"
            f" | failed_submit_rate={rate('eval_failed_submit_rate')} | "
            f"describe_rate={rate('eval_describe_rate')} | turns_to_submit={rate('eval_turns_to_submit')}")


def format_evals(record, splits):
    """One line per held-out split, the split's name first."""
    width = max(map(len, splits)) + 1
    return "\n".join(f"  {split + ':':<{width}} {format_eval(split_metrics(record, split))}"
                     for split in splits)


def format_history(records, splits):
    """Held-out accuracy through a run, one line per split: `0.000 (base) -> 0.156 (sft) -> ...`,
    each record labelled by its phase or step (records from before a split was added skip it)."""
    labels = [r.get("phase") or f"step {r['step']}" for r in records]
    width = max(map(len, splits)) + 1
    lines = []
    for split in splits:
        per_split = [(m, label) for r, label in zip(records, labels) if (m := split_metrics(r, split))]
        path = " -> ".join(f"{m['eval_accuracy']:.3f} ({label})" for m, label in per_split)
        lines.append(f"  {split + ':':<{width}} {path}   ({per_split[-1][0]['eval_tasks']} tasks)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- paired comparisons
def paired_difference(before, after, resamples=10_000, seed=0, clusters=None):
    """How much `after` beats `before` on the same tasks: per-task outcomes (0/1, paired by position).

    Returns (mean difference, 95% interval, McNemar p). The interval is the paired bootstrap's:
    resample tasks with replacement, keeping each task's two outcomes together, and take the
    2.5th and 97.5th percentiles of the mean difference. McNemar's exact test looks only at the
    discordant tasks (solved by one, not the other): under "no difference" each is a fair coin.
    Both treat tasks as independent draws. Questions made from one template are not: they are
    gained or lost together. clusters, a label per task (its template), makes the bootstrap
    resample whole clusters instead, so the interval speaks for new templates, not new values.
    """
    assert len(before) == len(after) > 0, "paired outcomes: the same tasks, in the same order"
    diffs = np.array(after, dtype=float) - np.array(before, dtype=float)   # (n,) each in {-1, 0, 1}
    rng = np.random.default_rng(seed)
    if clusters is None:
        means = diffs[rng.integers(0, len(diffs), (resamples, len(diffs)))].mean(1)   # (resamples,)
    else:
        assert len(clusters) == len(diffs), "one cluster label per task"
        index = np.unique(np.asarray(clusters), return_inverse=True)[1].ravel()    # (n,) each task's cluster
        sums, sizes = np.bincount(index, weights=diffs), np.bincount(index)      # (C,) per cluster
        # C clusters drawn, with replacement
        pick = rng.integers(0, len(sums), (resamples, len(sums)))
        means = sums[pick].sum(1) / sizes[pick].sum(1)                           # the mean over their tasks
    low, high = np.percentile(means, [2.5, 97.5])
    gained, lost = int((diffs > 0).sum()), int((diffs < 0).sum())
    n, k = gained + lost, min(gained, lost)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return float(diffs.mean()), (float(low), float(high)), p


def split_outcomes(record) -> dict:
    """{split: {task id: 0 or 1}} of an evaluation record (evaluate.evaluate_splits: eval_* keys for the
    first split, SPLIT_* for the others)."""
    splits = [record["eval_split"]] + [k[:-len("_task_ids")] for k in record
                                       if k.endswith("_task_ids") and k != "eval_task_ids"]
    return {split: dict(zip(m["eval_task_ids"], map(int, m["eval_outcomes"])))
            for split in splits for m in [split_metrics(record, split)]}


def paired_line(before, after, templates=None) -> str:
    """Two evaluations' outcomes ({task id: 0/1}) compared on the tasks both ran, as one line;
    with templates ({task id: its query template}), the interval by template as well."""
    tasks = [t for t in before if t in after]
    if not tasks:
        raise SystemExit("the two evaluations share no task: nothing to pair")
    b, a = [before[t] for t in tasks], [after[t] for t in tasks]
    mean, (low, high), p = paired_difference(b, a)
    gained, lost = sum(x < y for x, y in zip(b, a)), sum(x > y for x, y in zip(b, a))
    line = (f"{sum(b) / len(tasks):.3f} -> {sum(a) / len(tasks):.3f} on {len(tasks)} tasks: "
            f"{100 * mean:+.1f} points [{100 * low:+.1f}, {100 * high:+.1f}]")
    if templates:
        labels = [templates[t] for t in tasks]
        _, (low, high), _ = paired_difference(b, a, clusters=labels)
        line += f" by task, [{100 * low:+.1f}, {100 * high:+.1f}] by template ({len(set(labels))} templates)"
    return line + f", McNemar p={p:.3f}, {gained} gained, {lost} lost"
