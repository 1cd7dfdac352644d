"""What every benchmark shares: fresh processes, resident memory, timing, a random update batch,
and reading a train.py run's metrics back.

A measurement that must not inherit another's allocator state (peak memory) runs in a fresh
process, `python -m bench COMMAND ... --child VARIANT`, which prints its figures as one JSON line.
"""
import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

import agentrl
import kvcache
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
    on the values. Returns (trajectories, advantages); agentrl.make_group(None, trajectories) makes
    them a group (each one node: no turns recorded, nothing shared), grpo_step's batch with the advantages."""
    g = torch.Generator().manual_seed(seed)
    trajectories = [SimpleNamespace(token_ids=torch.randint(0, vocab, (length,), generator=g).tolist(),
                                    assistant_mask=[0] * prompt + [1] * (length - prompt),
                                    sampled_logprobs=[0.0] * prompt + [-math.log(vocab)] * (length - prompt),
                                    turns=[], messages=[], stop_reason="max_context")
                    for _ in range(n)]
    return trajectories, [1.0 if i % 2 else -1.0 for i in range(n)]


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
    """agentrl.rollout_groups(*args, **kwargs) with its forwards counted (CountingForward): returns
    (groups, stats), stats with the counters, total_s, prompt_tokens (the flushes' real tokens) and
    generated_tokens (sampled)."""
    made = []

    def counting(model, dtype=None):
        made.append(CountingForward(model, dtype))
        return made[-1]
    original, agentrl.CachedForward = agentrl.CachedForward, counting
    try:
        t0 = time.perf_counter()
        groups = agentrl.rollout_groups(*args, **kwargs)
        total_s = time.perf_counter() - t0
    finally:
        agentrl.CachedForward = original
    stats = {k: sum(f.stats[k] for f in made) for k in made[0].stats} if made else {}
    return groups, {**stats, "total_s": total_s, "prompt_tokens": stats.get("flush_fed_tokens", 0),
                    "generated_tokens": sum(sum(t.assistant_mask) for g in groups for t in g.trajectories)}
