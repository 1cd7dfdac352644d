"""The benchmarks behind every figure BENCHMARKS.md and RESULTS.md quote: `python -m bench COMMAND`.

    python -m bench rollout        # our rollout engine vs re-tokenize + generate() per turn; the floor
    python -m bench cache          # one decode step: our KVCache vs DynamicCache; fp32 vs bf16 keys and values
    python -m bench judge          # judge prompt tokens: naive vs RULER-style vs the group's tree
    python -m bench judge-server   # the --judge http path against llama.cpp's server (if installed)
    python -m bench memory         # peak memory of one GRPO update: chunked vs unchunked log-probs
    python -m bench memory --shape qwen2.5-3b   # does a 3B model train on a 16 GB T4? (bench/fit3b.py)
    python -m bench update         # one GRPO step on a group: each trajectory alone vs its tree in one forward
    python -m bench eval --adapter runs/default   # greedy evaluation: batching, 2 processes, bf16; the floor
    python -m bench learn          # held-out accuracy, paired: an SFT start, then GRPO, RFT and SFT for the same time
    python -m bench credit --grpo-steps 4   # GRPO vs step credit, on chains and on branched groups, paired
    python -m bench sweep          # the RL lr and the LoRA rank, chosen on a validation slice of train
    python -m bench pair runs/sft runs/grpo_s0 [runs/grpo_s1]   # evaluations task by task: the difference, its interval
    python -m bench scale          # train.py steps per minute: 1 process vs 2 (torchrun); rollout vs the rest
    python -m bench allocator      # a short run's peak memory and phase times: activations kept vs recomputed
    python -m bench gpu            # the GPU check: the 3B shape under a T4's memory, then real training steps
    python -m bench footprint [--baseline DIR]   # whole train.py runs: phase times, summed PSS of every process
    python -m bench accelerations --adapter DIR  # one default GRPO step with each acceleration taken out in turn
    python -m bench sql            # the SQL tool's worker process against the same queries in-process
    python -m bench trl [--adapter DIR]   # one GRPO step: ours vs TRL's GRPOTrainer (pip install trl peft)

`--variants a,b` (update, eval, scale, credit) runs a subset, the first the baseline. learn, sweep, scale and
allocator pass any flag they do not know to train.py, for every run (e.g. `--lr 5e-4`). Each
benchmark measures the baseline and ours in the same run and prints them side by side with the
ratio: the machines are shared and noisy, so only ratios are worth quoting.
"""
import argparse
import importlib

COMMANDS = {   # name: (module of bench/, function, one line of help)
    "rollout": ("rollout", "bench_rollout", "our rollout engine vs re-tokenize + generate() per turn; the floor"),
    "cache": ("rollout", "bench_cache", "one decode step: our KVCache vs DynamicCache; fp32 vs bf16 keys, values"),
    "judge": ("judge", "bench_judge", "judge prompt tokens per group: naive vs RULER-style vs the tree"),
    "judge-server": ("judge", "bench_judge_server", "the --judge http path against llama.cpp's server (if installed)"),
    "memory": ("update", "bench_memory", "peak memory of one GRPO update: chunked vs unchunked log-probs"),
    "update": ("update", "bench_update", "one GRPO step on a group: each trajectory alone vs the tree once; checkpointing"),
    "eval": ("rollout", "bench_eval", "greedy evaluation of a held-out split: batching, processes, bf16"),
    "learn": ("learn", "bench_learn", "held-out accuracy, paired: an SFT start, then GRPO, RFT and more SFT"),
    "credit": ("learn", "bench_credit", "step credit on chains and on branched groups against GRPO, paired"),
    "sweep": ("learn", "bench_sweep", "the RL lr and the LoRA rank, chosen on a validation slice of train"),
    "pair": ("learn", "bench_pair", "evaluations compared task by task: the difference and its interval"),
    "scale": ("update", "bench_scale", "train.py steps per minute: 1 process vs 2 (torchrun)"),
    "allocator": ("update", "bench_allocator", "a short run's peak memory, phase times: activations kept vs recomputed"),
    "gpu": ("fit3b", "bench_gpu", "the GPU check: the 3B shape under a T4's memory, then real training steps"),
    "reading": ("reading", "bench_reading", "the lines one GRPO step reads, helpers included: README's table"),
    "footprint": ("footprint", "bench_footprint", "a whole train.py run's phase times and summed PSS, every process"),
    "accelerations": ("accelerations", "bench_accelerations",
                      "one default GRPO step with each acceleration taken out in turn: its gain"),
    "sql": ("sql", "bench_sql", "the SQL tool's worker process against the same queries in-process"),
    "trl": ("trl", "bench_trl", "one GRPO step, the same agent and tasks: ours against TRL's GRPOTrainer"),
    "train-run": ("update", "train_run", None),   # internal: a train.py run with scripted rewards (scale, allocator)
}
TRAIN_FLAGS = {"learn", "credit", "sweep", "scale", "allocator", "train-run", "footprint"}   # these pass unknown flags on to train.py
PUBLIC = " ".join(name for name, (_, _, line) in COMMANDS.items() if line)

OPTIONS = [   # (flag, the commands that take it, argparse keywords)
    ("paths", "pair", dict(nargs="*", help="evaluations, before and then after (run or --eval-only folders; "
                                       "RUN@STEP: a run's evaluation at that step)")),
    ("--shape", "memory", dict(choices=["smollm2-135m", "qwen2.5-3b"], default="smollm2-135m",
                               help="the embedded model, or the Qwen2.5-3B shape, random weights (the T4 fit)")),
    ("--model", "accelerations", dict(default=None, help="HF id or folder (default: the embedded model)")),
    ("--adapter", "rollout judge judge-server eval scale accelerations trl",
     dict(default=None, help="the embedded model with this saved adapter (or run folder)")),
    ("--split", "eval", dict(default="test", help="the held-out split to evaluate")),
    ("--tasks", "eval", dict(type=int, default=0, help="the split's first N tasks (0: all)")),
    ("--cwd", "footprint", dict(default=None, help="the checkout whose train.py runs (default: this one)")),
    ("--baseline", "footprint", dict(default=None, help="a checkout run first, the same flags: the baseline")),
    ("--tokenizer", "gpu memory", dict(default=None, help="3B shape: a tokenizer folder (default: the embedded one)")),
    ("--eval-size", "learn credit sweep", dict(type=int, default=0, help="held-out (sweep: val) tasks per split (0: all)")),
    ("--sft-steps", "learn credit sweep trl", dict(type=int, default=48, help="warm-start steps of the start (sweep: each rank's)")),
    ("--grpo-steps", "learn credit sweep", dict(type=int, default=8, help="GRPO and RFT steps (sweep: of each run)")),
    ("--arm-splits", "credit", dict(default="test,test_schema", help="the held-out splits the arms evaluate on")),
    ("--grpo-seeds", "learn credit", dict(type=int, default=2, help="GRPO runs, seeds --seed, --seed + 1, ...: their mean")),
    ("--pass-tasks", "learn", dict(type=int, default=24, help="tasks per held-out split for the start's pass@k (0: none)")),
    ("--pass-k", "learn", dict(type=int, default=8, help="samples per task for pass@k")),
    ("--sweep-lrs", "sweep", dict(default="1e-4,3e-4,1e-3", help="the RL learning rates, comma-separated")),
    ("--sweep-ranks", "sweep", dict(default="4,16", help="the LoRA ranks, comma-separated")),
    ("--variants", "update eval scale credit accelerations", dict(default=None, help="a comma-separated subset of the variants (default: all)")),
    ("--trained-groups", "scale train-run",
     dict(type=int, default=0, help="groups of a step (each process's) the scripted rewards train (0: all)")),
    ("--seed", PUBLIC, dict(type=int, default=0, help="random seed")),
    ("--by-def", "reading", dict(action="store_true", help="every definition reached, with its lines")),
    ("--child", "memory update eval trl", dict(default=None, help=argparse.SUPPRESS)),   # a fresh process: this variant only
]


def build_parsers():
    """The parser of `python -m bench`, and {command: its subparser}."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of those above")
    subparsers = {}
    for name, (_, _, line) in COMMANDS.items():      # listed in the description above, train-run not
        subparsers[name] = commands.add_parser(name, description=line, allow_abbrev=False, epilog=(
            "Any other flag goes to train.py, for every run." if name in TRAIN_FLAGS else None))
        for flag, takers, keywords in OPTIONS:
            if name in takers.split():
                subparsers[name].add_argument(flag, **keywords)
    return parser, subparsers


def main(argv=None):
    parser, subparsers = build_parsers()
    args, train_flags = parser.parse_known_args(argv)
    if train_flags and args.command not in TRAIN_FLAGS:
        subparsers[args.command].error(f"unrecognized arguments: {' '.join(train_flags)}")
    args.train_flags = train_flags
    module, function, _ = COMMANDS[args.command]
    if args.command == "memory" and args.shape == "qwen2.5-3b":   # the 3B fit on a T4: a question of its own
        module, function = "fit3b", "bench_memory_3b"
    return getattr(importlib.import_module(f"bench.{module}"), function)(args)


if __name__ == "__main__":
    main()
