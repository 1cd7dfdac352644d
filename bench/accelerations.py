"""What each acceleration gives one default GRPO step, and what it costs in reading-path lines.

    python -m bench accelerations [--adapter runs/default/sft] [--variants a,b]

One GRPO step as train.py takes it at its CPU defaults (STEP: 4 candidate tasks x 8 trajectories at
temperature 0.5, at most 16 rows decoding at once, the 2 groups kept, one update with gradient
checkpointing), first with everything on, then with one acceleration taken out at a time. An
acceleration is taken out from here, by replacing the core's name for the length of one variant
(TAKEN_OUT): the core has no switch for it. A rollout variant rolls out the same tasks with the same
seed as the baseline; an update variant updates from the baseline's kept groups (rewarded k / n, so
both train), from the same adapter and a fresh optimizer. A variant's step is its own part plus the
baseline's other part; the acceleration's gain is that step's time over the baseline's (above 1: it pays).
The baseline rolls out twice, first and last: the spread of its two times is the noise to read the
ratios against. Two accelerations are not measured here: the KV cache (kvcache.KVCache) cannot be
taken out this way, as DynamicCache has no row operations (`python -m bench cache` measures its
decode step), and the two memory levers (checkpointing, chunks) are for memory, which `python -m bench
update` and `python -m bench memory` measure each in a fresh process; here, their cost in time.
"""
import contextlib
import random
import time
from unittest import mock

import torch

import agentrl
import engine
import forward
import grpo
import lora
import sql_env
import train
from bench.common import chosen_variants, counted_rollout
from bench.update import scripted_rewards

STEP = dict(tasks=4, group=8, kept=2, temperature=0.5, max_turns=4, max_new_tokens=128, max_context=2048)


def _one_at_a_time(original):
    """forward.tree_logprobs forwarding each trajectory alone (its own chain, the prompt included)."""
    def logprobs(model, tree, trajectories, rows, chunk_size=512, temperature=1.0):
        parts = [original(model, tree, trajectories, [r], chunk_size, temperature) for r in rows]
        T = max(p.shape[1] for p in parts)
        return torch.cat([torch.nn.functional.pad(p, (0, T - p.shape[1])) for p in parts])
    return logprobs


# name: (the part of the step it acts on, (module, name, replacement) or a GRPOConfig change)
TAKEN_OUT = {
    "all on": ("both", None),
    "prompts' common prefix once": ("rollout", (engine, "common_prefix_length", lambda prompts, limit: 1)),
    "rows that agree fed once": ("rollout", (engine, "_distinct_histories",
                                             lambda rows: (list(range(len(rows))), list(range(len(rows)))))),
    "LoRA folded while generating": ("rollout", (lora, "lora_merged",
                                                 lambda model, dtype=None: contextlib.nullcontext())),
    "cache packed at flushes": ("rollout", (engine, "pack_left", lambda cache, mask: mask)),
    "a group's tree forwarded once": ("update", (forward, "tree_logprobs", _one_at_a_time(forward.tree_logprobs))),
    "gradient checkpointing": ("update", {"gradient_checkpointing": False}),
    "log-probs in chunks": ("update", {"chunk_size": None}),
}


def taken_out(change):
    """The core with `change` (module, name, replacement) in force, restored on the way out
    (unittest.mock's patch); a GRPOConfig change or None changes no name."""
    return mock.patch.object(*change) if isinstance(change, tuple) else contextlib.nullcontext()


def timed_update(model, groups, config, start, trials=2):
    """grpo_step on `groups` from the adapter `start` with a fresh optimizer, `trials` times, the
    adapter put back after each: the seconds of the fastest."""
    rewards, _, _ = scripted_rewards(groups)
    batch, _ = grpo.make_batch(groups, rewards)
    times = []
    for _ in range(trials):
        optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-4, weight_decay=0.0)
        t0 = time.perf_counter()
        stats = grpo.grpo_step(model, optimizer, batch, config, torch.amp.GradScaler("cpu", enabled=False))
        times.append(time.perf_counter() - t0)
        assert not stats["skipped"], stats["skip_reason"]
        for p, s in zip(lora.lora_parameters(model), start):
            p.data.copy_(s)
    return min(times)


def bench_accelerations(args):
    """The table of the module docstring: the baseline, then each acceleration taken out (--variants)."""
    names = chosen_variants(args, TAKEN_OUT)
    if names[0] != "all on":
        raise SystemExit("--variants: 'all on', the baseline, first")
    model, tokenizer = lora.load_model(args.model)
    lora.apply_lora(model, r=16, alpha=32.0)
    if args.adapter:
        lora.load_adapter(model, lora.find_adapter(args.adapter))
    start = [p.detach().clone() for p in lora.lora_parameters(model)]
    tasks = random.Random(args.seed).sample(sql_env.load_tasks("default", "train"), STEP["tasks"])
    sampling = engine.Sampling(temperature=STEP["temperature"], seed=args.seed)
    limits = agentrl.Limits(STEP["max_turns"], STEP["max_new_tokens"], STEP["max_context"])

    def rollout():
        groups, stats = counted_rollout(model, tokenizer, tasks, STEP["group"], sampling, limits,
                                        max_rows=STEP["kept"] * STEP["group"])
        return train.mixed_first(groups, STEP["kept"]), stats

    rows, kept = {}, None
    # the baseline's rollout again at the end: the spread of its two times is the noise
    jobs = [(name, TAKEN_OUT[name][0]) for name in names] + [("all on", "rollout")] * (len(names) > 1)
    for name, part in jobs:
        change, row = TAKEN_OUT[name][1], {}
        if part in ("both", "rollout"):
            with taken_out(change):
                groups, stats = rollout()
            kept = kept or groups     # the baseline's kept groups: every update variant's batch
            row.update(rollout=stats["total_s"], fed=stats["prompt_tokens"], sampled=stats["generated_tokens"])
        if part in ("both", "update"):
            config = grpo.GRPOConfig(**{"gradient_checkpointing": True, **(change if isinstance(change, dict) else {})})
            with taken_out(change):
                row["update"] = timed_update(model, kept, config, start)
        rows.setdefault(name, []).append(row)

    base = rows["all on"]
    rollouts = [r["rollout"] for r in base]
    rollout_s, update_s = sum(rollouts) / len(rollouts), base[0]["update"]
    step_s = rollout_s + update_s
    print(f"\none default GRPO step: {STEP['tasks']} tasks x {STEP['group']} at temperature {STEP['temperature']}, "
          f"{STEP['kept']} groups kept and updated | adapter {args.adapter or 'none'}")
    print("baseline, all on: rollout " + " and ".join(f"{s:.1f}" for s in rollouts) + " s (first and last: the "
          f"noise), update {update_s:.1f} s, step {step_s:.1f} s")
    print(f"{'taken out':<32}{'part':>8}{'fed tokens':>11}{'sampled':>9}{'part s':>9}{'gain':>7}"
          f"{'step s':>9}{'gain':>7}")
    for name in names:
        part, r = TAKEN_OUT[name][0], rows[name][0]
        baseline_part = {"rollout": rollout_s, "update": update_s, "both": step_s}[part]
        own = {"rollout": r.get("rollout"), "update": r.get("update"), "both": step_s}[part]
        step = step_s - baseline_part + own
        print(f"{name:<32}{part:>8}{r.get('fed', '-'):>11}{r.get('sampled', '-'):>9}{own:>8.1f}s"
              f"{own / baseline_part:>6.2f}x{step:>8.1f}s{step / step_s:>6.2f}x")
