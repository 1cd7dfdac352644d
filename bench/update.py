"""The update's memory and speed (grpo.py, forward.py), and whole train.py runs timed.

    python -m bench memory                    # one GRPO update's peak memory: chunked vs unchunked log-probs
    python -m bench update [--variants a,b]   # one GRPO step on a group: each trajectory alone vs the tree once
    python -m bench scale [--trained-groups K] [train.py flags]   # train.py steps per minute: 1 process vs 2
    python -m bench allocator [train.py flags]   # a short run's peak memory, phase times: activations kept or not

memory and update run each variant in a fresh process (`--child VARIANT`) and print the first as
the baseline. scale and allocator start train.py runs one after the other, each in a fresh process
(`python -m bench train-run`: train.main with scripted_rewards as its reward function), and
compare each with the first.
"""
import functools
import json
import os
import random
import shutil
import subprocess
import sys
import time

import torch

import agentrl
import forward
import grpo
import judge
import lora
import sql_env
import train
from bench.common import (bench_env, chosen_variants, in_fresh_process, mean_or_nan, one_group_batch, random_batch, reset_resident_peak,
                          resident_bytes, run_records)


# ---------------------------------------------------------------- memory (forward.tree_logprobs)
def bench_memory(args):
    """Peak memory of one GRPO update, token log-probs chunked vs unchunked (forward.tree_logprobs'
    chunk_size: GRPOConfig.chunk_size 512 against None).

    One update = grpo.grpo_step on a batch of one group (agentrl.make_group) of 8 random sequences
    of 1,024 tokens (the last 768 trained, nothing shared) in one forward, LoRA r=16 on the embedded model, gradient checkpointing on, so that what is left
    is what the log-prob computation costs. Each variant runs in a fresh process, so neither
    inherits the other's allocator state (memory_variant). The figure is the peak above a baseline taken just
    before the update (model, LoRA, optimizer and batch already in memory). CUDA:
    torch.cuda.max_memory_allocated. CPU: the kernel's resident-set high-water mark (VmHWM),
    reset just before the update by writing 5 to /proc/self/clear_refs, minus the resident set
    at that moment. The child runs with MALLOC_MMAP_THRESHOLD_=65536 so glibc hands every freed
    tensor back to the OS at once and the resident set tracks live memory, not allocator caches.
    `--shape qwen2.5-3b` measures something else: the fit of a 3B model on a T4 (bench/fit3b.py).
    """
    if args.child:
        print(json.dumps(memory_variant(args, args.child)))
        return
    results = {}
    for v in ("unchunked", "chunked"):
        print(f"measuring {v} ...", flush=True)
        results[v] = in_fresh_process(["memory", "--seed", str(args.seed)], v)
    r = results["chunked"]
    print(f"\nmodel: {r['model']} | device: {r['device']} | {r['batch']} | method: {r['method']}")
    print(f"{'log-probs':<34}{'peak above baseline':>20}{'time':>9}")
    labels = {"unchunked": "unchunked (full B x T x V logits)", "chunked": f"chunked ({r['chunk_size']} positions)"}
    for v, label in labels.items():
        print(f"{label:<34}{results[v]['peak_gib']:>16.2f} GiB{results[v]['seconds']:>8.1f}s")
    ratio = results["chunked"]["peak_gib"] / results["unchunked"]["peak_gib"]
    print(f"chunked / unchunked = {ratio:.2f} (target < 0.5: {'met' if ratio < 0.5 else 'NOT met'})")


def memory_variant(args, variant) -> dict:
    """One variant of bench_memory ("chunked" or "unchunked") in this (fresh) process: the peak
    above the baseline, the update's seconds, and what was measured."""
    assert variant in ("chunked", "unchunked"), f"memory: no variant {variant!r}"
    torch.manual_seed(args.seed)
    model, _ = lora.load_model()
    lora.apply_lora(model, r=16)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-5)
    config = grpo.GRPOConfig(micro_batch_size=8, gradient_checkpointing=True,
                             chunk_size=None if variant == "unchunked" else grpo.GRPOConfig.chunk_size)
    B, T = 8, 1024
    trajs, advantages = random_batch(model.config.vocab_size, B, T, prompt=256, seed=args.seed)
    batch = one_group_batch(trajs, advantages)

    if device.type == "cuda":
        method = "torch.cuda.max_memory_allocated"
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        method = "resident-set high-water mark (VmHWM, reset via /proc/self/clear_refs), fresh process per variant"
        reset_resident_peak()
        base = resident_bytes("VmRSS")
    t0 = time.time()
    stats = grpo.grpo_step(model, optimizer, batch, config, torch.amp.GradScaler(device.type, enabled=False))
    assert not stats["skipped"], stats["skip_reason"]
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resident_bytes("VmHWM") - base
    return {"model": os.path.basename(model.config._name_or_path) or model.config.model_type,
            "device": str(device), "batch": f"{B} x {T} tokens, LoRA r=16, grad checkpointing",
            "method": method, "chunk_size": grpo.GRPOConfig.chunk_size,
            "peak_gib": peak / 2**30, "seconds": time.time() - t0}


# ---------------------------------------------------------------- update (grpo.grpo_step, forward.tree_logprobs)
UPDATE_GROUP = 8      # trajectories of a group (train.py's --group-size)
UPDATE_VARIANTS = {   # name: (trajectories of the group per forward: 1, or the whole group; layers recomputed in the backward)
    "whole": (1, False), "tree": (UPDATE_GROUP, False), "whole-ckpt": (1, True), "tree-ckpt": (UPDATE_GROUP, True)}


def bench_update(args):
    """One GRPO step on a group of 8 trajectories of the embedded data that share their prompt and
    first turns, as a group after the SFT warm start does (update_groups), four ways: each trajectory
    forwarded alone, every token of it (micro_batch_size=1: nothing shared), against the group in
    one forward over its tree (agentrl.make_group, forward.tree_logprobs: each shared turn once;
    micro_batch_size = the group, train.py's default); both again with gradient checkpointing
    (--grad-checkpointing, the -ckpt variants). Each variant in a fresh process (update_variant; as
    bench_memory: VmHWM above the resident set just before the steps); time is the mean of 3 steps
    after a warm-up, on the same groups in every variant.
    """
    if args.child:
        print(json.dumps(update_variant(args, args.child)))
        return
    results = {v: in_fresh_process(["update", "--seed", str(args.seed)], v)
               for v in chosen_variants(args, UPDATE_VARIANTS)}
    base = next(iter(results.values()))   # the first variant measured is the baseline
    print(f"\none GRPO step on a group, {base['batch']} | {base['device']}")
    print(f"{'variant':<12}{'per forward':>14}{'tokens forwarded':>18}{'checkpointing':>15}{'time':>9}{'vs first':>10}"
          f"{'peak above baseline':>22}")
    for v, r in results.items():
        mbs, recompute = UPDATE_VARIANTS[v]
        print(f"{v:<12}{'the group' if mbs > 1 else 'one':>14}{r['forwarded']:>18}{'yes' if recompute else 'no':>15}"
              f"{r['seconds']:>8.1f}s{base['seconds'] / r['seconds']:>9.2f}x{r['peak_gib']:>18.2f} GiB")


def update_groups(model, tokenizer, tasks, group, limits, chunk_size):
    """For each task, a group (agentrl.make_group) of `group` scripted trajectories: the gold
    demonstration's turns up to its query (list the tables, describe them: the prompt and these
    turns are shared), then each its own run_sql and submit_answer (the gold query, then the same
    query under another comment in each other row), as a group sampled after SFT looks. The sampled
    log-probs are the model's own (one no-grad forward of the tree), so the step's ratios start at 1."""
    groups = []
    for task in tasks:
        gold = agentrl.gold_turns(task, limits.max_turns)
        trajectories = []
        for j in range(group):
            query = task.gold_sql if j == 0 else f"{task.gold_sql} -- attempt {j}"
            turns = gold[:-2] + [agentrl.tool_call_text(name, {"query": query}) for name in ("run_sql", "submit_answer")]
            trajectories.append(agentrl.scripted_trajectory(tokenizer, task, turns, limits))
        g = agentrl.make_group(task, trajectories)
        with torch.no_grad():
            logprobs = forward.tree_logprobs(model, g.tree, trajectories, list(range(group)), chunk_size)   # (B, T)
        for t, row in zip(trajectories, logprobs.tolist()):
            t.sampled_logprobs = [lp if m else 0.0 for lp, m in zip(row, t.assistant_mask)]
        groups.append(g)
    return groups


def forwarded_tokens(group, micro_batch_size):
    """The tokens the update's forwards run over: each node of the tree once for every micro-batch
    of the group's trajectories that passes through it."""
    parts = [set(range(k, min(k + micro_batch_size, len(group.trajectories))))
             for k in range(0, len(group.trajectories), micro_batch_size)]

    def count(node):
        return sum(len(node.tokens) for part in parts if part.intersection(node.through)) + sum(map(count, node.children))
    return count(group.tree)


def update_variant(args, variant) -> dict:
    """One variant of bench_update in this (fresh) process: seconds per step, the peak above the
    resident set before the steps, and the tokens a step forwards."""
    mbs, recompute = UPDATE_VARIANTS[variant]
    model, tokenizer = lora.load_model()
    lora.apply_lora(model, r=16)
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-5)
    limits = agentrl.Limits(max_turns=4, max_new_tokens=128, max_context=2048)
    config = grpo.GRPOConfig(micro_batch_size=mbs, gradient_checkpointing=recompute)
    tasks = random.Random(args.seed).sample(sql_env.load_tasks("default", "train"), 4)
    groups = update_groups(model, tokenizer, tasks, UPDATE_GROUP, limits, config.chunk_size)
    rewards = [[float(j % 2) for j in range(UPDATE_GROUP)] for _ in groups]     # mixed: every group trains
    steps = [grpo.make_batch([g], [r]) for g, r in zip(groups, rewards)]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    grpo.grpo_step(model, optimizer, steps[0][0], config, scaler)          # warm-up
    reset_resident_peak()
    base = resident_bytes("VmRSS")
    t0 = time.perf_counter()
    for batch, _ in steps[1:]:
        stats = grpo.grpo_step(model, optimizer, batch, config, scaler)
        assert not stats["skipped"], stats["skip_reason"]
    seconds = (time.perf_counter() - t0) / len(steps[1:])
    shown = groups[1].trajectories
    tokens = sum(len(t.token_ids) for t in shown), sum(sum(t.assistant_mask) for t in shown)
    return {"seconds": seconds, "peak_gib": (resident_bytes("VmHWM") - base) / 2**30, "device": "cpu",
            "forwarded": forwarded_tokens(groups[1], mbs),
            "batch": f"{UPDATE_GROUP} trajectories, {tokens[0]} tokens of which {tokens[1]} trained, "
                     f"{forwarded_tokens(groups[1], UPDATE_GROUP)} distinct, LoRA r=16"}


# ---------------------------------------------------------------- scale (train.py under torchrun, parallel.py)
def scripted_rewards(groups, *_, trained=0):
    """The reward function of the train.py runs that scale and allocator measure (train.main's
    score=, in place of train.score_groups): trajectory k of a group of n gets k / n, so every group
    trains (an untrained model answers nothing right), or only the first `trained` groups (0: all;
    the others get 0 each); the figure is time, not learning. Returns what train.score_groups does:
    (rewards, judge results, groups the judge failed)."""
    trained = trained or len(groups)
    rewards = [[k / len(g.trajectories) if i < trained else 0.0 for k in range(len(g.trajectories))]
               for i, g in enumerate(groups)]
    unscored = judge.JudgeResult(scores=None, explanations=[], scored=False, attempts=0, error="scripted")
    return rewards, [unscored] * len(groups), 0


def train_run(args):
    """`python -m bench train-run [--trained-groups K] TRAIN_FLAGS`: one train.py run rewarded by
    scripted_rewards, in the process scale or allocator started (under torchrun: each of its processes)."""
    train.main(args.train_flags, score=functools.partial(scripted_rewards, trained=args.trained_groups))


def start_train_run(train_flags, trained_groups=0, launcher=(sys.executable,), env=None):
    """A train-run child process started with `launcher` (python, or torchrun's), its output discarded."""
    return subprocess.Popen([*launcher, "-m", "bench", "train-run", "--trained-groups", str(trained_groups), *train_flags],
                            env=bench_env(env), stdout=subprocess.DEVNULL)


SCALE_VARIANTS = {"1-process": 1, "torchrun-2": 2}   # name: processes torchrun starts


def bench_scale(args):
    """Steps per minute of train.py, the same steps of the same size one run after the other: in one
    process, and in two (torchrun; gloo on a CPU). And where a step's time goes: rollouts (the slowest
    process's; the others wait for it) and the rest (the update with its gradient all-reduce,
    gathering the step, the metrics record). Times are train.py's own: time_step runs from sampling
    the tasks to the metrics record, so checkpoint and plot writes are left out. Every group
    trains (scripted rewards), so every step has its update; --trained-groups K: the first K of each
    process's groups."""
    out = os.path.join("runs", "bench_scale")
    flags = ["--steps", "3", "--sft-steps", "0", "--groups-per-step", "2", "--group-size", "4", "--max-turns", "2",
             "--max-new-tokens", "48", "--eval-size", "1", "--eval-split", "test", "--seed", str(args.seed),
             *(["--adapter", args.adapter] if args.adapter else []), *args.train_flags]
    rows = []
    for name in chosen_variants(args, SCALE_VARIANTS):
        processes = SCALE_VARIANTS[name]
        run_dir = os.path.join(out, name)
        launcher = [sys.executable] if processes == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        t0 = time.perf_counter()
        if start_train_run(flags + ["--out", run_dir], args.trained_groups, launcher).wait():
            raise SystemExit(f"scale: the {name} run failed")
        whole = time.perf_counter() - t0
        steps = [r for r in run_records(run_dir) if "reward_mean" in r]
        updated = [r for r in steps if not r["skipped"]]
        step_s = sum(r["time_step"] for r in steps) / len(steps)
        rollout_s = sum(r["time_rollout"] for r in steps) / len(steps)
        tokens = sum(r["gen_tokens"] for r in steps) / len(steps)
        rows.append({"name": name, "steps_per_min": 60 / step_s, "step_s": step_s, "rollout_s": rollout_s,
                     "rest_s": step_s - rollout_s, "tok_s": tokens / rollout_s, "whole_s": whole,
                     "applied": len(updated),
                     # the update's first ratio against the sampler: 0 when both compute alike, else the gap
                     "kl_old": mean_or_nan([r["kl_old"] for r in updated]),
                     "clipped": mean_or_nan([r["clip_frac_low"] + r["clip_frac_high"] for r in updated])})
    threads = os.environ.get("OMP_NUM_THREADS")
    print(f"\nscale: train.py, {len(steps)} steps (embedded model, scripted rewards for "
          f"{args.trained_groups or 'every'} group(s) a step), flags: {' '.join(flags)}; "
          f"{os.cpu_count()} CPU cores; threads per process: "
          + (threads if threads else "torch's default in one process, 1 in each of torchrun's"))
    print(f"{'variant':>18} {'steps/min':>10} {'step s':>7} {'rollout s':>10} {'gen tok/s':>10} {'rest s':>7} "
          f"{'updates':>8} {'kl_old':>9} {'clipped':>8} {'run s':>6}")
    for r in rows:
        print(f"{r['name']:>18} {r['steps_per_min']:>10.2f} {r['step_s']:>7.1f} {r['rollout_s']:>10.1f} "
              f"{r['tok_s']:>10.1f} {r['rest_s']:>7.1f} {r['applied']:>8} {r['kl_old']:>9.2e} {r['clipped']:>8.4f} "
              f"{r['whole_s']:>6.0f}")
    one = rows[0]
    for r in rows[1:]:
        print(f"{r['name']} / {one['name']}: {r['steps_per_min'] / one['steps_per_min']:.2f}x steps per minute | rollout "
              f"{one['rollout_s'] / r['rollout_s']:.2f}x faster ({r['tok_s'] / one['tok_s']:.2f}x generated tokens/s), "
              f"the rest {one['rest_s'] / r['rest_s']:.2f}x faster")


# ---------------------------------------------------------------- allocator (train.py)
ALLOCATOR_RUN = ["--sft-steps", "2", "--steps", "2", "--eval-size", "4"]   # every phase of the default run, short


def bench_allocator(args):
    """Where the default run's peak memory goes, and what the way down costs in time: a short
    train.py run with every phase (base evaluation, 2 SFT steps, SFT evaluation, 2 GRPO steps that
    each update (scripted rewards), final evaluation), two ways, each in a fresh process, glibc's
    malloc as it comes (a MALLOC_MMAP_THRESHOLD_ set here is not passed on): every layer's
    activations kept for the backward (--no-grad-checkpointing), and layers recomputed in the
    backward (--grad-checkpointing, the default). The peak is the child's maximum resident set
    (os.wait4's rusage); the times are train.py's own per phase, and the whole run's; ratios are
    against the first row."""
    out = os.path.join("runs", "bench_allocator")
    flags = [*ALLOCATOR_RUN, "--seed", str(args.seed), *args.train_flags]
    variants = {"all kept": ["--no-grad-checkpointing"], "recomputed": ["--grad-checkpointing"]}
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    rows = {}
    for i, (name, variant_flags) in enumerate(variants.items()):
        run_dir = os.path.join(out, f"variant_{i}")
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"running {name} ...", flush=True)
        argv = flags + variant_flags + ["--out", run_dir]     # the variant's flags win over the same flags given
        t0 = time.perf_counter()
        child = start_train_run(argv, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        whole = time.perf_counter() - t0
        if status:
            raise SystemExit(f"allocator: the {name} run failed (wait status {status})")
        records = run_records(run_dir)
        steps = [r for r in records if "reward_mean" in r]
        rows[name] = {"peak_gib": usage.ru_maxrss * 1024 / 2**30, "run_s": whole,
                      "sft_s": mean_or_nan([r["time_step"] for r in records if "sft_step" in r]),
                      "rollout_s": mean_or_nan([r["time_rollout"] for r in steps]),
                      "update_s": mean_or_nan([r["time_step"] - r["time_rollout"] for r in steps]),
                      "updates": sum(not r["skipped"] for r in steps)}
    print(f"\nallocator: train.py {' '.join(flags)} (scripted rewards), "
          f"threads: {os.environ.get('OMP_NUM_THREADS') or torch.get_num_threads()}")
    print(f"{'activations':<26}{'peak resident':>14}{'run s':>8}{'SFT step s':>11}{'rollout s':>10}"
          f"{'update s':>9}{'updates':>8}")
    for name, r in rows.items():
        print(f"{name:<26}{r['peak_gib']:>10.2f} GiB{r['run_s']:>8.0f}{r['sft_s']:>11.1f}{r['rollout_s']:>10.1f}"
              f"{r['update_s']:>9.1f}{r['updates']:>8}")
    (base_name, base), *others = rows.items()
    for name, r in others:
        print(f"{name} / {base_name}: peak {r['peak_gib'] / base['peak_gib']:.2f}x | run time "
              f"{r['run_s'] / base['run_s']:.2f}x | SFT step {r['sft_s'] / base['sft_s']:.2f}x | rollout "
              f"{r['rollout_s'] / base['rollout_s']:.2f}x | update {r['update_s'] / base['update_s']:.2f}x")


