"""A whole train.py run's time and memory, every process counted: `python -m bench footprint`.

    python -m bench footprint --baseline ../old-main --eval-size 64 --sft-steps 24   # both, side by side
    python -m bench footprint --eval-size 64 --sft-steps 24                          # this checkout alone

`/usr/bin/time -v` reports the largest single process; during an evaluation the parent and its
forked evaluators hold memory together, and they share pages (the weights), so their resident
sets overcount. This runs `python train.py` in `--cwd` (default: here) with the flags it does not
know, samples the summed proportional set size (PSS, /proc/PID/smaps_rollup: a shared page
counted once, split between its holders) of the run's whole process tree every 2 seconds, and
reads the phase times from the run's metrics.jsonl: the SFT steps, the GRPO steps (rollout and
the rest), and each evaluation after the first (the time from the record before it to its own;
the first also holds the model's loading); an --eval-only run has no phases, its time and peak
alone. Linux only.
"""
import json
import os
import shutil
import subprocess
import sys
import time

from bench.common import mean_or_nan, run_records
from parallel import tree_pss_kib


def footprint(cwd, train_flags) -> dict:
    """One `python train.py` run in checkout `cwd`: its phase times and the peak summed PSS."""
    out = os.path.join(cwd, "runs", "bench_footprint")
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "train.py", *train_flags, "--out", out]
    os.makedirs(os.path.dirname(out), exist_ok=True)
    print(f"running in {cwd}: {' '.join(argv[1:])} (its output: {out}.log)", flush=True)
    t0, peak, samples = time.perf_counter(), 0, []   # samples: (seconds, PSS KiB, metrics lines so far)
    with open(out + ".log", "w") as log:
        child = subprocess.Popen(argv, cwd=cwd, stdout=log)
    metrics = os.path.join(out, "metrics.jsonl")
    while child.poll() is None:
        pss = tree_pss_kib(child.pid)
        lines = sum(1 for _ in open(metrics)) if os.path.exists(metrics) else 0
        samples.append((time.perf_counter() - t0, pss, lines))
        peak = max(peak, pss)
        time.sleep(2.0)
    if child.returncode:
        raise SystemExit(f"footprint: train.py failed in {cwd} (exit {child.returncode})")
    records = run_records(out) if os.path.exists(metrics) else []     # --eval-only writes eval_only.json
    # an evaluation's time: from the moment the record before it appeared to the moment its own did
    appeared = {}
    for seconds, _, lines in samples:
        for k in range(1, lines + 1):
            appeared.setdefault(k, seconds)
    steps = [r for r in records if "reward_mean" in r]
    # every evaluation but the first, whose time holds the model's load
    evals = [appeared[k] - appeared[k - 1] for k, r in enumerate(records, 1)
             if k > 1 and "sft_step" not in r and "reward_mean" not in r and k in appeared]
    return {"run_s": time.perf_counter() - t0, "peak_pss_gib": peak / 2**20,
            "sft_step_s": mean_or_nan([r["time_step"] for r in records if "sft_step" in r]),
            "grpo_step_s": mean_or_nan([r["time_step"] for r in steps]),
            "rollout_s": mean_or_nan([r["time_rollout"] for r in steps]),
            "evaluation_s": mean_or_nan(evals), "evaluations": len(evals)}


def bench_footprint(args):
    """--baseline DIR first, then --cwd (default: here), the same flags, one after the other;
    both printed side by side with the ratio ours / baseline."""
    runs = {}
    if args.baseline:
        runs["baseline"] = footprint(os.path.abspath(args.baseline), args.train_flags)
    runs["ours"] = footprint(os.path.abspath(args.cwd or "."), args.train_flags)
    print(json.dumps(runs))
    print(f"{'':<14}" + "".join(f"{name:>12}" for name in runs) + ("       ratio" if len(runs) == 2 else ""))
    for key in ("run_s", "peak_pss_gib", "sft_step_s", "grpo_step_s", "rollout_s", "evaluation_s"):
        values = [r[key] for r in runs.values()]
        ratio = f"{values[1] / values[0]:>11.2f}x" if len(values) == 2 and values[0] else ""
        print(f"{key:<14}" + "".join(f"{v:>12.2f}" for v in values) + ratio)
