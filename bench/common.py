"""What every benchmark shares: fresh processes, resident memory, timing, a random update batch,
and reading a train.py run's metrics back.

A measurement that must not inherit another's allocator state (peak memory) runs in a fresh
process, `python -m bench COMMAND ... --child VARIANT`, which prints its figures as one JSON line.
"""
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace
from unittest import mock

import torch

import agentrl
import engine
import grpo
import kvcache
import lora
from files import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository: the core modules and bench/


def bench_env(env=None) -> dict:
    """The environment of a `python -m bench ...` child: `env` (default: this one) with the
    repository on PYTHONPATH, so the child finds bench and the core from any working folder."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    return env


def in_fresh_process(argv, variant, hand_back_memory=True) -> dict:
    """`python -m bench *argv --child variant` in a fresh process: the JSON its last line prints.
    A fresh process inherits no allocator state, and MALLOC_MMAP_THRESHOLD_ makes glibc hand every
    freed tensor back to the OS at once, so on a CPU the resident set tracks live memory.
    hand_back_memory=False: glibc as train.py runs it (the resident peak then counts freed memory
    glibc keeps; the times are train.py's, where handing every freed tensor back costs time)."""
    env = bench_env({**os.environ, **({"MALLOC_MMAP_THRESHOLD_": "65536"} if hand_back_memory else {})})
    out = subprocess.run([sys.executable, "-m", "bench", *argv, "--child", variant],
                         env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def chosen_variants(args, variants):
    """--variants a,b: those of `variants`, in that order (the first is the baseline); default: all."""
    names = args.variants.split(",") if args.variants else list(variants)
    unknown = [name for name in names if name not in variants]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(variants)}")
    return names


def resident_bytes(field):
    """This process's resident memory from /proc/self/status: VmRSS (now) or VmHWM (the peak)."""
    with open("/proc/self/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_resident_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set (VmHWM) to the current one


def fastest(run, trials=5) -> float:
    """Seconds of the fastest of `trials` runs after a warm-up (on a shared machine a slow trial
    measures the neighbours, not the machine)."""
    run()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def random_batch(vocab, n, length, prompt, seed):
    """An update's batch: n trajectories of `length` random tokens, the last length - prompt
    trained, and advantages alternating -1, +1; the memory and speed of an update do not depend
    on the values. Returns (trajectories, advantages); one_group_batch makes them grpo_step's batch
    (a group whose trajectories are each one node: no turns recorded, nothing shared)."""
    g = torch.Generator().manual_seed(seed)
    trajectories = [SimpleNamespace(token_ids=torch.randint(0, vocab, (length,), generator=g).tolist(),
                                    assistant_mask=[0] * prompt + [1] * (length - prompt),
                                    sampled_logprobs=[0.0] * prompt + [-math.log(vocab)] * (length - prompt),
                                    turns=[], messages=[], stop_reason="max_context")
                    for _ in range(n)]
    return trajectories, [1.0 if i % 2 else -1.0 for i in range(n)]


def one_group_batch(trajectories, advantages):
    """The trajectories as one group (nothing shared: random_batch's), in the grpo.Batch an update
    takes: each one's advantage on every token, the normalizer's counts over all of them."""
    masks = [sum(t.assistant_mask) for t in trajectories]
    return grpo.Batch([agentrl.make_group(None, trajectories)], [[[a] * len(t.token_ids) for t, a in
                                                                  zip(trajectories, advantages)]],
                      len(masks), sum(masks), max(masks))


def run_records(folder) -> list:
    """A train.py run's metrics.jsonl, one dict per line."""
    return read_jsonl(os.path.join(folder, "metrics.jsonl"))


def mean_or_nan(values):
    return sum(values) / len(values) if values else float("nan")


def record_mean(key, records):
    """The mean of a metric over step records, over those that logged it as a number (nan if none)."""
    return mean_or_nan([r[key] for r in records if isinstance(r.get(key), (int, float))])


# ---------------------------------------------------------------- counting the engine's forwards
class CountingForward(kvcache.CachedForward):
    """The rollout engine's forward, counted and timed from outside the decode path: every call,
    and the flushes alone (a forward that feeds some row more than one token: a prompt, a tool
    result) under flush_*. counters: forwards, fed_tokens (real), fed_columns (holes included),
    logit_rows, cache_columns (KV columns read, holes included), query_key_pairs; forward_s."""

    def __init__(self, model, dtype=None):
        super().__init__(model, dtype)
        self.device = model.device
        self.stats = dict.fromkeys(["forwards", "fed_tokens", "fed_columns", "logit_rows", "cache_columns",
                                    "query_key_pairs", "forward_s"], 0)
        self.stats.update({"flush_" + k: 0 for k in list(self.stats)})

    def __call__(self, ids, mask, cache):
        t0 = time.perf_counter()
        logits = super().__call__(ids, mask, cache)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        W = ids.shape[1]
        counts = dict(forwards=1, fed_tokens=int(mask[:, -W:].sum()), fed_columns=ids.numel(), logit_rows=len(ids),
                      cache_columns=mask.numel(), query_key_pairs=ids.numel() * mask.shape[1],
                      forward_s=time.perf_counter() - t0)
        for key, count in counts.items():
            self.stats[key] += count
            if W > 1:
                self.stats["flush_" + key] += count
        return logits


def counted_rollout(*args, **kwargs):
    """engine.rollout_groups(*args, **kwargs) with its forwards counted (CountingForward): returns
    (groups, stats), stats with the counters, total_s, prompt_tokens (the flushes' real tokens) and
    generated_tokens (sampled)."""
    made = []

    def counting(model, dtype=None):
        made.append(CountingForward(model, dtype))
        return made[-1]
    original, engine.CachedForward = engine.CachedForward, counting
    try:
        t0 = time.perf_counter()
        groups = engine.rollout_groups(*args, **kwargs)
        total_s = time.perf_counter() - t0
    finally:
        engine.CachedForward = original
    stats = {k: sum(f.stats[k] for f in made) for k in made[0].stats} if made else {}
    return groups, {**stats, "total_s": total_s, "prompt_tokens": stats.get("flush_fed_tokens", 0),
                    "generated_tokens": sum(sum(t.assistant_mask) for g in groups for t in g.trajectories)}


@contextlib.contextmanager
def scripted_policy(turns, fill_logprobs=True):
    """A policy scripted from outside the engine, for a model that never writes a tool call by itself
    (tests, bench fit3b): in the rollouts under this context, row i of each engine._start_rows call
    (task-major: task g, sample j is row g*n + j) begins its turn k with the text turns[i][k] instead
    of what it would sample, and samples on from there. The scripted tokens' log-probs are the
    policy's: filled in after the rollout from one forward over each trajectory, at the sampling's
    temperature and weight precision (a sampled token's come from the engine's cache, as ever).
    fill_logprobs=False leaves them the log-probs of the tokens sampled in their place: for a memory
    or speed figure whose rollouts are not trained on."""
    real_start, real_take, real_rollout = engine._start_rows, engine._take_token, engine.rollout_groups
    scripted = []       # (row, its turns as token ids, the indices of the tokens it was given)

    def start_rows(tasks, n, tokenizer, limits, make_env):
        rows = real_start(tasks, n, tokenizer, limits, make_env)
        scripted.extend((row, [agentrl.encode(tokenizer, text) for text in texts], [])
                        for row, texts in zip(rows, turns))
        return rows

    def take_token(row, token, logprob, *args):
        for r, script, given in scripted:
            done = len(row.token_ids) - row.turn_start       # tokens of this turn so far
            if r is row and row.num_turns < len(script) and done < len(script[row.num_turns]):
                token = script[row.num_turns][done]
                given.append(len(row.token_ids))
        return real_take(row, token, logprob, *args)

    def rollout_groups(model, tokenizer, tasks, n, sampling=engine.Sampling(), *args, **kwargs):
        groups = real_rollout(model, tokenizer, tasks, n, sampling, *args, **kwargs)
        for row, _, given in scripted:
            if given and fill_logprobs:
                logprobs = policy_logprobs(model, row.token_ids, sampling)
                for i in given:
                    row.logprobs[i] = logprobs[i]     # the trajectory's sampled_logprobs is this list
        scripted.clear()
        return groups

    with mock.patch.object(engine, "_start_rows", start_rows), \
            mock.patch.object(engine, "_take_token", take_token), \
            mock.patch.object(engine, "rollout_groups", rollout_groups):
        yield


@torch.no_grad()
def policy_logprobs(model, token_ids, sampling) -> list[float]:
    """log p_T(x_t | x_<t) of the policy `sampling` samples from (its temperature, greedy: 1; its
    weight precision), from one plain forward over the whole sequence: (T,) floats, 0 at t = 0."""
    was_training = model.training
    model.eval()
    ids = torch.tensor([token_ids], device=model.device)
    with lora.lora_merged(model, sampling.weight_dtype):
        hidden = model.base_model(input_ids=ids).last_hidden_state[0]                    # (T, H)
    head = model.get_output_embeddings().weight
    logits = torch.nn.functional.linear(hidden.to(sampling.weight_dtype or head.dtype),
                                        head.to(sampling.weight_dtype or head.dtype)).float()  # (T, V)
    model.train(was_training)
    logp = torch.log_softmax(logits / (1.0 if sampling.greedy else sampling.temperature), dim=-1)
    return [0.0] + logp[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()
