"""Train a tool-using SQL agent with GRPO: the loop that `python train.py` runs.

    python train.py                                  # embedded model + data, sized for this machine
    python train.py --steps 50 --group-size 8        # every knob is one flag of Config below
    python train.py --resume --out runs/default      # continue a killed run from its checkpoint
    python train.py --eval-only --adapter runs/default/final   # evaluate an adapter (evaluate.py)
    python report.py runs/default                    # rebuild the run's report.html from its folder
    torchrun --nproc_per_node=4 train.py --groups-per-step 16  # data parallel on 4 GPUs (parallel.py)

A fresh run first warm starts on gold demonstrations (--sft-steps), then evaluates where RL starts
on the held-out splits and checkpoints step 0. One step of the loop (train_step, then run_process):

    1) tasks             a few train questions, most from the frontier (tasks whose last group
                         came out mixed), the rest by tier, weighted toward ~50% success
    2) rollouts          --group-size trajectories per task, sampled with the current policy
                         (engine.py; --branching: half whole, half branched off their states)
    3) reward            reward = judge score + bonus * correct (score_groups)
    4) advantages        one float a token, from an estimator: GRPO's, normalized within each
                         group; --step-credit adds each turn's step advantage; groups without
                         signal skipped and counted (grpo.make_batch)
    5) update            one clipped policy-gradient step on the LoRA only, each group's tree
                         forwarded once (grpo.grpo_step), or the control --update rft: a
                         supervised step on the correct rollouts (grpo.rft_step)
    6) log               one `key=value | ...` line, metrics.jsonl, trajectories/, plot, report.html
    7) eval/checkpoint   greedy held-out accuracy every --eval-every steps; adapter, optimizer,
                         sampler and RNG state written atomically every step (checkpoint.py)

Seeds are derived from (--seed, step), so a resumed run samples exactly the tasks and tokens the
unbroken run would have: the checkpoint holds the step count and the sampler's pass rates.
"""
import argparse
import errno
import functools
import json
import math
import os
import random
import shutil
import textwrap
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal, get_args, get_origin

import torch
from torch.distributed.elastic.multiprocessing.errors import record as torchrun_reports_errors
from tqdm import tqdm

import agentrl
import engine
import checkpoint
import grpo
import judge
import lora
import parallel
import report
import sql_env
from evaluate import WEIGHT_DTYPES, evaluate_splits, format_evals, load_eval_sets
from files import read_json, read_jsonl, write_text_atomic
from judge_backends import HTTP_JUDGE, CachedBackend, make_judge

FRONTIER_SHARE = 0.75  # share of a step's tasks drawn from the frontier (sample_tasks)
# tasks rolled out per group trained on: the mixed groups among them are kept (mixed_first)
CANDIDATES = 2
SFT_BATCH_SIZE = 2     # demonstrations per warm-start step


# ----------------------------------------------------------------------------- the config
def knob(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    """Every knob of a run, at its CPU default (GPU_DEFAULTS: the others on a GPU); one flag each."""
    model: str | None = knob(None, "HF hub id or local folder; None or 'embedded': the embedded SmolLM2")
    adapter: str | None = knob(None, "start from (or, with --eval-only, evaluate) this saved adapter folder")
    lora_r: int = knob(16, "LoRA rank")
    lora_alpha: float = knob(32.0, "LoRA alpha (scale = alpha / r)")
    data: str = knob("default", "'default' (the embedded set), or a Spider or BIRD folder")
    train_split: str = knob("train", "split to train on (embedded set: train, train_mixed, train_wide)")
    eval_split: str | None = knob(None, "held-out splits, comma-separated (test, test_schema, val: a slice "
                                        "of train); None: test, or dev")
    steps: int = knob(4, "GRPO steps")
    groups_per_step: int = knob(2, "tasks per step")
    group_size: int = knob(8, "trajectories per task (the N of GRPO)")
    max_turns: int = knob(4, "assistant turns per trajectory")
    max_new_tokens: int = knob(128, "sampled tokens per turn")
    max_context: int = knob(2048, "tokens per trajectory, prompt included")
    temperature: float = knob(0.5, "sampling temperature of the rollouts")
    branching: Literal["none", "uniform", "entropy"] = knob(
        "none", "half a group sampled whole, half branched off its states after a tool result")
    judge: str = knob("auto", "auto (a server in $OPENAI_*, else GPU: local, CPU: none), local, none, "
                              "http, or a URL")
    judge_model: str | None = knob(None, "local: HF id or folder (None: the policy's); http: name "
                                         f"(None: $AGENTRL_JUDGE_MODEL, {HTTP_JUDGE})")
    judge_max_tokens: int = knob(1024, "http: tokens a reply may have (a reasoning judge: thousands), "
                                       "waited 60 s + 0.1 s each")
    rubric: str | None = knob(None, "file with a rubric replacing the default one")
    bonus: float = knob(1.0, "reward added for an execution-correct answer")
    sft_steps: int = knob(48, "supervised steps on gold demonstrations before RL; 0: none")
    sft_lr: float = knob(1e-3, "learning rate of the warm start")
    update: Literal["grpo", "rft"] = knob("grpo", "grpo: clipped policy gradient; "
                                                  "rft: SFT on the correct rollouts")
    lr: float = knob(1e-4, "AdamW learning rate of the RL steps")
    loss: grpo.Aggregation = knob("token", "token: DAPO, sequence: GRPO, constant: Dr. GRPO")
    no_std_scaling: bool = knob(False, "advantages not divided by the group std (Dr. GRPO)")
    step_credit: float = knob(0.0, "w: a turn's advantage is A^E + w * A^S (GiGPO); 0: GRPO")
    clip_low: float = knob(0.2, "ratio clipped below 1 - clip_low")
    clip_high: float = knob(0.28, "ratio clipped above 1 + clip_high (DAPO clip-higher)")
    kl_coef: float = knob(0.0, "k3 KL penalty to the policy RL started from (after SFT, or --adapter)")
    micro_batch_size: int = knob(8, "trajectories of a group per forward/backward (their shared turns once)")
    grad_checkpointing: bool = knob(True, "recompute each layer in the backward "
                                          "instead of keeping activations")
    eval_every: int = knob(0, "evaluate every K steps (0: only before and after training)")
    eval_size: int = knob(0, "held-out tasks per evaluation, the same whatever --seed (0: all)")
    eval_processes: int = knob(0, "on a CPU, evaluate in this many forked one-thread processes "
                                  "(0: one per core)")
    eval_dtype: Literal["fp32", "bf16"] = knob("bf16", "on a CPU, the weights' and KV cache's precision "
                                                       "in evaluations")
    eval_only: bool = knob(False, "evaluate --model/--adapter on --eval-split, "
                                  "write the record to --out, exit")
    out: str = knob("runs/default", "run folder")
    resume: bool = knob(False, "continue the run in --out from its last checkpoint")
    seed: int = knob(0, "seeds tasks, sampling and LoRA init")

    @property
    def eval_splits(self) -> list[str]:
        names = self.eval_split or ("test" if self.data == "default" else "dev")
        return [split.strip() for split in names.split(",") if split.strip()]


# The only defaults a GPU changes: the 3B agent (README, "Hardware", says why each). The warm start
# stays: it teaches the tool-call format the rollouts are parsed by, and RL needs mixed groups.
GPU_DEFAULTS = dict(model="Qwen/Qwen2.5-3B-Instruct", steps=40, groups_per_step=8, max_new_tokens=256,
                    max_context=4096, temperature=1.0, lr=5e-5, micro_batch_size=4, eval_every=10,
                    eval_split="test,test_schema")
SECTIONS = {"model": "model and LoRA", "data": "data", "steps": "rollouts", "judge": "judge and reward",
            "sft_steps": "supervised warm start", "update": "update", "eval_every": "evaluation and run"}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default after its help."""


def parse_args(argv=None) -> Config:
    """The command line as a Config: one flag per field, GPU_DEFAULTS applied on a GPU, checked."""
    on_gpu = torch.cuda.is_available()
    defaults = Config(**(GPU_DEFAULTS if on_gpu else {}))
    gpu = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in GPU_DEFAULTS.items())
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter,
                                epilog=textwrap.fill(f"The defaults shown are this machine's; "
                                                     f"on a GPU: {gpu}.", 96))
    for f in fields(Config):
        group = p.add_argument_group(SECTIONS[f.name]) if f.name in SECTIONS else group
        options = dict(default=getattr(defaults, f.name), help=f.metadata["help"])
        if f.type is bool:   # off by default: a switch; on by default: --x / --no-x
            options["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        else:   # int, float, str, str | None, or a Literal of the choices
            choices = get_args(f.type) if get_origin(f.type) is Literal else None
            options.update(type=f.type if f.type in (int, float) else str, choices=choices)
        group.add_argument("--" + f.name.replace("_", "-"), **options)
    config = Config(**vars(p.parse_args(argv)))
    try:
        check(config)
    except ValueError as e:
        p.error(str(e))
    config.eval_split = ",".join(config.eval_splits)    # config.json names the splits the run used
    return config


def check(c):
    """Raise ValueError naming the flag of the first setting that cannot run."""
    positive = ["groups_per_step", "group_size", "max_turns", "max_new_tokens", "max_context",
                "micro_batch_size", "lora_r", "judge_max_tokens"]
    held_out = "val" in c.eval_splits    # the validation slice of train, then never trained on
    adapter_run = c.adapter and os.path.dirname(os.path.normpath(c.adapter))
    problems = [
        (c.steps < 0, f"--steps must be >= 0, got {c.steps}"),
        (c.sft_steps < 0, f"--sft-steps must be >= 0, got {c.sft_steps}"),
        (c.sft_steps and c.max_turns < agentrl.DEMO_TURNS,
         f"--sft-steps: the demonstrations take {agentrl.DEMO_TURNS} turns; "
         f"use --max-turns >= {agentrl.DEMO_TURNS}"),
        *[(getattr(c, name) < 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(c, name)}")
          for name in positive],
        (c.group_size < 2 and not c.eval_only,
         "--group-size must be >= 2: GRPO compares trajectories within a group"),
        (not math.isfinite(c.step_credit), f"--step-credit must be a number, got {c.step_credit}"),
        (c.step_credit and c.update == "rft", "--step-credit weighs GRPO's advantages; rft has none"),
        (c.branching != "none" and c.group_size < 4 and not c.eval_only,
         "--branching rolls half of each group out whole, at least 2: use --group-size >= 4"),
        (not 0 < c.temperature <= 10, "--temperature must be in (0, 10]"),
        (not 0 <= c.eval_processes <= 64, "--eval-processes must be in [0, 64]"),
        (c.judge not in ("auto", "local", "none", "http") and not c.judge.startswith(("http://", "https://")),
         f"--judge {c.judge!r}: auto, local, none, http, or the URL of an OpenAI-compatible server"),
        (c.data != "default" and not os.path.isdir(c.data),
         f"--data {c.data!r}: no such folder (expected 'default' or a Spider/BIRD folder)"),
        (c.adapter and not os.path.isfile(os.path.join(c.adapter, "adapter_config.json")),
         f"--adapter {c.adapter!r}: no adapter_config.json there"),
        (c.rubric and not os.path.isfile(c.rubric), f"--rubric {c.rubric!r}: no such file"),
        (not c.eval_splits or len(set(c.eval_splits)) < len(c.eval_splits),
         f"--eval-split {c.eval_split!r}: name one or more different splits, comma-separated"),
        (held_out and c.train_split != "train" and not c.eval_only, f"--eval-split val is a slice of the "
         f"train split, held out of training: it needs --train-split train, not {c.train_split!r}"),
        (held_out and adapter_run and trained_with_val_held_out(adapter_run) is False,
         f"--adapter {c.adapter!r} was trained on the val tasks (its run did not evaluate on val): "
         f"its val scores would be training scores"),
        (c.resume and not c.eval_only and trained_with_val_held_out(c.out) not in (None, held_out),
         f"--resume: the run in {c.out!r} was started {'without' if held_out else 'with'} val "
         f"among its --eval-split, so it {'trained on' if held_out else 'held out'} the val tasks: "
         f"resume it with the same --eval-split"),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(message)


def trained_with_val_held_out(run_dir):
    """Whether the train.py run in run_dir left split val out of its training (it evaluated on val):
    True or False from its config.json; None where there is none (an adapter from elsewhere)."""
    try:
        config = read_json(os.path.join(run_dir, "config.json"))
    except (OSError, ValueError):
        return None
    return "val" in (config.get("eval_split") or "").split(",")


# ----------------------------------------------------------------------------- task sampling
def sample_tasks(tasks_by_tier, task_stats, k, rng, frontier_share=FRONTIER_SHARE):
    """Pick k tasks. A group all right or all wrong teaches nothing; a task whose last group came out
    mixed (0 < pass rate p < 1) is where the signal is. So each pick is, with probability
    frontier_share, such a task (weight p(1-p)); else a tier (weight p(1-p) + a floor, p its running
    success rate) and a task in it not picked yet this step. task_stats: {"tiers": {tier: rate},
    "tasks": {task id: last group's rate}}."""
    by_id = {task.id: task for tier_tasks in tasks_by_tier.values() for task in tier_tasks}
    frontier = {tid: p for tid, p in sorted(task_stats["tasks"].items()) if 0 < p < 1 and tid in by_id}
    tiers = sorted(tasks_by_tier)
    tier_rates = [task_stats["tiers"].get(tier, 0.5) for tier in tiers]
    # peaks at p = 0.5, where a group is most often mixed
    tier_weights = [p * (1 - p) + 0.05 for p in tier_rates]
    chosen = []
    for _ in range(k):
        if frontier and rng.random() < frontier_share:
            tid = rng.choices(list(frontier), weights=[p * (1 - p) for p in frontier.values()])[0]
        else:
            tier = rng.choices(tiers, weights=tier_weights)[0]
            # one group per task and step
            fresh = [task.id for task in tasks_by_tier[tier] if task.id not in chosen]
            tid = rng.choice(fresh or [task.id for task in tasks_by_tier[tier]])
        frontier.pop(tid, None)
        chosen.append(tid)
    return [by_id[tid] for tid in chosen]


def pass_rate(group):
    return sum(t.correct for t in group.trajectories) / len(group.trajectories)


def mixed_first(groups, k):
    """The k groups a step trains on: the mixed ones (0 < pass rate < 1) first, in the order drawn,
    then the others. Without a judge a group all right or all wrong has no advantage to learn from;
    with one, its scores may still tell its rollouts apart."""
    return sorted(groups, key=lambda group: not 0 < pass_rate(group) < 1)[:k]


def update_task_stats(task_stats, pass_rates, momentum=0.7):
    """Record each rolled-out group's pass rate, pass_rates [(task, rate)]: a running rate per tier,
    the last one per task."""
    for task, accuracy in pass_rates:
        tier = task.difficulty
        task_stats["tiers"][tier] = momentum * task_stats["tiers"].get(tier, 0.5) + (1 - momentum) * accuracy
        task_stats["tasks"][task.id] = accuracy


# ----------------------------------------------------------------------------- warm start
def sft_batches(config, tokenizer, train_tasks, limits):
    """The warm start's tasks, one batch of SFT_BATCH_SIZE per --sft-steps, drawn with a seed of their
    own, so a resumed run knows them again. A demonstration with a turn over --max-new-tokens is
    left out, and counted."""
    def fits(task):
        return all(len(tokenizer(turn, add_special_tokens=False).input_ids) < limits.max_new_tokens
                   for turn in agentrl.gold_turns(task, max_turns=limits.max_turns))
    demo_tasks = [task for task in train_tasks if fits(task)]
    if not demo_tasks:
        raise SystemExit(f"--sft-steps: no gold demonstration fits "
                         f"--max-new-tokens {limits.max_new_tokens}; raise it")
    print(f"sft: {len(demo_tasks)} look demonstrations ({len(train_tasks) - len(demo_tasks)} left out: "
          f"a turn exceeds --max-new-tokens)")
    rng = random.Random(config.seed + 1)
    return [rng.sample(demo_tasks, min(SFT_BATCH_SIZE, len(demo_tasks))) for _ in range(config.sft_steps)]


def warm_start(config, model, tokenizer, batches, limits, grpo_config, metrics_path, use_grad_scaler):
    """Supervised steps on gold demonstrations (agentrl.demonstration) of the tasks in batches
    (sft_batches), tokenized as a rollout records them: a small model rarely solves a task from
    scratch, and GRPO learns nothing from groups all wrong. A demonstration cut by --max-context
    before it submits is left out, and counted (sft_dropped). The adapter is saved to --out/sft."""
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=config.sft_lr, weight_decay=0.0)
    device_type = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(device_type, enabled=use_grad_scaler)  # its own, like its optimizer
    for step, tasks in enumerate(tqdm(batches, desc="sft", dynamic_ncols=True,
                                      disable=not parallel.is_main()), 1):
        t0 = time.time()
        batch = [agentrl.demonstration(tokenizer, task, limits=limits) for task in tasks]
        dropped = sum(t.stop_reason != "submitted" for t in batch)    # cut by --max-context before submitting
        batch = [t for t in batch if t.stop_reason == "submitted"]
        if not batch:
            raise SystemExit(f"--sft-steps: the demonstrations do not fit "
                             f"--max-context {limits.max_context}; raise it")
        stats = grpo.sft_step(model, optimizer, batch, grpo_config, scaler)
        report.append_jsonl(metrics_path, {"sft_step": step, **stats, "sft_dropped": dropped,
                                           "time_step": time.time() - t0})
        if step % 4 == 0 or step == config.sft_steps:
            tqdm.write(f"sft step {step}: " + " | ".join(f"{k}={v:.4g}" if isinstance(v, float)
                                                         else f"{k}={v}" for k, v in stats.items()))
    if parallel.is_main():
        lora.save_adapter(model, os.path.join(config.out, "sft"))


# ----------------------------------------------------------------------------- judge and reward
def score_groups(groups, judge_backend, rubric, bonus):
    """Rewards, one list per group: the judge's relative score plus the correctness bonus. A group
    the judge cannot score (or `--judge none`) keeps the bonus alone.
    Returns (rewards, judge results, how many groups the judge failed to score)."""
    rewards, results, judge_failed = [], [], 0
    for group in groups:
        correct = [float(t.correct) for t in group.trajectories]
        if judge_backend is None:
            result = judge.JudgeResult(scores=None, explanations=[], scored=False, attempts=0,
                                       error="no judge")
        else:
            result = judge.score_group(group.tree, judge_backend, rubric=rubric)
            judge_failed += not result.scored
        scores = result.scores if result.scored else [0.0] * len(correct)
        rewards.append([score + bonus * c for score, c in zip(scores, correct)])  # the reward
        results.append(result)
    return rewards, results, judge_failed


# ----------------------------------------------------------------------------- the run
def eval_options(config) -> dict:
    """evaluate's keyword arguments from the config: processes, the weights' precision."""
    return dict(processes=eval_processes(config), weight_dtype=WEIGHT_DTYPES[config.eval_dtype])


def eval_processes(config) -> int:
    """--eval-processes, where 0 is one per core this process may run on."""
    # (macOS: no affinity)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return config.eval_processes or cores


def estimator_of(config):
    """The advantage estimator the flags name: GRPO's (over the group's std unless --no-std-scaling),
    with --step-credit w each turn's step advantage added, w times (grpo.step_credit_advantages)."""
    scale_by_std = not config.no_std_scaling
    if config.step_credit:
        return functools.partial(grpo.step_credit_advantages, weight=config.step_credit,
                                 scale_by_std=scale_by_std)
    return functools.partial(grpo.grpo_advantages, scale_by_std=scale_by_std)


def launch(config, score=score_groups, estimator=None):
    """Train (or --eval-only evaluate); returns the last evaluation record (None on ranks > 0).
    score(groups, judge_backend, rubric, bonus) -> (rewards, judge results, judge
    failures) gives the rewards (score_groups); estimator(group, rewards) -> one list of advantages
    per trajectory, one float a token, the advantages (None: estimator_of(config)). A fork tries
    another reward or advantage by passing its own. Under torchrun, first join the other processes
    (parallel.py); every process then runs the loop on its share of each step, and only rank 0 prints."""
    with parallel.joined() as device:   # device: None in one process (the default device)
        if parallel.world_size() > config.groups_per_step and not config.eval_only:
            raise SystemExit(f"--groups-per-step {config.groups_per_step}: each of the "
                             f"{parallel.world_size()} processes needs a group per step; raise it")
        if parallel.world_size() > 1 and config.update != "grpo" and not config.eval_only:
            raise SystemExit("under torchrun, --update grpo only (so far)")
        return run_process(config, device, score, estimator or estimator_of(config))


@dataclass
class Run:
    """What every phase of a run reads: the model and its optimizer, the data, the judge."""
    model: object
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    precision: lora.Precision
    limits: agentrl.Limits
    grpo_config: grpo.GRPOConfig
    eval_sets: dict
    sft_tasks: list = field(default_factory=list)        # the warm start's batches (sft_batches)
    tasks_by_tier: dict = field(default_factory=dict)    # the tasks RL draws from
    judge: object = None                                 # a judge backend, or None (make_judge)
    rubric: str = ""
    score: object = None          # (groups, judge, rubric, bonus) -> (rewards, judge results, failures)
    estimator: object = None      # (group, rewards) -> advantages, one list a trajectory (grpo.py)
    update: object = None         # grpo.grpo_step, parallel.grpo_step, or the control grpo.rft_step
    reference: object = None      # a context under which the model is the KL reference (kl_coef > 0)


def setup(config, device) -> Run:
    """Seeds, the run folder, the model with its LoRA, the data, the judge, the update's config."""
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    if parallel.is_main():
        os.makedirs(os.path.join(config.out, "trajectories"), exist_ok=True)
    print("config: " + " | ".join(f"{k}={v}" for k, v in asdict(config).items()))
    if parallel.world_size() > 1:
        print(f"data parallel: {parallel.world_size()} processes, each with its share of every step's groups")
    model, tokenizer = lora.load_model(config.model, device=device)
    device = next(model.parameters()).device
    # fp32 on CPU, bf16 on Ampere+, fp16 weights + fp32 LoRA + autocast + loss scaling on a T4
    precision = lora.precision_for(device.type, torch.cuda.get_device_capability(device)
                                   if device.type == "cuda" else None)
    print(f"device: {device} | {precision}")
    lora.apply_lora(model, r=config.lora_r, alpha=config.lora_alpha)   # only the adapter's parameters train
    if config.adapter:
        lora.load_adapter(model, config.adapter)
    limits = agentrl.Limits(config.max_turns, config.max_new_tokens, config.max_context)
    run = Run(model, tokenizer,
              torch.optim.AdamW(lora.lora_parameters(model), lr=config.lr, weight_decay=0.0),
              torch.amp.GradScaler(device.type, enabled=precision.use_grad_scaler),  # disabled: pass-through
              precision, limits, grpo.GRPOConfig(
                  micro_batch_size=config.micro_batch_size, temperature=config.temperature,
                  clip_low=config.clip_low,
                  clip_high=config.clip_high, aggregation=config.loss, kl_coef=config.kl_coef,
                  gradient_checkpointing=config.grad_checkpointing, amp_dtype=precision.amp_dtype,
                  # Dr. GRPO's constant: the generation budget
                  max_tokens=config.max_turns * config.max_new_tokens),
              load_eval_sets(config.data, config.eval_splits, config.eval_size))
    run.update = (grpo.rft_step if config.update == "rft"
                  else parallel.grpo_step if parallel.world_size() > 1 else grpo.grpo_step)
    if config.eval_only:
        return run
    train_tasks = sql_env.load_tasks(config.data, config.train_split)
    if "val" in config.eval_splits:   # the validation slice is never trained on, by SFT or RL
        held_out = {task.id for task in sql_env.load_tasks(config.data, "val")}
        train_tasks = [task for task in train_tasks if task.id not in held_out]
    run.sft_tasks = sft_batches(config, tokenizer, train_tasks, limits) if config.sft_steps else []
    # RL draws from the tasks the warm start demonstrated, where there was one: each seen solved once,
    # the policy now solves some of them some of the time, so a group there is mixed far more often
    # than on a task it never saw (README, "What the default run prints"); else from the train split
    rl_tasks = list({task.id: task for batch in run.sft_tasks for task in batch}.values()) or train_tasks
    run.tasks_by_tier = {tier: [t for t in rl_tasks if t.difficulty == tier]
                         for tier in {t.difficulty for t in rl_tasks}}
    run.judge = make_judge(config, model, tokenizer, device)
    if run.judge and parallel.is_main():    # its replies kept (rank 0 writes): a resumed step asks none twice
        run.judge = CachedBackend(run.judge, os.path.join(config.out, "judge_cache"))
    run.rubric = Path(config.rubric).read_text() if config.rubric else judge.DEFAULT_RUBRIC
    return run


def evaluation(config, run, label, **logged):
    """Every held-out split; with `step` (and `phase`), logged to metrics.jsonl."""
    t0 = time.time()
    record = evaluate_splits(run.model, run.tokenizer, run.eval_sets, run.limits, config.out, label,
                             **eval_options(config))
    record["time_eval"] = time.time() - t0
    if logged:
        report.append_jsonl(os.path.join(config.out, "metrics.jsonl"), {**logged, **record})
    return record


def eval_only(config, run):
    """--eval-only: the record (per-task outcomes: pair it with another) and every episode stay in --out."""
    record = evaluation(config, run, "eval_only")
    if parallel.is_main():
        write_text_atomic(os.path.join(config.out, "eval_only.json"),
                          json.dumps({"adapter": config.adapter, "data": config.data, **record}) + "\n")
    print(f"eval on {config.data}:\n{format_evals(record, config.eval_splits)}\n"
          f"record and episodes: {config.out}")
    return record


def start_or_resume(config, run):
    """Resume from --out's last checkpoint, or start afresh: clear an earlier run's checkpoints, write
    config.json, (--sft-steps) warm start, evaluate where RL starts and checkpoint step 0. Under
    torchrun every process then takes rank 0's adapter, optimizer and sampler state. Returns
    (the step to go on from, the sampler's task stats, the KL reference's LoRA weights or None):
    --out/start holds the adapter RL starts from."""
    metrics_path, start_folder = os.path.join(config.out, "metrics.jsonl"), os.path.join(config.out, "start")
    start_step, task_stats, start_state = 0, {"tiers": {}, "tasks": {}}, None
    if config.resume and parallel.is_main():
        start_step, task_stats, folder = checkpoint.load(config.out, run.model, run.optimizer, run.scaler)
        checkpoint.truncate_metrics(metrics_path, start_step)
        start_state = lora.lora_state(run.model, start_folder) if config.kl_coef > 0 else None
        print(f"resumed from {folder} at step {start_step}")
    elif not config.resume:
        if parallel.is_main():
            if os.path.isdir(os.path.join(config.out, "checkpoints")):
                print(f"{config.out} holds an earlier run: starting over there "
                      f"(use --resume to continue it instead)")
                shutil.rmtree(os.path.join(config.out, "checkpoints"))
            write_text_atomic(metrics_path, "")
            write_text_atomic(os.path.join(config.out, "config.json"), json.dumps(asdict(config), indent=2))
        if config.sft_steps:
            warm_start(config, run.model, run.tokenizer, run.sft_tasks, run.limits, run.grpo_config,
                       metrics_path, run.precision.use_grad_scaler)
        phase = "sft" if config.sft_steps else "start"
        record = evaluation(config, run, phase, step=0, phase=phase)
        where = (f"after {config.sft_steps} SFT steps" if config.sft_steps
                 else (config.adapter or "base model"))
        print(f"eval step 0 ({where}):\n{format_evals(record, config.eval_splits)}")
        if parallel.is_main():
            checkpoint.save(config.out, run.model, run.optimizer, run.scaler, 0, task_stats)
            lora.save_adapter(run.model, start_folder)
        start_state = lora.lora_state(run.model) if config.kl_coef > 0 else None
    start_step, task_stats, start_state = parallel.share_state(run.model, run.optimizer, run.scaler,
                                                               (start_step, task_stats, start_state))
    device = next(run.model.parameters()).device    # through share_state on the CPU: back onto this device
    return start_step, task_stats, [t.to(device) for t in start_state] if start_state else None


@dataclass
class Step:
    """What one step did: what the log reads (report.step_record) and parallel.gather_step joins."""
    number: int
    pass_rates: list        # every rolled-out group's (task, pass rate), kept or not (the sampler reads them)
    groups: list            # the groups kept for the update (agentrl.TrajectoryGroup)
    rewards: list           # one list of floats per kept group
    results: list           # the judge's JudgeResult per kept group
    judge_failed: int       # kept groups the judge could not score (their rewards: the bonus alone)
    advantages: list        # grpo.Batch.advantages: per group, per trajectory, one float a token or None
    counts: dict            # grpo.make_batch's counts of groups
    stats: dict             # the update's
    times: dict             # seconds: time_rollout, time_judge, time_step


def rollout(config, run, tasks, seed):
    """A group of --group-size trajectories a task at --temperature, seeded by the step and the process;
    --branching: half of each sampled whole, the rest branched off its states. max_rows: the kept groups'."""
    sampling = engine.Sampling(config.temperature, seed=seed * parallel.world_size() + parallel.rank())
    max_rows, n = config.groups_per_step * config.group_size, config.group_size
    whole = n if config.branching == "none" else n // 2
    groups = engine.rollout_groups(run.model, run.tokenizer, tasks, whole, sampling, run.limits,
                                   max_rows=max_rows)
    if config.branching != "none":
        groups = engine.branch_groups(run.model, run.tokenizer, groups, n, sampling, run.limits,
                                      config.branching, max_rows=max_rows)
    return groups


def train_step(config, run, step, task_stats) -> Step:
    """Phases 1) to 5) of the module docstring in this process; under torchrun on its share of the tasks
    (parallel.shard), the update summed over the processes (run.update: parallel.grpo_step)."""
    t0, seed = time.time(), config.seed * 100_003 + step   # the same tasks and tokens on --resume
    # 1) tasks: CANDIDATES per group trained on, the same draw on every process; this process's share
    tasks = parallel.shard(sample_tasks(run.tasks_by_tier, task_stats, CANDIDATES * config.groups_per_step,
                                        random.Random(seed)))
    # 2) rollouts: a group per task; the mixed groups kept first, up to this process's share of groups
    rolled = rollout(config, run, tasks, seed)
    groups = mixed_first(rolled, len(parallel.shard(range(config.groups_per_step))))
    t_rollout = time.time() - t0
    # 3) reward = judge score + bonus * correct (score_groups, or the scorer launch was given)
    rewards, results, judge_failed = run.score(groups, run.judge, run.rubric, config.bonus)
    t_judge = time.time() - t0 - t_rollout
    # 4) advantages, one a token, from the run's estimator (GRPO's, or step credit's)
    batch, counts = grpo.make_batch(groups, rewards, run.estimator, run.grpo_config.max_tokens)
    # 5) update: the clipped policy-gradient step (or the control, --update rft)
    stats = run.update(run.model, run.optimizer, batch, run.grpo_config, run.scaler, run.reference)
    return Step(step, [(g.task, pass_rate(g)) for g in rolled], groups, rewards, results, judge_failed,
                batch.advantages, counts, stats,
                {"time_rollout": t_rollout, "time_judge": t_judge, "time_step": time.time() - t0})


def run_process(config, device, score, estimator):
    """run's work in this process: setup, start or resume, the loop, the end."""
    started, memory = time.time(), parallel.PeakMemory()   # for the summary: where the time and memory went
    memory.start()
    run = setup(config, device)
    if config.eval_only:
        return eval_only(config, run)
    run.score, run.estimator = score, estimator
    start_step, task_stats, start_state = start_or_resume(config, run)
    # the KL reference: under it the model is the policy RL started from
    run.reference = lora.lora_weights(run.model, start_state) if config.kl_coef > 0 else None
    metrics_path = os.path.join(config.out, "metrics.jsonl")
    records = ([r for r in read_jsonl(metrics_path, skip_unreadable=True)[0] if "reward_mean" in r]
               if parallel.is_main() else [])
    bar = tqdm(range(start_step + 1, config.steps + 1), initial=start_step, total=config.steps, desc="train",
               dynamic_ncols=True, disable=not parallel.is_main())
    warned = False   # judge_noise_warning, once a run
    for step in bar:
        # 1) tasks, 2) rollouts, 3) reward, 4) advantages, 5) update; every process's, as one process's
        done = parallel.gather_step(train_step(config, run, step, task_stats))
        frontier_before = sum(0 < p < 1 for p in task_stats["tasks"].values())
        update_task_stats(task_stats, done.pass_rates)

        # 6) log: one line, the same numbers in metrics.jsonl, the trajectories readable
        record = report.step_record(done, frontier_tasks=frontier_before)
        report.append_jsonl(metrics_path, record)
        report.write_trajectories(config.out, done, trained=config.update == "grpo")
        bar.set_postfix(reward=f"{record['reward_mean']:.2f}", acc=f"{record['train_accuracy']:.2f}",
                        s=f"{record['time_step']:.0f}")
        tqdm.write(report.step_line(record, config.steps))
        records.append(record)
        if not warned and (warning := report.judge_noise_warning(records)):
            tqdm.write(warning)
            warned = True

        # 7) evaluate and checkpoint
        if config.eval_every and step % config.eval_every == 0 and step != config.steps:
            evals = evaluation(config, run, f"step_{step:04d}", step=step)
            tqdm.write(f"eval step {step}:\n{format_evals(evals, config.eval_splits)}")
        if parallel.is_main():      # checkpoint, plot and page: rank 0 writes every file of the run folder
            checkpoint.save(config.out, run.model, run.optimizer, run.scaler, step, task_stats)
            report.write_plot(config.out, read_jsonl(metrics_path))
            report.write_report(config.out)
    bar.close()

    # the end: final evaluation (unless no GRPO step ran since the last one), the adapter, a summary
    if start_step < config.steps:
        evaluation(config, run, f"step_{config.steps:04d}", step=config.steps)
    if not parallel.is_main():   # rank 0 saves the adapter and reports
        return None
    final_dir = os.path.join(config.out, "final")
    lora.save_adapter(run.model, final_dir)
    report.write_plot(config.out, read_jsonl(metrics_path))
    report.write_report(config.out)
    return report.print_summary(config, metrics_path, final_dir, time.time() - started, memory.peak_gib)


@torchrun_reports_errors   # under torchrun: a process's exception is named in the job's failure summary
def main(argv=None, score=score_groups, estimator=None):
    """`python train.py [flags]`: parse the flags (parse_args) and run; score, estimator: as launch's."""
    config = parse_args(argv)
    try:
        return launch(config, score=score, estimator=estimator)
    except lora.ModelUnavailable as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise SystemExit(f"disk full while writing to {config.out!r}: free space and rerun with --resume "
                             f"(the last complete checkpoint is intact)") from e
        raise


if __name__ == "__main__":
    main()
