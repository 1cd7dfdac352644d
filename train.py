"""Train a tool-using SQL agent with GRPO: the loop that `python train.py` runs.

    python train.py                                  # embedded model + data, sized for this machine
    python train.py --steps 50 --group-size 8        # any knob below is one flag away
    python train.py --resume --out runs/default      # continue a killed run from its last checkpoint
    python train.py --eval-only --adapter runs/default/final   # evaluate a trained adapter
    python train.py --report runs/default            # rebuild the run's report.html from its folder
    torchrun --nproc_per_node=4 train.py --groups-per-step 16  # data parallel over 4 GPUs (parallel.py)

Before the loop, on a fresh run: evaluate the base model (on the embedded data, on two held-out
splits: test, new questions on the schemas trained on, and test_schema, the same questions on a
schema never trained on), then (--sft-steps) a supervised warm start on gold demonstrations
(--demos), evaluate again, and checkpoint it as step 0. One step of the loop,
the whole algorithm:

    1) sample tasks      a few questions from the train split, most of them from the frontier:
                         tasks whose last group came out mixed, some right and some wrong
                         (groups that are all right or all wrong carry no signal); the rest
                         explore, weighted toward tiers the agent gets right about half the time
    2) rollouts          N trajectories per task, sampled with the current LoRA policy; with
                         --sample-rounds, more tasks until enough groups came out mixed (DAPO)
    3) reward            reward = judge_score + bonus * correct (+ partial or execution credit, options)
                         (one visible line, in score_groups)
    4) advantages        normalized within each group (grpo.batch_from_groups); all-equal groups
                         are skipped and counted, and so are rows the rollout cut on non-finite
                         logits (fp16 overflow)
    5) update            clipped policy-gradient steps on the LoRA parameters only: --epochs
                         passes over the batch, --minibatches steps each (grpo.grpo_update);
                         or, as the control, --update rft: as many supervised steps on the
                         step's correct rollouts (rejection-sampling fine-tuning, grpo.rft_update)
    6) log               one `key=value | ...` line, metrics.jsonl, trajectories/step_XXXX.jsonl,
                         the plot and report.html (report.py)
    7) eval/checkpoint   greedy held-out accuracy every --eval-every steps; adapter + optimizer +
                         RNG state written atomically, so a killed run resumes with nothing lost

Deliberate simplifications, and why they are safe:
- Per-step seeds are derived from (--seed, step), so a resumed run samples exactly the tasks and
  tokens the uninterrupted run would have: resume needs no sampler state beyond the step count,
  the per-tier success rates and the per-task pass rates, which the checkpoint stores.
"""
import argparse
import contextlib
import ctypes
import errno
import json
import math
import os
import random
import re
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record as torchrun_reports_errors
from tqdm import tqdm

import agentrl
import grpo
import judge as judge_lib
import lora
import parallel
import report
import sql_env
from files import atomic_folder, atomic_path, read_json, read_jsonl, write_text_atomic

LEAN_MMAP_THRESHOLD = 1 << 20   # bytes: a --malloc-mmap-threshold that trades time for memory (bench.py allocator)
DRAFT_DEFAULT = 2               # --draft-tokens (README, "Drafts")
EVAL_PROCESSES_DEFAULT = 1      # --eval-processes
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}   # --eval-dtype, --rollout-dtype


# ----------------------------------------------------------------------------- arguments
class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default after its help."""


def parse_args(argv=None):
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    # model and LoRA
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="HF hub id or local folder; None: the embedded SmolLM2-135M-Instruct")
    g.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    g.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha (scale = alpha / r)")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the LoRA input")
    g.add_argument("--lora-targets", default=",".join(lora.DEFAULT_TARGETS), help="comma-separated linear layer names to adapt")
    g.add_argument("--adapter", default=None, help="start from (or, with --eval-only, evaluate) this saved adapter folder")
    # data
    g = p.add_argument_group("data")
    g.add_argument("--data", default="default", help="'default' (embedded), or a Spider or BIRD folder")
    g.add_argument("--train-split", default="train",
                   help="split to train on (embedded set: train; train_mixed or train_wide on 32 schema renderings)")
    g.add_argument("--eval-split", default=None,
                   help="held-out split(s) to evaluate on, comma-separated; the first is logged as eval_*, each other "
                        "under its own name (test_schema_accuracy, ...). Default: test,test_schema (new wordings and "
                        "values on the training schemas; the same questions on a schema never trained on), or dev "
                        "for Spider/BIRD. val: the validation slice of train (sql_env.VAL_SIZE tasks), then left out "
                        "of training")
    # rollouts
    g = p.add_argument_group("rollouts")
    g.add_argument("--steps", type=int, default=40 if on_gpu else 4, help="GRPO optimizer steps")
    g.add_argument("--groups-per-step", type=int, default=8 if on_gpu else 2, help="tasks per step")
    g.add_argument("--group-size", type=int, default=8, help="trajectories per task (the N of GRPO)")
    g.add_argument("--max-turns", type=int, default=4, help="assistant turns per trajectory")
    g.add_argument("--max-new-tokens", type=int, default=256 if on_gpu else 128, help="sampled tokens per turn")
    g.add_argument("--max-context", type=int, default=4096 if on_gpu else 2048, help="tokens per trajectory")
    g.add_argument("--temperature", type=float, default=1.0 if on_gpu else 0.5,
                   help="sampling temperature of the rollouts (0.5 on a CPU: after the short warm start, sampling at "
                        "1.0 breaks most queries and leaves almost every group all wrong; README, Results)")
    g.add_argument("--target-entropy", type=float, default=0.0,
                   help="steer the temperature, step by step, toward this mean -log p of the sampled tokens (nats; "
                        "--temperature is the first step's); 0: a constant --temperature")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    g.add_argument("--draft-tokens", type=int, default=DRAFT_DEFAULT,
                   help="tokens a row guesses ahead from its own context and checks in the same forward, in rollouts "
                        "and evaluations (prompt lookup: the same distribution, greedy the same tokens; agentrl.Sampling.draft); "
                        "0: one token a forward")
    g.add_argument("--rollout-dtype", choices=sorted(WEIGHT_DTYPES), default="fp32",
                   help="on a CPU, the weights' precision while sampling rollouts: bf16 reads half the bytes; the "
                        "log-probs recorded are then the bf16 policy's, and the update's ratio, the fp32 policy's "
                        "over them, corrects for having sampled from it (grpo.py; kl_old at the first step is the "
                        "gap). Ignored on a GPU, where the model already runs in half precision")
    g.add_argument("--frontier-share", type=float, default=0.75,
                   help="share of a step's tasks drawn from the frontier (train tasks whose last group was mixed); "
                        "the rest explore by tier. 0: tier sampling alone")
    g.add_argument("--sample-rounds", type=int, default=1,
                   help="dynamic sampling (DAPO): roll out up to this many rounds of --groups-per-step new tasks in a "
                        "step, stopping once --groups-per-step groups came out mixed (some right, some wrong); every "
                        "mixed group is trained on. 1: one round, whatever came out")
    # judge and reward
    g = p.add_argument_group("judge and reward")
    g.add_argument("--judge", choices=["auto", "local", "http", "none"], default="auto",
                   help="relative judge; auto = local on a GPU, none on a CPU (rewards: the correctness bonus alone)")
    g.add_argument("--judge-model", default=None, help="local: HF id/folder (default: the policy's base model); http: model name")
    g.add_argument("--judge-url", default=None, help="http: OpenAI-compatible base URL (default: $OPENAI_BASE_URL)")
    g.add_argument("--judge-fallback", choices=["local", "none", "error"], default="error",
                   help="what to do when the http judge endpoint is unreachable at start")
    g.add_argument("--rubric", default=None, help="file with a rubric replacing the default one")
    g.add_argument("--bonus", type=float, default=1.0, help="reward added for an execution-correct answer")
    g.add_argument("--partial-credit", type=float, default=0.0,
                   help="reward added times the overlap of the submitted query's result rows with the gold result "
                        "(Jaccard; 0 when nothing ran): a denser signal that needs no gold SQL text. 0: off")
    g.add_argument("--exec-credit", type=float, default=0.0,
                   help="reward added when the submitted query runs without an error (every table and column it "
                        "names exists): signal in groups that are all wrong, for reading the schema; needs no gold. 0: off")
    # supervised warm start (before GRPO)
    g = p.add_argument_group("supervised warm start")
    g.add_argument("--sft-steps", type=int, default=0 if on_gpu else 48,
                   help="SFT steps on gold demonstrations (see --demos) before RL; 0: none")
    g.add_argument("--demos", choices=list(agentrl.DEMO_KINDS), default="look",
                   help="the warm start's demonstrations: look = list_tables, describe_table on the tables the gold "
                        "query reads (as many as --max-turns allows), run it, submit it; plain = list_tables, run, "
                        "submit; recover = list_tables, the gold query with a table name wrong, its error, the right "
                        "query, submit (the wrong turn is not imitated)")
    g.add_argument("--sft-batch-size", type=int, default=2,
                   help="demonstrations per SFT step (2: more steps from fewer demonstrations than 4, as "
                        "accurate, and far fewer failing submissions; README, the default run)")
    g.add_argument("--sft-lr", type=float, default=1e-3, help="learning rate of the warm start")
    # loss and optimization
    g = p.add_argument_group("loss and optimization")
    g.add_argument("--update", choices=["grpo", "rft"], default="grpo",
                   help="grpo: the clipped policy gradient; rft: rejection-sampling fine-tuning, supervised steps on the "
                        "step's correct rollouts, epochs x minibatches of them as GRPO takes (the control that needs, "
                        "like GRPO, only answers)")
    g.add_argument("--lr", type=float, default=1e-4 if not on_gpu else 5e-5, help="AdamW learning rate of the RL steps")
    g.add_argument("--epochs", type=int, default=1, help="passes over each batch of rollouts (PPO epochs)")
    g.add_argument("--minibatches", type=int, default=1,
                   help="optimizer steps per pass: each batch of rollouts gets epochs x minibatches steps")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--loss", choices=["token", "sequence", "constant"], default="token",
                   help="aggregation: token = DAPO, sequence = GRPO, constant = Dr. GRPO")
    g.add_argument("--no-std-scaling", action="store_true", help="advantages not divided by the group std (Dr. GRPO)")
    g.add_argument("--clip-low", type=float, default=0.2, help="ratio clip below 1 - clip_low")
    g.add_argument("--clip-high", type=float, default=0.28, help="ratio clip above 1 + clip_high (DAPO clip-higher)")
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="k3 KL penalty to the policy RL started from (after the warm start, or --adapter)")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping")
    g.add_argument("--micro-batch-size", type=int, default=4 if on_gpu else 1,
                   help="sequences per forward/backward (on CPU one at a time was faster, and 2.5x leaner, than 4)")
    g.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute each layer in the backward instead of keeping its activations: SFT steps "
                        "1.15x and GRPO updates 1.5x as long, the run's peak 0.63x (bench.py allocator)")
    g.add_argument("--group-segments", action=argparse.BooleanOptionalAction, default=True,
                   help="forward the tokens a group's rollouts share after the prompt (the same first tool calls and "
                        "results) once per group in the update (GRPO's or RFT's), not once per rollout: the same gradient "
                        "(grpo.prefix_families; README, Benchmarks: bench.py scale). Off with --kl-coef > 0")
    g.add_argument("--malloc-mmap-threshold", type=int, default=0, metavar="BYTES",
                   help=f"glibc: blocks of this size or more get pages of their own, handed back when freed; "
                        f"{LEAN_MMAP_THRESHOLD} lowers the peak for a slower run (bench.py allocator). "
                        f"0: glibc's own setting")
    # evaluation and output
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval-every", type=int, default=10 if on_gpu else 0, help="evaluate every K steps (0: only before and after training)")
    g.add_argument("--eval-size", type=int, default=0 if on_gpu else 32, help="held-out tasks per evaluation (0: all); the same ones whatever --seed")
    g.add_argument("--eval-processes", type=int, default=EVAL_PROCESSES_DEFAULT,
                   help="on a CPU, evaluate in this many processes forked from the run, one thread each, each a share "
                        "of the tasks (parallel.forked; README, Benchmarks: bench.py eval); 1: in the run's own process. "
                        "Ignored on a GPU; under torchrun, per process")
    g.add_argument("--eval-dtype", choices=sorted(WEIGHT_DTYPES), default="fp32",
                   help="on a CPU, the weights' precision in evaluations (the greedy episodes only, never the rollouts "
                        "GRPO learns from): bf16 reads half the bytes and is faster on a CPU with bf16 instructions, "
                        "and may change a few greedy outcomes (README, Benchmarks: evaluation in bf16). Ignored on a GPU, "
                        "where the model already runs in half precision")
    g.add_argument("--eval-only", action="store_true",
                   help="evaluate --model/--adapter on --eval-split, write the record and episodes to --out, and exit")
    g.add_argument("--start-eval", action=argparse.BooleanOptionalAction, default=True,
                   help="evaluate the starting model before training (bench.py learn's arms share one)")
    g.add_argument("--checkpoint-every", type=int, default=1, help="checkpoint every K steps")
    g.add_argument("--out", default="runs/default", help="run folder")
    g.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    g.add_argument("--seed", type=int, default=0, help="seeds tasks, sampling and LoRA init")
    g.add_argument("--report", metavar="RUN", default=None, help="rebuild RUN/report.html from the run folder and exit")
    # data parallel: only under torchrun (parallel.py)
    g = p.add_argument_group("data parallel (under torchrun)")
    g.add_argument("--dist-timeout", type=float, default=1800,
                   help="seconds a process waits for the others at a collective before it stops the job")
    args = p.parse_args(argv)

    if args.sft_steps < 0 or args.sft_batch_size < 1:
        p.error("--sft-steps must be >= 0 and --sft-batch-size >= 1")
    if args.sft_steps and args.max_turns < agentrl.DEMO_KINDS[args.demos]:
        p.error(f"--sft-steps: the {args.demos} demonstrations take {agentrl.DEMO_KINDS[args.demos]} turns; "
                f"use --max-turns >= {agentrl.DEMO_KINDS[args.demos]} (or other --demos)")
    if args.steps < 0:
        p.error(f"--steps must be >= 0, got {args.steps}")
    positive = ["groups_per_step", "group_size", "max_turns", "max_new_tokens", "max_context", "micro_batch_size", "lora_r",
                "epochs", "minibatches", "sample_rounds"]
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.group_size < 2 and not args.eval_only:
        p.error("--group-size must be >= 2: GRPO compares trajectories within a group")
    if not 0 <= args.frontier_share <= 1 or args.partial_credit < 0 or args.exec_credit < 0:
        p.error("--frontier-share must be in [0, 1], --partial-credit and --exec-credit >= 0")
    if not 0 < args.temperature <= 10 or not 0 < args.top_p <= 1:
        p.error("--temperature must be in (0, 10] and --top-p in (0, 1]")
    if args.target_entropy < 0:
        p.error("--target-entropy must be >= 0 (0: a constant --temperature)")
    if not 0 <= args.draft_tokens <= 16:
        p.error("--draft-tokens must be in [0, 16]")
    if not 1 <= args.eval_processes <= 64:
        p.error("--eval-processes must be in [1, 64]")
    if args.data != "default" and not os.path.isdir(args.data):
        p.error(f"--data {args.data!r}: no such folder (expected 'default' or a Spider/BIRD folder)")
    if args.adapter and not os.path.isfile(os.path.join(args.adapter, "adapter_config.json")):
        p.error(f"--adapter {args.adapter!r}: no adapter_config.json there")
    if args.rubric and not os.path.isfile(args.rubric):
        p.error(f"--rubric {args.rubric!r}: no such file")
    if args.dist_timeout <= 0:
        p.error(f"--dist-timeout must be > 0, got {args.dist_timeout}")
    if args.malloc_mmap_threshold < 0:
        p.error(f"--malloc-mmap-threshold must be >= 0 bytes (0: glibc's own), got {args.malloc_mmap_threshold}")
    if args.eval_split is None:
        args.eval_split = "test,test_schema" if args.data == "default" else "dev"
    args.eval_splits = [split.strip() for split in args.eval_split.split(",") if split.strip()]
    if not args.eval_splits or len(set(args.eval_splits)) < len(args.eval_splits):
        p.error(f"--eval-split {args.eval_split!r}: name one or more different splits, comma-separated")
    held_out = "val" in args.eval_splits
    if held_out and args.train_split != "train" and not args.eval_only:
        p.error(f"--eval-split val is a slice of the train split, held out of training: it needs --train-split train, "
                f"not {args.train_split!r}")
    if held_out and args.adapter and trained_with_val_held_out(os.path.dirname(os.path.normpath(args.adapter))) is False:
        p.error(f"--adapter {args.adapter!r} was trained on the val tasks (its run did not evaluate on val): "
                f"its val scores would be training scores")
    if args.resume and not args.eval_only and trained_with_val_held_out(args.out) not in (None, held_out):
        p.error(f"--resume: the run in {args.out!r} was started {'without' if held_out else 'with'} val among its "
                f"--eval-split, so it {'trained on' if held_out else 'held out'} the val tasks: resume it with the same --eval-split")
    return args


def trained_with_val_held_out(run_dir):
    """Whether the train.py run in run_dir left split val out of its training (it evaluated on val):
    True or False from its config.json; None where there is none (an adapter from elsewhere)."""
    try:
        config = read_json(os.path.join(run_dir, "config.json"))
    except (OSError, ValueError):
        return None
    return "val" in config.get("eval_splits", [])


# ----------------------------------------------------------------------------- files
def append_jsonl(path, record):
    if not parallel.is_main():   # every writer of the run folder: rank 0 only
        return
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def save_checkpoint(run_dir, model, optimizer, scaler, step, task_stats, keep=2):
    """adapter (PEFT layout) + optimizer + scaler + RNG + step into checkpoints/step_XXXX, written
    as one folder that appears whole (files.atomic_folder), then point `latest` at it. Rank 0 only."""
    if not parallel.is_main():
        return
    final = os.path.join(run_dir, "checkpoints", f"step_{step:04d}")
    with atomic_folder(final) as tmp:
        lora.save_adapter(model, tmp)
        state = {"step": step, "optimizer": optimizer.state_dict(), "task_stats": task_stats,
                 "scaler": scaler.state_dict(), "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    write_text_atomic(os.path.join(run_dir, "checkpoints", "latest"), os.path.basename(final))
    finished = sorted(int(name[5:]) for name in os.listdir(os.path.dirname(final)) if re.fullmatch(r"step_\d+", name))
    for old in finished[:-keep]:  # only the newest `keep` checkpoints stay on disk
        shutil.rmtree(os.path.join(run_dir, "checkpoints", f"step_{old:04d}"), ignore_errors=True)
    return final


def load_checkpoint(run_dir, model, optimizer, scaler):
    latest = os.path.join(run_dir, "checkpoints", "latest")
    if not os.path.isfile(latest):
        raise SystemExit(f"--resume: no checkpoint in {run_dir} (expected {latest}); start without --resume")
    folder = os.path.join(run_dir, "checkpoints", Path(latest).read_text().strip())
    lora.load_adapter(model, folder)
    state = torch.load(os.path.join(folder, "trainer_state.pt"), weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    if state["scaler"]:          # empty when saved by a disabled scaler (no fp16): nothing to restore
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state["step"], state["task_stats"], folder


def truncate_metrics(path, last_step):
    """On resume, drop records of steps after the checkpoint: they are about to be redone. A line
    cut short (a run killed mid-write, a full disk) cannot be read back, and goes too."""
    if not os.path.isfile(path):
        return

    def step_of(line):
        try:
            return json.loads(line).get("step", 0)
        except json.JSONDecodeError:
            return math.inf

    with open(path) as f:
        kept = [line for line in f if step_of(line) <= last_step]
    write_text_atomic(path, "".join(kept))


# ----------------------------------------------------------------------------- task sampling
def sample_tasks(tasks_by_tier, task_stats, k, rng, frontier_share=0.75, exclude=()):
    """Pick k tasks: a share from the frontier, the others exploring by tier.

    A group whose trajectories are all right or all wrong has zero advantage and teaches nothing;
    a task whose last group came out mixed (0 < pass rate < 1) is where the signal is. So each pick
    is, with probability frontier_share, a frontier task (weight p(1-p)); otherwise a tier (weight
    p(1-p) + a floor, p its running success rate) and a task in it, so that every task is seen now
    and then and a solved or hopeless one gets another chance. No task is picked twice in a step
    while its tier has others, nor one in `exclude` (the tasks a step already rolled out).
    task_stats: {"tiers": {tier: running success rate}, "tasks": {task id: last group's pass rate}}
    (and, with --target-entropy, "temperature": the next step's).
    """
    by_id = {task.id: task for tier_tasks in tasks_by_tier.values() for task in tier_tasks}
    frontier = {tid: p for tid, p in sorted(task_stats["tasks"].items())
                if 0 < p < 1 and tid in by_id and tid not in exclude}
    tiers = sorted(tasks_by_tier)
    tier_rates = [task_stats["tiers"].get(tier, 0.5) for tier in tiers]
    tier_weights = [p * (1 - p) + 0.05 for p in tier_rates]    # peaks at p = 0.5, where a group is most often mixed
    chosen = []
    for _ in range(k):
        if frontier and rng.random() < frontier_share:
            tid = rng.choices(list(frontier), weights=[p * (1 - p) for p in frontier.values()])[0]
        else:
            tier = rng.choices(tiers, weights=tier_weights)[0]
            fresh = [task.id for task in tasks_by_tier[tier]
                     if task.id not in chosen and task.id not in exclude]     # one group per task and step
            tid = rng.choice(fresh or [task.id for task in tasks_by_tier[tier]])
        frontier.pop(tid, None)
        chosen.append(tid)
    return [by_id[tid] for tid in chosen]


def pass_rate(group):
    """The share of a group's trajectories that are correct: 0 < pass rate < 1 is a mixed group."""
    return sum(t.correct for t in group.trajectories) / len(group.trajectories)


def update_task_stats(task_stats, groups, momentum=0.7):
    """Record each group's pass rate: a running rate per tier, the last one per task."""
    for group in groups:
        accuracy = pass_rate(group)
        tier = group.task.difficulty
        task_stats["tiers"][tier] = momentum * task_stats["tiers"].get(tier, 0.5) + (1 - momentum) * accuracy
        task_stats["tasks"][group.task.id] = accuracy


def next_temperature(temperature, entropy, target, gain=0.5, low=0.2, high=1.2):
    """The next step's sampling temperature, steered toward a target entropy of the sampled tokens.

    Which temperature gives groups with signal depends on how far SFT went: after a short warm
    start, sampling hot breaks most queries and groups come out all wrong; after a long one, the
    policy is so sure that groups come out all the same (README, Results). What both show is the
    rollouts' mean -log p of the sampled tokens under the policy (grpo.sampled_entropy, every
    rollout): high when sampling wanders, near zero when every row says the same. It rises with
    the temperature (for p_T ∝ p^(1/T), d E_T[-log p] / d(1/T) = -Var_T[log p] <= 0), so a step in
    log T toward the target is a controller: log T' = log T + gain * log(target / entropy),
    clamped to [low, high]. If the entropy goes as T^a, each step closes a share gain * a of the
    gap in log T: a is about 1.7 here (0.010 nats at 0.5 and 0.032 at 1.0 from one start), so
    gain 0.5 closes 85% without overshooting, and damps the noise of one step's few rollouts.
    Measured, and why it is off by default: after the default's short warm start the entropy
    hardly falls with T (0.027 to 0.063 nats even at 0.2: forks between a few likely tokens, not
    a long tail), so a target read off a long start drives T to `low` and the groups to all
    right or all wrong (README, Results).
    """
    if entropy <= 0 or not math.isfinite(entropy):    # nothing sampled, or only certain tokens: warm up
        return min(high, temperature * 2 ** gain)
    return min(high, max(low, temperature * (target / entropy) ** gain))


# ----------------------------------------------------------------------------- warm start
def warm_start(args, model, tokenizer, train_tasks, limits, config, metrics_path, use_grad_scaler):
    """Supervised fine-tuning on gold demonstrations, built exactly as a rollout would record them.

    A 135M model almost never solves a task from scratch, and GRPO learns nothing from groups
    that are all wrong; a few SFT steps teach the tool protocol so that groups come out mixed.
    Demonstrations (--demos, agentrl.gold_turns) whose turns do not fit --max-new-tokens are left
    out, and counted; so is one cut by --max-context before it submits (sft_dropped).
    """
    def fits(task):
        return all(len(tokenizer(turn, add_special_tokens=False).input_ids) < limits.max_new_tokens
                   for turn in agentrl.gold_turns(task, args.demos, limits.max_turns))
    demo_tasks = [task for task in train_tasks if fits(task)]
    if not demo_tasks:
        raise SystemExit(f"--sft-steps: no gold demonstration fits --max-new-tokens {limits.max_new_tokens}; raise it")
    print(f"sft: {len(demo_tasks)} {args.demos} demonstrations ({len(train_tasks) - len(demo_tasks)} left out: "
          f"a turn exceeds --max-new-tokens)")
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=args.sft_lr, weight_decay=args.weight_decay)
    device_type = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(device_type, enabled=use_grad_scaler)  # its own, like its optimizer
    rng = random.Random(args.seed + 1)
    for step in tqdm(range(1, args.sft_steps + 1), desc="sft", dynamic_ncols=True, disable=not parallel.is_main()):
        t0 = time.time()
        batch = [agentrl.demonstration(tokenizer, task, args.demos, limits)
                 for task in rng.sample(demo_tasks, min(args.sft_batch_size, len(demo_tasks)))]
        dropped = sum(t.stop_reason != "submitted" for t in batch)    # cut by --max-context before submitting
        batch = [t for t in batch if t.stop_reason == "submitted"]
        if not batch:
            raise SystemExit(f"--sft-steps: the demonstrations do not fit --max-context {limits.max_context}; raise it")
        stats = grpo.sft_step(model, optimizer, batch, config, scaler)
        append_jsonl(metrics_path, {"sft_step": step, **stats, "sft_dropped": dropped, "time_step": time.time() - t0})
        if step % 4 == 0 or step == args.sft_steps:
            tqdm.write(f"sft step {step}: " + " | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                         for k, v in stats.items()))
    if parallel.is_main():
        lora.save_adapter(model, os.path.join(args.out, "sft"))


# ----------------------------------------------------------------------------- evaluation
def behaviour(trajectories):
    """What the agent does, counted: how often it submits; of its submissions, how many are a query
    that fails to run (often one whose last run just failed: submitted anyway); how often it looks
    at a table with describe_table; the turns it takes to submit. None where nothing was submitted."""
    submitted = [t for t in trajectories if t.stop_reason == "submitted"]
    return {
        "submit_rate": len(submitted) / len(trajectories),
        "failed_submit_rate": sum(t.failed_submission for t in submitted) / len(submitted) if submitted else None,
        "describe_rate": sum(t.num_describe_calls > 0 for t in trajectories) / len(trajectories),
        "turns_to_submit": sum(t.num_turns for t in submitted) / len(submitted) if submitted else None,
    }


def on_cpu_only(weight_dtype, device):
    """The weights' precision while generating (--eval-dtype, --rollout-dtype; Sampling.weight_dtype)
    applies on a CPU; a GPU runs the model in half precision already (lora.precision_for): None."""
    return weight_dtype if device.type == "cpu" else None


def evaluate(model, tokenizer, tasks, limits, max_rows=16, path=None, draft=0, processes=1, weight_dtype=None):
    """Greedy, one trajectory per task: execution accuracy overall and by tier, turns, tool errors,
    and the behaviour counters. All tasks go through one engine call, `max_rows` episodes at a
    time, a finished episode's place taken by the next task (continuous batching). 16 rows, not
    32: the KV cache is rows x context (16 x 2048 tokens of this model is 1.5 GB, three times
    its weights) and 32 rows were only 1.09x faster (README: bench.py eval). path: a .jsonl file to
    write every episode to, to read what the agent did on each held-out task. draft: Sampling.draft.
    processes: on a CPU, that many forked processes of one thread each, each with a contiguous share
    of the tasks and its own `max_rows` (parallel.forked). weight_dtype: Sampling.weight_dtype."""
    mine = parallel.shard(tasks)                      # this process's share of the tasks (all of them in one)
    greedy = agentrl.Sampling(greedy=True, draft=draft, weight_dtype=on_cpu_only(weight_dtype, model.device))

    def episodes(share):
        return [g.trajectories[0] for g in agentrl.rollout_groups(model, tokenizer, share, 1, greedy, limits, max_rows=max_rows)]
    if processes > 1 and model.device.type == "cpu":
        was_training = model.training
        model.eval()            # merged once, here, as generation runs (lora_merged): the children read these weights
        try:
            with lora.lora_merged(model, greedy.weight_dtype):
                trajectories = [t for share in parallel.forked(episodes, mine, processes) for t in share]
        finally:                # a child that died leaves the model as it found it
            model.train(was_training)
    else:
        trajectories = episodes(mine)
    trajectories = [t for share in parallel.gather(trajectories) for t in share]   # every process's, in task order
    if path and parallel.is_main():
        write_text_atomic(path, "".join(json.dumps(episode_record(task, t)) + "\n" for task, t in zip(tasks, trajectories)))
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


def eval_options(args) -> dict:
    """evaluate's keyword arguments from the command line: drafts, processes, the weights' precision."""
    return dict(draft=args.draft_tokens, processes=args.eval_processes, weight_dtype=WEIGHT_DTYPES[args.eval_dtype])


def evaluate_splits(model, tokenizer, eval_sets, limits, run_dir=None, label=None, **options):
    """One evaluation record for every held-out split: the first split's metrics under the eval_*
    keys every reader knows (plot, summary, bench.py learn), each other split's under its own name
    (eval_accuracy -> test_schema_accuracy), and eval_split naming the first. With run_dir, the
    episodes go to run_dir/evals/<label>_<split>.jsonl. options: evaluate's draft, processes and
    weight_dtype (eval_options)."""
    record = {}
    for i, (split, tasks) in enumerate(eval_sets.items()):
        path = os.path.join(run_dir, "evals", f"{label}_{split}.jsonl") if run_dir else None
        metrics = evaluate(model, tokenizer, tasks, limits, path=path, **options)
        record.update(metrics if i == 0 else {split + k[len("eval"):]: v for k, v in metrics.items()})
    return {"eval_split": next(iter(eval_sets)), **record}


def split_metrics(record, split):
    """One split's metrics from an evaluation record, under the eval_* keys."""
    suffixes = [k[len("eval"):] for k in record if k.startswith("eval_") and k != "eval_split"]
    name = "eval" if split == record.get("eval_split", split) else split
    return {"eval" + suffix: record[name + suffix] for suffix in suffixes if name + suffix in record}


def format_eval(metrics):
    def rate(key):
        return "-" if metrics.get(key) is None else f"{metrics[key]:.2f}"
    tiers = " ".join(f"{tier}={acc:.2f}" for tier, acc in metrics["eval_accuracy_by_tier"].items())
    return (f"accuracy={metrics['eval_accuracy']:.3f} ({metrics['eval_tasks']} tasks) | {tiers} | "
            f"turns={metrics['eval_mean_turns']:.2f} | tool_error_rate={metrics['eval_tool_error_rate']:.2f} | "
            f"failed_submit_rate={rate('eval_failed_submit_rate')} | describe_rate={rate('eval_describe_rate')} | "
            f"turns_to_submit={rate('eval_turns_to_submit')}")


def format_evals(record, splits):
    """One line per held-out split."""
    width = max(map(len, splits)) + 1
    return "\n".join(f"  {split + ':':<{width}} {format_eval(split_metrics(record, split))}" for split in splits)


# ----------------------------------------------------------------------------- judge
def make_judge(args, model, tokenizer, device):
    """Return a judge backend, or None for `--judge none` (rewards = correctness bonus alone)."""
    kind = args.judge
    if kind == "auto":
        kind = "local" if device.type == "cuda" else "none"
    if kind == "http":
        backend = judge_lib.HTTPBackend(base_url=args.judge_url, model=args.judge_model)
        problem = backend.check()
        if problem is None:
            return backend
        if args.judge_fallback == "error":
            raise SystemExit(f"judge endpoint unreachable: {problem}\n"
                             f"fix --judge-url, or pass --judge-fallback local (or none) to train without it")
        print(f"judge endpoint unreachable ({problem}); falling back to --judge {args.judge_fallback}")
        kind = args.judge_fallback
    if kind == "local":
        if args.judge_model:
            judge_model, judge_tokenizer = lora.load_model(args.judge_model, device=device)
            return judge_lib.LocalBackend(judge_model, judge_tokenizer)
        return judge_lib.LocalBackend(model, tokenizer)  # the policy's base model, LoRA switched off
    return None


# ----------------------------------------------------------------------------- plot
def plot_run(run_dir):
    if not parallel.is_main():
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    train = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["reward_mean"] for r in train], label="train reward (mean)")
    ax.plot([r["step"] for r in train], [r["train_accuracy"] for r in train], label="train accuracy")
    mixed = [r for r in train if "mixed_group_rate" in r]    # (not in the records of older runs)
    ax.plot([r["step"] for r in mixed], [r["mixed_group_rate"] for r in mixed], ":", label="mixed groups (share)")
    sampled = [r for r in train if "temperature" in r]    # (nor the temperature)
    if len({r["temperature"] for r in sampled}) > 1:     # steered (--target-entropy)
        ax.plot([r["step"] for r in sampled], [r["temperature"] for r in sampled], "-.", label="sampling temperature")
    ax.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-",
            label=f"held-out accuracy, {evals[0].get('eval_split', 'eval')} (greedy)" if evals else "held-out accuracy")
    others = [k for k in (evals[0] if evals else {}) if k.endswith("_accuracy") and k != "eval_accuracy"]
    for key in others:            # the other held-out splits (test_schema_accuracy, ...)
        ax.plot([r["step"] for r in evals if key in r], [r[key] for r in evals if key in r], "s--",
                label=f"held-out accuracy, {key[:-len('_accuracy')]} (greedy)")
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(os.path.join(run_dir, "progress.png")) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


# ----------------------------------------------------------------------------- the loop
def run(args):
    """Train (or --eval-only evaluate). Under torchrun, first join the other processes (parallel.py);
    then every process runs the loop below on its share of each step, and only rank 0 prints."""
    device = parallel.start(args.dist_timeout)   # None in one process: the default device
    if parallel.world_size() > args.groups_per_step and not args.eval_only:
        raise SystemExit(f"--groups-per-step {args.groups_per_step}: each of the {parallel.world_size()} processes "
                         f"needs a group per step; raise it")
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(sys.stdout if parallel.is_main() else devnull):
        result = run_process(args, device)
    parallel.stop()
    return result


def release_freed_memory(threshold):
    """Have glibc's malloc serve every block of `threshold` bytes or more with pages of its own
    (mmap) and hand them back to the OS when the block is freed. glibc's own threshold starts at
    128 KiB but rises (up to 32 MiB) with every larger mapped block freed; from then on the
    activations of an update (1 to 4 MiB each) come from the heap and stay in it once freed, cut
    up by smaller blocks still alive, and the resident set keeps the highest point they reached.
    The price is page faults, fresh pages for every large tensor, in decoding too (a step's logits
    are 3 MiB): off by default, since bench.py allocator measured it slower. A
    MALLOC_MMAP_THRESHOLD_ the user set is left alone, and so is a C library without mallopt.
    Returns whether it was set."""
    if threshold <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)    # the C library this process already runs on
    M_MMAP_THRESHOLD = -3                                     # from glibc's malloc.h
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold) == 1


def run_process(args, device):
    # 0) setup: seed, device, run folder, the whole config logged once; with --malloc-mmap-threshold,
    #    glibc's malloc told to hand freed activations back (release_freed_memory says why)
    release_freed_memory(args.malloc_mmap_threshold)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if parallel.is_main():
        os.makedirs(os.path.join(args.out, "trajectories"), exist_ok=True)
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    print("config: " + " | ".join(f"{k}={v}" for k, v in vars(args).items()))
    if parallel.world_size() > 1:
        print(f"data parallel: {parallel.world_size()} processes, each with its share of every step's groups")

    # 1) model + LoRA; only the adapter's parameters train
    model, tokenizer = lora.load_model(args.model, device=device)
    device = next(model.parameters()).device
    # fp32 on CPU, bf16 on Ampere+, fp16 weights + fp32 LoRA + autocast + loss scaling on a T4
    precision = lora.precision_for(device.type, torch.cuda.get_device_capability(device) if device.type == "cuda" else None)
    scaler = torch.amp.GradScaler(device.type, enabled=precision.use_grad_scaler)   # disabled: a pass-through
    print(f"device: {device} | {precision}")
    lora.apply_lora(model, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                    targets=tuple(args.lora_targets.split(",")))
    if args.adapter:
        lora.load_adapter(model, args.adapter)
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=args.lr, weight_decay=args.weight_decay)

    # 2) data: train tasks grouped by tier, a fixed held-out subset of each evaluation split (drawn
    #    with a seed of its own: test and test_schema get the same questions, and so do runs with
    #    different --seed, so their per-task outcomes pair up)
    eval_sets = {}
    for split in args.eval_splits:
        tasks = sql_env.load_tasks(args.data, split)
        eval_sets[split] = random.Random(0).sample(tasks, min(args.eval_size, len(tasks))) if args.eval_size else tasks
    limits = agentrl.Limits(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, max_context=args.max_context)
    if args.eval_only:      # the record (per-task outcomes: pair it with another) and every episode stay in --out
        record = evaluate_splits(model, tokenizer, eval_sets, limits, args.out, "eval_only", **eval_options(args))
        if parallel.is_main():
            write_text_atomic(os.path.join(args.out, "eval_only.json"), json.dumps({"adapter": args.adapter, "data": args.data, **record}) + "\n")
        print(f"eval on {args.data}:\n{format_evals(record, args.eval_splits)}\nrecord and episodes: {args.out}")
        return record
    train_tasks = sql_env.load_tasks(args.data, args.train_split)
    if "val" in args.eval_splits:   # the validation slice is never trained on, by SFT or RL
        held_out = {task.id for task in sql_env.load_tasks(args.data, "val")}
        train_tasks = [task for task in train_tasks if task.id not in held_out]
    tasks_by_tier = {}
    for task in train_tasks:
        tasks_by_tier.setdefault(task.difficulty, []).append(task)
    judge_backend = make_judge(args, model, tokenizer, device)
    rubric = Path(args.rubric).read_text() if args.rubric else judge_lib.DEFAULT_RUBRIC
    config = grpo.GRPOConfig(micro_batch_size=args.micro_batch_size, clip_low=args.clip_low, clip_high=args.clip_high,
                             aggregation=args.loss, kl_coef=args.kl_coef, max_grad_norm=args.max_grad_norm,
                             gradient_checkpointing=args.grad_checkpointing, amp_dtype=precision.amp_dtype,
                             group_segments=args.group_segments,
                             max_tokens=args.max_turns * args.max_new_tokens,  # Dr. GRPO's constant: the generation budget
                             epochs=args.epochs, minibatches=args.minibatches)

    # 3) resume, or evaluate the starting point (then warm start, and checkpoint step 0); under
    #    torchrun every process then takes rank 0's adapter, optimizer and sampler state
    #    The adapter RL starts from is kept in --out/start: the KL term's reference (--kl-coef)
    start_step, task_stats, start_state = 0, {"tiers": {}, "tasks": {}}, None
    start_folder = os.path.join(args.out, "start")
    if args.resume and parallel.is_main():
        start_step, task_stats, folder = load_checkpoint(args.out, model, optimizer, scaler)
        truncate_metrics(metrics_path, start_step)
        start_state = lora.lora_state(model, start_folder) if args.kl_coef > 0 else None
        print(f"resumed from {folder} at step {start_step}")
    elif not args.resume:
        start_run(args, model, tokenizer, eval_sets, train_tasks, limits, config, precision)
        save_checkpoint(args.out, model, optimizer, scaler, 0, task_stats)
        if parallel.is_main():
            lora.save_adapter(model, start_folder)
        start_state = lora.lora_state(model) if args.kl_coef > 0 else None
    start_step, task_stats, start_state = parallel.share_state(model, optimizer, scaler, (start_step, task_stats, start_state))
    if start_state:     # through share_state on the CPU: back onto this process's device
        start_state = [t.to(device) for t in start_state]
    world, rank = parallel.world_size(), parallel.rank()
    rollout_dtype = on_cpu_only(WEIGHT_DTYPES[args.rollout_dtype], device)
    if world > 1 and (args.update != "grpo" or args.epochs * args.minibatches > 1):
        raise SystemExit("under torchrun, --update grpo with --epochs 1 --minibatches 1 only (so far)")
    if world > 1 and args.sample_rounds > 1:     # each process would stop after its own rounds, on its own tasks
        raise SystemExit("under torchrun, --sample-rounds 1 only (so far)")
    judge_cache = os.path.join(args.out, "judge_cache") if parallel.is_main() else None   # rank 0 writes

    bar = tqdm(range(start_step + 1, args.steps + 1), initial=start_step, total=args.steps, desc="train",
               dynamic_ncols=True, disable=not parallel.is_main())
    for step in bar:
        t0 = time.time()
        step_seed = args.seed * 100_003 + step  # the same tasks and tokens whether or not the run was resumed
        # 1) sample tasks (under torchrun: the same draw everywhere, each process rolls out its share),
        # 2) rollouts, seeded per step, round and process (in one process and one round, by the step's seed).
        #    With --sample-rounds R > 1, DAPO's dynamic sampling: new tasks, round after round, until
        #    groups_per_step groups came out mixed (the others carry no signal) or R rounds ran
        groups = []
        temperature = task_stats.get("temperature", args.temperature)   # --target-entropy steers it (next_temperature)
        for round_index in range(args.sample_rounds):
            round_seed = step_seed * args.sample_rounds + round_index
            tasks = parallel.shard(sample_tasks(tasks_by_tier, task_stats, args.groups_per_step, random.Random(round_seed),
                                                args.frontier_share, exclude={g.task.id for g in groups}))
            sampling = agentrl.Sampling(temperature=temperature, top_p=args.top_p, seed=round_seed * world + rank,
                                        draft=args.draft_tokens, weight_dtype=rollout_dtype)
            groups += agentrl.rollout_groups(model, tokenizer, tasks, args.group_size, sampling, limits)
            if sum(0 < pass_rate(g) < 1 for g in groups) >= args.groups_per_step:
                break
        t_rollout = time.time() - t0

        # 3) reward = judge score + bonus * correct (score_groups)
        rewards, results, judge_failed = score_groups(groups, judge_backend, rubric, args.bonus, judge_cache,
                                                      args.partial_credit, args.exec_credit)
        t_judge = time.time() - t0 - t_rollout

        # 4) advantages within each group, flattened into the update's batch
        batch, advantages, counts = grpo.batch_from_groups(groups, rewards, scale_by_std=not args.no_std_scaling)

        # 5) update (skipped when no group carries signal). Under torchrun the normalizer counts the
        #    whole step's tokens and the gradients are summed over the processes (parallel.py)
        reference = lora.lora_weights(model, start_state) if args.kl_coef > 0 else None  # the KL reference
        if args.update == "rft":    # the control: imitate the step's correct rollouts, right or not alone in their group
            correct = [t for g in groups for t in g.trajectories if t.correct and sum(t.assistant_mask)]
            stats = (grpo.rft_update(model, optimizer, correct, config, scaler, seed=step_seed) if correct
                     else {"skipped": True, "skip_reason": "no correct rollout"})
        elif world > 1:
            step_counts = parallel.sum_counts(grpo.normalizer_counts(batch, config))
            if step_counts["num_sequences"]:     # every process steps, with a share or with nothing
                stats = grpo.grpo_step(model, optimizer, batch, advantages, config, scaler, reference_context=reference,
                                       counts=step_counts, all_reduce=parallel.all_reduce)
            else:
                stats = {"skipped": True, "skip_reason": "no trainable group"}
        elif batch:
            stats = grpo.grpo_update(model, optimizer, batch, advantages, config, scaler, reference_context=reference,
                                     seed=step_seed)
        else:
            stats = {"skipped": True, "skip_reason": "no trainable group"}
        trained = {id(t): a for t, a in zip(batch, advantages)} if args.update == "grpo" else {}  # (rft uses none)
        times = {"time_rollout": t_rollout, "time_judge": t_judge}
        groups, rewards, results, counts, stats, judge_failed, times = parallel.gather_step(
            groups, rewards, results, counts, stats, judge_failed, times)   # every process's, as one process's
        frontier_before = sum(0 < p < 1 for p in task_stats["tasks"].values())
        update_task_stats(task_stats, groups)

        # 6) log: one line, the same numbers in metrics.jsonl, the trajectories readable
        record = step_record(step, groups, rewards, counts, stats, judge_failed_groups=judge_failed, **judge_counters(results),
                             frontier_tasks=frontier_before, rollout_rounds=round_index + 1, temperature=temperature,
                             **times, time_step=time.time() - t0)
        if args.target_entropy:     # the sampler's state, like the pass rates: checkpointed, the same on every process
            task_stats["temperature"] = next_temperature(temperature, record["rollout_entropy"], args.target_entropy)
        append_jsonl(metrics_path, record)
        write_trajectories(args.out, step, groups, rewards, results, trained)
        if stats.get("skipped"):
            tqdm.write(f"step {step}: update skipped ({stats.get('skip_reason', 'unknown')})")
        bar.set_postfix(reward=f"{record['reward_mean']:.2f}", acc=f"{record['train_accuracy']:.2f}", s=f"{record['time_step']:.0f}")
        tqdm.write(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))

        # 7) evaluate and checkpoint
        if args.eval_every and step % args.eval_every == 0 and step != args.steps:
            record = evaluate_splits(model, tokenizer, eval_sets, limits, args.out, f"step_{step:04d}",
                                     **eval_options(args))
            append_jsonl(metrics_path, {"step": step, **record})
            tqdm.write(f"eval step {step}:\n{format_evals(record, args.eval_splits)}")
        if step % args.checkpoint_every == 0 or step == args.steps:
            save_checkpoint(args.out, model, optimizer, scaler, step, task_stats)
        plot_run(args.out)
        if parallel.is_main():      # the run folder's page, written by rank 0 like every file
            report.write_report(args.out)
    bar.close()

    # the end: final evaluation (unless no GRPO step ran since the last one), the adapter, a summary
    if start_step < args.steps:
        record = evaluate_splits(model, tokenizer, eval_sets, limits, args.out, f"step_{args.steps:04d}",
                                 **eval_options(args))
        append_jsonl(metrics_path, {"step": args.steps, **record})
    if not parallel.is_main():   # rank 0 saves the adapter and reports
        return None
    final_dir = os.path.join(args.out, "final")
    lora.save_adapter(model, final_dir)
    plot_run(args.out)
    report.write_report(args.out)
    return print_summary(args, metrics_path, final_dir)


def start_run(args, model, tokenizer, eval_sets, train_tasks, limits, config, precision):
    """A fresh run: clear an earlier run's checkpoints in --out, write the config, evaluate the
    base model, then (--sft-steps) warm start and evaluate again."""
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    if parallel.is_main():
        if os.path.isdir(os.path.join(args.out, "checkpoints")):
            print(f"{args.out} holds an earlier run: starting over there (use --resume to continue it instead)")
            shutil.rmtree(os.path.join(args.out, "checkpoints"))
        write_text_atomic(metrics_path, "")
        write_text_atomic(os.path.join(args.out, "config.json"), json.dumps(vars(args), indent=2))
    if args.start_eval:
        phase = "start" if args.adapter else "base"
        record = evaluate_splits(model, tokenizer, eval_sets, limits, args.out, phase, **eval_options(args))
        append_jsonl(metrics_path, {"step": 0, "phase": phase, **record})
        print(f"eval step 0 ({args.adapter or 'base model'}):\n{format_evals(record, args.eval_splits)}")
    if args.sft_steps:
        warm_start(args, model, tokenizer, train_tasks, limits, config, metrics_path, precision.use_grad_scaler)
        record = evaluate_splits(model, tokenizer, eval_sets, limits, args.out, "sft", **eval_options(args))
        append_jsonl(metrics_path, {"step": 0, "phase": "sft", **record})
        print(f"eval step 0 (after {args.sft_steps} SFT steps):\n{format_evals(record, args.eval_splits)}")


def score_groups(groups, judge_backend, rubric, bonus, cache_dir, partial_credit=0.0, exec_credit=0.0):
    """Rewards, one list per group: the judge's relative score plus the correctness bonus, plus
    (partial_credit > 0) that weight times how much of the gold result the submitted query
    returned (sql_env.result_overlap), plus (exec_credit > 0) that weight when a query was
    submitted and ran without an error. A group the judge cannot score (or `--judge none`) keeps
    the rest.
    Returns (rewards, judge results, how many groups the judge failed to score)."""
    rewards, results, judge_failed = [], [], 0
    for group in groups:
        correct = [float(t.correct) for t in group.trajectories]
        if judge_backend is None:
            result = judge_lib.JudgeResult(scores=None, explanations=[], scored=False, attempts=0, error="no judge")
        else:
            result = judge_lib.score_group([t.messages for t in group.trajectories], judge_backend, rubric=rubric,
                                           cache_dir=cache_dir)
            judge_failed += not result.scored
        scores = result.scores if result.scored else [0.0] * len(correct)
        overlap = [sql_env.result_overlap(group.task.db_path, t.submitted_sql, group.task.gold_sql)
                   if partial_credit and t.submitted_sql else 0.0 for t in group.trajectories]
        ran = [float(t.submitted_sql is not None and not t.failed_submission) if exec_credit else 0.0
               for t in group.trajectories]
        rewards.append([score + bonus * c + partial_credit * o + exec_credit * e
                        for score, c, o, e in zip(scores, correct, overlap, ran)])  # the reward
        results.append(result)
    return rewards, results, judge_failed


def judge_counters(results):
    """How the judge fared this step, so a bad judge shows at once: groups whose reply was on
    another scale and rescaled in order, and correction turns sent (unusable replies, scores
    above 1). Groups it left unscored are judge_failed_groups (score_groups)."""
    return {"judge_rescaled_groups": sum(bool(r.rescaled) for r in results),
            "judge_corrections": sum(max(0, r.attempts - 1) for r in results)}


def step_record(step, groups, rewards, counts, stats, **extra):
    """One step's metrics: the line printed and the record in metrics.jsonl. counts: from
    grpo.batch_from_groups; stats: from grpo.grpo_step; extra: judge failures and times."""
    trajectories = [t for g in groups for t in g.trajectories]
    flat_rewards = [r for rs in rewards for r in rs]
    return {
        "step": step,
        "reward_mean": sum(flat_rewards) / len(flat_rewards),
        "train_accuracy": sum(t.correct for t in trajectories) / len(trajectories),
        "trainable_groups": counts["trainable_groups"],
        "mixed_group_rate": counts["trainable_groups"] / len(groups),
        "zero_variance_groups": counts["zero_variance_groups"],
        "non_finite_trajectories": counts["non_finite_trajectories"],
        "submitted_groups": len(groups),
        "mean_turns": sum(t.num_turns for t in trajectories) / len(trajectories),
        "tool_error_rate": sum(t.num_tool_errors for t in trajectories) / max(1, sum(t.num_tool_calls for t in trajectories)),
        **behaviour(trajectories),
        "gen_tokens": sum(sum(t.assistant_mask) for t in trajectories),
        "rollout_entropy": grpo.sampled_entropy(trajectories),   # every rollout's, trained or not (stats' entropy: the trained)
        **extra,
        **{k: v for k, v in stats.items() if isinstance(v, (int, float, bool, str))},
    }


def episode_record(task, t):
    """One episode as the run folder keeps it (trajectories/, evals/): the task, what was
    submitted, whether it was right, why it ended, and the conversation."""
    return {"task_id": task.id, "difficulty": task.difficulty, "question": task.question, "gold_sql": task.gold_sql,
            "submitted_sql": t.submitted_sql, "correct": t.correct, "stop_reason": t.stop_reason, "messages": t.messages}


def write_trajectories(run_dir, step, groups, rewards, results, trained=None):
    """trajectories/step_XXXX.jsonl: every conversation of the step with its reward, judgement and
    advantage. trained: {id(trajectory): advantage} for the trajectories the update trained on;
    the others get None (their group carried no signal, or the row was cut; under torchrun, the
    other processes' rows). Rank 0 only."""
    if not parallel.is_main():
        return
    lines, trained = [], trained or {}
    for g, (group, group_rewards, result) in enumerate(zip(groups, rewards, results)):
        for i, t in enumerate(group.trajectories):
            lines.append(json.dumps({
                "step": step, "group": g, **episode_record(group.task, t),
                "reward": group_rewards[i], "judge_score": result.scores[i] if result.scores else None,
                "judge_explanation": result.explanations[i] if result.explanations else "",
                "advantage": trained.get(id(t)), "judge_rescaled": result.rescaled}) + "\n")
    write_text_atomic(os.path.join(run_dir, "trajectories", f"step_{step:04d}.jsonl"), "".join(lines))


def print_summary(args, metrics_path, final_dir):
    """The end-of-run summary: held-out accuracy by phase, the last evaluation, updates, where things are."""
    records = read_jsonl(metrics_path)
    evals = [r for r in records if "eval_accuracy" in r]
    print("\n" + "=" * 72)
    labels = [r.get("phase") or f"step {r['step']}" for r in evals]
    width = max(map(len, args.eval_splits)) + 1
    print("held-out accuracy (greedy):")
    for split in args.eval_splits:
        per_split = [(split_metrics(r, split), label) for r, label in zip(evals, labels)]
        per_split = [(m, label) for m, label in per_split if m]          # a record from before this split was added
        path = " -> ".join(f"{m['eval_accuracy']:.3f} ({label})" for m, label in per_split)
        print(f"  {split + ':':<{width}} {path}   ({per_split[-1][0]['eval_tasks']} tasks)")
    print(f"final eval:\n{format_evals(evals[-1], args.eval_splits)}")
    steps = [r for r in records if "reward_mean" in r]
    print(f"updates:    {sum(not r['skipped'] for r in steps)} applied, {sum(r['skipped'] for r in steps)} skipped "
          f"(no mixed group, or a non-finite loss/gradient: see metrics.jsonl)")
    if steps:
        temperatures = [r.get("temperature", args.temperature) for r in steps]
        steered = f" -> {temperatures[-1]:.2f} (steered toward {args.target_entropy:g} nats)" if args.target_entropy else ""
        entropies = [r["rollout_entropy"] for r in steps if "rollout_entropy" in r]   # (not in older runs' records)
        print(f"signal:     {sum(r['trainable_groups'] for r in steps)}/{sum(r['submitted_groups'] for r in steps)} groups "
              f"mixed, sampled tokens' entropy {sum(entropies) / max(1, len(entropies)):.3f} nats, "
              f"temperature {temperatures[0]:.2f}{steered}")
    unit = 1 if sys.platform == "darwin" else 1024      # ru_maxrss: bytes on macOS, KiB on Linux
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * unit if args.eval_processes > 1 else 0
    forked = (f"; the largest of the {args.eval_processes} evaluation processes forked at once {children / 2**30:.1f} GiB, "
              f"the pages it shares with this one included" if children else "")
    print(f"memory:     {peak / 2**30:.1f} GiB peak resident (this process, since it started){forked}")
    print(f"adapter:    {final_dir}  (PEFT layout)")
    print(f"metrics:    {metrics_path}   plot: {os.path.join(args.out, 'progress.png')}   "
          f"report: {os.path.join(args.out, 'report.html')}")
    print(f"evaluate:   python train.py --eval-only --adapter {final_dir}" + (f" --model {args.model}" if args.model else ""))
    return evals[-1]


@torchrun_reports_errors   # under torchrun: a process's exception is named in the job's failure summary
def main(argv=None):
    args = parse_args(argv)
    if args.report:
        try:
            path = report.write_report(args.report)
        except FileNotFoundError as e:
            raise SystemExit(f"--report: {e}") from None
        print(f"report: {path}")
        return path
    try:
        return run(args)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise SystemExit(f"disk full while writing to {args.out!r}: free space and rerun with --resume "
                             f"(the last complete checkpoint is intact)") from e
        raise


if __name__ == "__main__":
    main()
