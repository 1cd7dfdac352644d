"""Learning claims, measured so that they can fail: held-out accuracy, task by task, paired.

    python -m bench learn [--grpo-seeds 2] [train.py flags]   # an SFT start, then GRPO, RFT and SFT for the same time
    python -m bench sweep [--sweep-lrs ...] [--sweep-ranks ...]   # the RL lr and the LoRA rank, chosen on validation
    python -m bench pair BEFORE AFTER [AFTER ...]               # evaluations task by task: the difference, its interval

learn: every arm starts from one SFT start, and each is paired with the start (and with the others)
on the whole of both held-out splits: a 95% paired-bootstrap interval (by task and by query
template) and McNemar's exact p. The controls are RFT on the same rollouts and more SFT for the
GRPO runs' wall time. sweep picks on the validation slice of train, never on a held-out split.
Runs that finished with the same flags are reused, so a benchmark stopped part way, or run again,
trains only what is missing.
"""
import json
import math
import os
import random
import re
import textwrap
import time
from dataclasses import asdict

import agentrl
import engine
import evaluate
import lora
import sql_env
import train
from bench.common import chosen_variants, record_mean, run_records
from evaluate import paired_difference, paired_line, split_outcomes
from files import read_json, read_jsonl


def query_template(sql) -> str:
    """A gold query with its literal values replaced by ?: the template questions made from it share."""
    return re.sub(r"'(?:[^']|'')*'|\b\d+(?:\.\d+)?\b", "?", sql)


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples of which c are right (Chen et al. 2021, arXiv:2107.03374):
    1 - C(n - c, k) / C(n, k), the chance that k samples drawn from the n hold a right one."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def headroom(adapter, tasks_by_split, k, seed, limits, model_name=None) -> dict:
    """{split: (pass@1, pass@k)} at temperature 1 of an adapter on each split's tasks: what RL could turn into
    greedy accuracy there. model_name: the base model the adapter was trained on (None: the embedded one)."""
    model, tokenizer = lora.load_model(model_name)
    lora.load_adapter(model, adapter)
    rates = {}
    for split, tasks in tasks_by_split.items():
        groups = engine.rollout_groups(model, tokenizer, tasks, k, engine.Sampling(seed=seed), limits, max_rows=8 * k)
        correct = [sum(t.correct for t in g.trajectories) for g in groups]
        rates[split] = (sum(pass_at_k(k, c, 1) for c in correct) / len(tasks), sum(pass_at_k(k, c, k) for c in correct) / len(tasks))
    return rates


def template_moves(before, after, templates, most=3) -> str:
    """Where a paired difference comes from: how many templates had a question gained or lost, and
    the `most` that moved the most (by net questions), each as +gained/-lost of its questions shared."""
    moves = {}                                                     # template: (gained, lost, tasks)
    for t in [t for t in before if t in after]:                   # the tasks both ran, as paired_line pairs them
        gained, lost, tasks = moves.get(templates[t], (0, 0, 0))
        moves[templates[t]] = (gained + (after[t] > before[t]), lost + (after[t] < before[t]), tasks + 1)
    moved = sorted(((template, m) for template, m in moves.items() if m[0] or m[1]), key=lambda kv: -abs(kv[1][0] - kv[1][1]))
    lines = [f"templates moved: {len(moved)} of {len(moves)}" + (", most:" if moved else "")]
    lines += [f"  +{g}/-{l} of {n}  {template}" for template, (g, l, n) in moved[:most]]
    return "\n".join(lines)


def task_templates(data, split) -> dict:
    """{task id: query template} of a split (tasks without gold SQL have none)."""
    return {task.id: query_template(task.gold_sql) for task in sql_env.load_tasks(data, split) if task.gold_sql}


def evaluation_record(path) -> dict:
    """The evaluation a path names: an --eval-only folder (its eval_only.json), a run folder (the
    last evaluation in its metrics.jsonl; RUN@STEP: its evaluation at that step, @0 where RL
    started), or either file itself."""
    path, _, step = path.rpartition("@") if "@" in path else (path, "", "")
    if os.path.isdir(path):
        only = os.path.join(path, "eval_only.json")
        path = only if os.path.isfile(only) else os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no evaluation there (an --eval-only folder, a run folder or its metrics.jsonl)")
    records = [r for r in read_jsonl(path) if "eval_outcomes" in r and (not step or r.get("step") == int(step))]
    if not records:
        raise SystemExit(f"{path}: no evaluation with per-task outcomes in it" + (f" at step {step}" if step else ""))
    config = os.path.join(os.path.dirname(path), "config.json")     # a run's: the data it ran on
    if "data" not in records[-1] and os.path.isfile(config):
        records[-1]["data"] = read_json(config)["data"]
    return records[-1]


def runs_line(before, afters, templates) -> str:
    """Several runs of one arm (seeds) against the same start, as one line: each task's outcome
    averaged over the runs, paired with the start on the tasks all ran, by task and by template.
    The interval resamples tasks (templates) for these runs; how far one seed moves the result is
    the spread of the runs' own differences, printed beside it (a few seeds cannot give it an interval)."""
    tasks = [t for t in before if all(t in after for after in afters)]
    b = [before[t] for t in tasks]
    mean_after = [sum(after[t] for after in afters) / len(afters) for t in tasks]   # each in [0, 1]
    mean, (low, high), _ = paired_difference(b, mean_after)
    _, (t_low, t_high), _ = paired_difference(b, mean_after, clusters=[templates[t] for t in tasks])
    each = [100 * (sum(after[t] for t in tasks) - sum(b)) / len(tasks) for after in afters]
    return (f"mean of {len(afters)} runs: {sum(b) / len(tasks):.3f} -> {sum(mean_after) / len(tasks):.3f} on "
            f"{len(tasks)} tasks: {100 * mean:+.1f} points [{100 * low:+.1f}, {100 * high:+.1f}] by task, "
            f"[{100 * t_low:+.1f}, {100 * t_high:+.1f}] by template | the runs: "
            f"{', '.join(f'{d:+.1f}' for d in each)} (spread {max(each) - min(each):.1f})")


def bench_pair(args):
    """Evaluations compared task by task with the first (BEFORE) on every split they all share:
    accuracies, the paired difference with its 95% interval and McNemar's p, questions gained and
    lost, failed submissions. Each is a run folder (its last evaluation) or an --eval-only folder;
    an evaluation of a subset pairs with a whole-split one on the tasks they share. The interval
    is given twice: with tasks as independent draws, and by query template (the data's gold SQL
    tells the templates), which is what a claim about new kinds of questions needs, with the
    templates that moved most under it (template_moves). Several AFTERs
    (seeds of one arm) add a line for their mean (runs_line)."""
    if len(args.paths) < 2:
        raise SystemExit("python -m bench pair BEFORE AFTER [AFTER ...]: two evaluations or more (run or --eval-only folders)")
    records = [evaluation_record(path) for path in args.paths]
    data = records[0].get("data", "default")     # train.py's default: the embedded set
    for path, record in zip(args.paths[1:], records[1:]):
        if record.get("data", "default") != data:
            raise SystemExit(f"the evaluations ran on different data: {data} and {record.get('data', 'default')} ({path})")
    outcomes = [split_outcomes(r) for r in records]
    shared = [split for split in outcomes[0] if all(split in o for o in outcomes[1:])]
    if not shared:
        raise SystemExit(f"no split evaluated in all: {' and '.join(str(sorted(o)) for o in outcomes)}")
    print(f"before: {args.paths[0]}\n" + "".join(f"after:  {path}\n" for path in args.paths[1:]), end="")
    for split in shared:
        metrics = [evaluate.split_metrics(r, split) for r in records]
        templates = task_templates(data, split)
        unknown = [t for o in outcomes[1:] for t in o[split] if t in outcomes[0][split] and t not in templates]
        if unknown:
            raise SystemExit(f"{split}: task {unknown[0]} has no gold query in the data {data!r}")
        for after, m_after in zip(outcomes[1:], metrics[1:]):
            same = metrics[0]["eval_task_ids"] == m_after["eval_task_ids"]   # else each rate is of its own tasks
            failed = " -> ".join("-" if m.get("eval_failed_submit_rate") is None else
                                 f"{m['eval_failed_submit_rate']:.2f}" + ("" if same else f" ({m['eval_tasks']} tasks)")
                                 for m in (metrics[0], m_after))
            print(f"  {split}: {paired_line(outcomes[0][split], after[split], templates)} | failed submissions {failed}")
            print(textwrap.indent(template_moves(outcomes[0][split], after[split], templates), "    "))
        if len(records) > 2:
            print(f"  {split}: {runs_line(outcomes[0][split], [o[split] for o in outcomes[1:]], templates)}")


def train_unless_finished(argv):
    """train.py with these arguments, unless a run of exactly these arguments completed in its --out
    from the adapter it starts from as that adapter is now (then it is reused: a benchmark stopped
    part way, or run again, trains only what is missing, and what a retrained start changes). A
    flag newer than the run, at its default, matches: a new flag's default keeps the old behaviour; a
    flag removed since is left out of the comparison."""
    def as_stored(argv):     # train.py's arguments as its config.json stores them
        return json.loads(json.dumps(asdict(train.parse_args(argv))))
    wanted, defaults = as_stored(argv), as_stored([])
    try:
        config = read_json(os.path.join(wanted["out"], "config.json"))
        config = {**defaults, **{k: v for k, v in config.items() if k in defaults}}
    except (OSError, ValueError, TypeError):
        config = None
    final = os.path.join(wanted["out"], "final", "adapter_model.safetensors")
    start = wanted["adapter"] and os.path.join(wanted["adapter"], "adapter_model.safetensors")
    if config != wanted or not os.path.isfile(final) or (start and os.path.getmtime(start) > os.path.getmtime(final)):
        train.main(argv)


def bench_learn(args):
    """What does RL add over its own start, and over the controls? Held-out splits, greedy, paired.

        SFT start      S warm-start steps on gold demonstrations (one run, shared by every arm)
        GRPO           G steps from the start (judge none: reward = correctness; train.py's defaults
                       for task sampling, unless flags say otherwise)
        RFT            G steps of rejection-sampling fine-tuning from the start: the same rollouts'
                       kind, supervised steps on the correct ones, as many as GRPO's (--update rft)
        SFT control    more SFT from the start, as many steps as the GRPO arm's wall time buys

    Every arm is evaluated on the whole of both held-out splits (--eval-size 0), in two forked
    processes with the weights in bf16 (train.py --eval-processes 2 --eval-dtype bf16: the
    evaluations are most of the benchmark's time): per-task outcomes,
    paired between arms, give each difference with a 95% interval (paired bootstrap) and McNemar's
    p. The GRPO arm runs --grpo-seeds times (default 2; seeds --seed, --seed + 1, ...): each run
    gets its row, and with several runs their mean is paired with the start, RFT and the control
    (each task's outcome averaged over the runs), with the spread of the runs' own differences
    beside it: what a seed alone moves. The control gets the GRPO runs' mean time. The start's
    pass@k at temperature 1 on --pass-tasks tasks of each held-out split is the headroom: greedy
    accuracy RL could reach there by making the policy pick, every time, what it already sometimes
    finds (RL raises pass@1 toward pass@k; where pass@k is 0 it has nothing to raise). A finished SFT
    start in runs/bench_learn/sft with the same settings is reused, and so is every arm that
    finished with the same flags (a benchmark stopped part way, or run again with more
    --grpo-seeds, runs only what is missing).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if args.sft_steps < 1 or args.grpo_steps < 1 or args.grpo_seeds < 1:
        raise SystemExit("python -m bench learn compares RL with SFT: --sft-steps, --grpo-steps and --grpo-seeds must be >= 1")
    t0 = time.perf_counter()
    out = os.path.join("runs", "bench_learn")
    # evaluations in two forked processes, bf16 weights (train.py --eval-processes, --eval-dtype; a flag of the
    # user's comes later and wins): the whole-split evaluations are most of the benchmark's time (BENCHMARKS.md, eval)
    common = ["--eval-split", "test,test_schema", "--eval-size", str(args.eval_size), "--judge", "none",
              "--eval-processes", "2", "--eval-dtype", "bf16", *args.train_flags]   # both splits, unless a flag says

    def records(arm):
        return run_records(os.path.join(out, arm))

    # 1) the shared start
    sft_argv = common + ["--sft-steps", str(args.sft_steps), "--steps", "0", "--seed", str(args.seed),
                         "--out", os.path.join(out, "sft")]
    train_unless_finished(sft_argv)
    start = os.path.join(out, "sft", "final")
    start_s = sum(r["time_step"] for r in records("sft") if "sft_step" in r) / args.sft_steps

    # 2) the arms, each from the start: GRPO (one run per seed), RFT with the first seed, then the control
    seeds = [args.seed + i for i in range(args.grpo_seeds)]
    grpo_names = [f"GRPO {args.grpo_steps}" + (f" seed {s}" if len(seeds) > 1 else "") for s in seeds]
    rft_name = f"RFT {args.grpo_steps}"
    folders = {name: "grpo" if i == 0 else f"grpo_seed{s}" for i, (name, s) in enumerate(zip(grpo_names, seeds))}
    folders[rft_name] = "rft"
    arm_flags = {**{name: ["--steps", str(args.grpo_steps), "--seed", str(s)] for name, s in zip(grpo_names, seeds)},
                 rft_name: ["--steps", str(args.grpo_steps), "--seed", str(args.seed), "--update", "rft"]}
    for name, flags in arm_flags.items():
        train_unless_finished(common + ["--adapter", start, "--sft-steps", "0", "--out", os.path.join(out, folders[name]), *flags])
    rl_steps = {name: [r for r in records(folders[name]) if "reward_mean" in r] for name in arm_flags}   # GRPO runs, RFT
    grpo_runs = {name: rl_steps[name] for name in grpo_names}
    grpo_s = sum(sum(r["time_step"] for r in steps) for steps in grpo_runs.values()) / len(grpo_runs)   # a run's mean
    extra = max(1, round(grpo_s / start_s))
    control = f"SFT +{extra} (control)"
    folders[control] = "control"       # new demonstrations: the warm start's sampler under another seed
    train_unless_finished(common + ["--adapter", start, "--sft-steps", str(extra), "--steps", "0", "--seed", str(args.seed + 1),
                                    "--out", os.path.join(out, "control")])

    # 3) the table: every arm on both splits, then the paired differences
    stored = read_json(os.path.join(out, "sft", "config.json"))    # a flag since removed is left out
    start_config = train.Config(**{k: v for k, v in stored.items() if k in train.Config.__dataclass_fields__})
    splits = start_config.eval_splits
    finals = {"SFT start": records("sft")[-1], **{name: records(folder)[-1] for name, folder in folders.items()}}
    per_split = {name: {split: evaluate.split_metrics(r, split) for split in splits} for name, r in finals.items()}
    if args.pass_tasks:
        limits = agentrl.Limits(start_config.max_turns, start_config.max_new_tokens, start_config.max_context)
        # the same draw of positions in every split: test_schema holds test's questions on another schema
        tasks = {split: random.Random(args.seed).sample(sql_env.load_tasks(start_config.data, split), args.pass_tasks)
                 for split in splits}
        rates = headroom(start, tasks, args.pass_k, args.seed, limits, start_config.model)
    print(f"\nlearn: {per_split['SFT start'][splits[0]]['eval_tasks']} tasks per held-out split, greedy | SFT start "
          f"{args.sft_steps} steps of {start_s:.1f} s | GRPO {args.grpo_steps} steps, {grpo_s:.0f} s"
          f"{' (the mean of its runs)' if len(seeds) > 1 else ''} = {extra} SFT steps")
    run = read_json(os.path.join(out, "grpo", "config.json"))
    print(f"GRPO: {run['groups_per_step']} groups x {run['group_size']} per step, temperature {run['temperature']}, "
          f"lr {run['lr']:g}, frontier share {train.FRONTIER_SHARE}, loss {run['loss']}; "
          f"SFT lr {run['sft_lr']:g}, {train.SFT_BATCH_SIZE} per step")
    header = "".join(f"{s + ' acc':>18}{'failed sub':>11}" for s in splits)
    print(f"{'agent':<24}{header}{'turns':>7}")
    for name, by_split in per_split.items():
        cells = "".join(f"{m['eval_accuracy']:>18.3f}{m['eval_failed_submit_rate'] or 0:>11.2f}" for m in by_split.values())
        print(f"{name:<24}{cells}{by_split[splits[0]]['eval_mean_turns']:>7.2f}")
    if args.pass_tasks:
        print(f"headroom of the start on {args.pass_tasks} tasks of each split at temperature 1: " + " | ".join(
            f"{split} pass@1 {p1:.3f}, pass@{args.pass_k} {pk:.3f}" for split, (p1, pk) in rates.items()))
    one_grpo = len(grpo_names) == 1      # one run: GRPO against every other arm; several: each against the start
    comparisons = ([(g, "SFT start") for g in grpo_names] + ([(grpo_names[0], rft_name), (grpo_names[0], control)] if one_grpo else [])
                   + [(rft_name, "SFT start"), (control, "SFT start")])
    outcomes = {name: split_outcomes(record) for name, record in finals.items()}
    print("paired differences (B -> A accuracy, A - B in points, 95% paired-bootstrap intervals, McNemar p):")
    for split in splits:
        templates = task_templates(start_config.data, split)
        for a, b in comparisons:
            assert per_split[a][split]["eval_task_ids"] == per_split[b][split]["eval_task_ids"], "arms evaluated on different tasks"
            print(f"  {split:<12} {a} - {b}: {paired_line(outcomes[b][split], outcomes[a][split], templates)}")
        for b in ([] if one_grpo else ["SFT start", rft_name, control]):
            runs = [outcomes[g][split] for g in grpo_names]
            print(f"  {split:<12} GRPO {args.grpo_steps} (its {len(runs)} runs) - {b}: {runs_line(outcomes[b][split], runs, templates)}")

    # 4) the signal GRPO had: mixed groups, batches trained, how far the policy moved
    for name, grpo_steps in grpo_runs.items():
        updated, run_s = [r for r in grpo_steps if not r["skipped"]], sum(r["time_step"] for r in grpo_steps)
        print(f"{name} signal: mixed groups {sum(r['trainable_groups'] for r in grpo_steps)}/"
              f"{sum(r['submitted_groups'] for r in grpo_steps)}, {len(updated)}/{len(grpo_steps)} batches trained | clip "
              f"fraction {record_mean('clip_frac_low', updated) + record_mean('clip_frac_high', updated):.3f}, KL to the sampler "
              f"{record_mean('kl_old', updated):.4f}, entropy {record_mean('entropy', updated):.3f} nats | train accuracy by step "
              + " ".join(f"{r['train_accuracy']:.2f}" for r in grpo_steps)
              + f" | step {run_s / len(grpo_steps):.0f} s, rollout {record_mean('time_rollout', grpo_steps) * len(grpo_steps) / run_s:.0%}")

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(per_split)
    colors = {name: f"C{i}" for i, name in enumerate(per_split)}     # an arm has one color in both panels
    for i, (name, by_split) in enumerate(per_split.items()):
        left.bar([j + i * width for j in range(len(splits))], [m["eval_accuracy"] for m in by_split.values()], width,
                 label=name, color=colors[name])
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(splits))], splits)
    left.set_ylabel("held-out accuracy (greedy)")
    left.legend(fontsize=8)
    for name, steps in rl_steps.items():
        right.plot([r["step"] for r in steps], [r["train_accuracy"] for r in steps], "o-", color=colors[name],
                   label=f"{name}: train accuracy")
    right.set_xlabel("step")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "learn.png"))
    print(f"curves: {os.path.join(out, 'learn.png')} | whole benchmark {(time.perf_counter() - t0) / 60:.0f} min")


CREDIT_ARMS = {   # folder of the first seed's run (--variants): (name, train.py flags)
    "grpo": ("GRPO", []),
    "credit": ("GRPO + step credit", ["--step-credit", "1"]),
    "branched": ("GRPO + step credit, branched", ["--step-credit", "1", "--branching", "uniform"]),
    "entropy": ("GRPO + step credit, entropy", ["--step-credit", "1", "--branching", "entropy"]),
}


def bench_credit(args):
    """Does credit for the turn that earned it help? Four arms from bench learn's SFT start, the same
    number of trajectories a step and of steps, --grpo-seeds runs each (seeds --seed, --seed + 1, ...):

        GRPO                           every token of a trajectory gets its episode advantage A^E
        GRPO + step credit             a turn's tokens get A^E + A^S, the step advantage at the
                                       states the group's trajectories share (--step-credit 1)
        GRPO + step credit, branched   the same on groups whose second half branches off the
                                       first half's states after a tool result (--branching uniform)
        GRPO + step credit, entropy    the same, the states drawn by the entropy of the turn sampled
                                       there (ARPO's rule, --branching entropy)

    --variants grpo,credit,... runs a subset. Each arm's runs are paired, task by task on whole held-out
    splits (--arm-splits: both, or test alone for half the evaluation time; the start is bench learn's,
    on both), with the start and
    with the GRPO runs (each task's outcome averaged over an arm's runs: runs_line), with 95% intervals
    by task and by query template. Per arm also: sampled (decoded) tokens per trajectory, seconds per
    step and in the rollout, the states several trajectories share a step (report.shared_states), their
    size, and the share of later turns taken from one. An arm's run evaluates one task at its start and end (the start's whole evaluation is the
    SFT run's), then its final adapter is evaluated on the whole splits (--eval-only, in held_out/):
    one evaluation an arm instead of two. Runs and evaluations already done are reused."""
    if args.sft_steps < 1 or args.grpo_steps < 1 or args.grpo_seeds < 1:
        raise SystemExit("python -m bench credit: --sft-steps, --grpo-steps and --grpo-seeds must be >= 1")
    out = os.path.join("runs", "bench_learn")
    common = ["--eval-size", str(args.eval_size), "--judge", "none", "--eval-processes", "2", "--eval-dtype", "bf16",
              *args.train_flags]
    train_unless_finished(["--eval-split", "test,test_schema", *common, "--sft-steps", str(args.sft_steps),
                           "--steps", "0", "--seed", str(args.seed), "--out", os.path.join(out, "sft")])
    start = os.path.join(out, "sft", "final")
    seeds = [args.seed + i for i in range(args.grpo_seeds)]
    arms = {CREDIT_ARMS[v][0]: (v, CREDIT_ARMS[v][1]) for v in chosen_variants(args, CREDIT_ARMS)}
    if "GRPO" not in arms:
        raise SystemExit("--variants: grpo, the baseline, and the arms to set beside it")
    folders = {name: [folder + (f"_seed{s}" if i else "") for i, s in enumerate(seeds)]
               for name, (folder, _) in arms.items()}
    for i, s in enumerate(seeds):              # every arm's first seed, then every arm's second, ...
        for name, (_, flags) in arms.items():
            # the steps, with one task evaluated (the start's evaluation is the SFT run's), then the whole splits
            folder = os.path.join(out, folders[name][i])
            train_unless_finished([*common, "--eval-split", "test", "--eval-size", "1", "--adapter", start,
                                   "--sft-steps", "0", "--steps", str(args.grpo_steps), "--seed", str(s),
                                   "--out", folder, *flags])
            held_out, final = os.path.join(folder, "held_out"), os.path.join(folder, "final")
            done = os.path.join(held_out, "eval_only.json")
            if not os.path.isfile(done) or os.path.getmtime(done) < os.path.getmtime(final):
                train.main([*common, "--eval-only", "--adapter", final, "--eval-split", args.arm_splits,
                            "--out", held_out])
    finals = {name: [evaluation_record(os.path.join(out, f, "held_out")) for f in runs] for name, runs in folders.items()}
    steps = {name: [r for f in runs for r in run_records(os.path.join(out, f)) if "reward_mean" in r]
             for name, runs in folders.items()}
    splits = list(split_outcomes(finals["GRPO"][0]))          # the arms' (--arm-splits)
    # the start's outcomes: its evaluation, or the episodes of one stopped part way (evals/sft_<split>.jsonl)
    evaluated = [split_outcomes(r) for r in run_records(os.path.join(out, "sft")) if "eval_outcomes" in r]
    episodes = {s: os.path.join(out, "sft", "evals", f"sft_{s}.jsonl") for s in splits}
    start_outcomes = evaluated[-1] if evaluated else {s: {e["task_id"]: int(e["correct"]) for e in read_jsonl(path)}
                                             for s, path in episodes.items() if os.path.isfile(path)}
    run = read_json(os.path.join(out, folders["GRPO"][0], "config.json"))
    print(f"\ncredit: {args.grpo_steps} steps of {run['groups_per_step']} groups x {run['group_size']} from an SFT start "
          f"of {args.sft_steps} steps, {len(seeds)} seeds an arm; held-out accuracy greedy, each arm the mean of its runs")
    print(f"{'arm':<30}" + "".join(f"{s + ' acc':>18}" for s in splits)
          + f"{'sampled tokens':>16}{'s/step':>8}{'rollout s':>10}{'shared':>9}{'size':>6}{'turns':>10}")
    if all(s in start_outcomes for s in splits):
        print(f"{'SFT start':<30}" + "".join(f"{sum(start_outcomes[s].values()) / len(start_outcomes[s]):>18.3f}" for s in splits))
    for name, records in steps.items():
        accuracy = [sum(evaluate.split_metrics(r, s)["eval_accuracy"] for r in finals[name]) / len(seeds) for s in splits]
        trajectories = sum(r["submitted_groups"] for r in records) * run["group_size"]
        # the states several trajectories share and act from (report.shared_states); 0 in older runs
        shared = sum(r.get("shared_states", 0) for r in records)
        print(f"{name:<30}" + "".join(f"{a:>18.3f}" for a in accuracy)
              + f"{sum(r['gen_tokens'] for r in records) / trajectories:>16.1f}{record_mean('time_step', records):>8.0f}"
              f"{record_mean('time_rollout', records):>10.0f}{shared / len(records):>9.1f}"
              f"{sum(r.get('shared_state_size', 0) * r.get('shared_states', 0) for r in records) / max(1, shared):>6.1f}"
              f"{record_mean('shared_turn_share', records):>10.0%}")
    print("paired (each arm's runs averaged task by task; 95% paired-bootstrap intervals):")
    for split in splits:
        templates = task_templates(run["data"], split)
        grpo = [split_outcomes(r)[split] for r in finals["GRPO"]]
        grpo_mean = {t: sum(o[t] for o in grpo) / len(grpo) for t in grpo[0]}
        for name in arms:
            runs = [split_outcomes(r)[split] for r in finals[name]]
            if split in start_outcomes:
                print(f"  {split:<12} {name} - SFT start: {runs_line(start_outcomes[split], runs, templates)}")
            if name != "GRPO":
                print(f"  {split:<12} {name} - GRPO: {runs_line(grpo_mean, runs, templates)}")


def bench_sweep(args):
    """Which RL learning rate and LoRA rank? Chosen on the validation slice of train, never on the
    held-out splits (choosing there would spend the measurement every learning claim rests on).

    For each rank in --sweep-ranks, one start of --sft-steps warm-start steps at that rank; from it,
    --grpo-steps GRPO steps at each lr in --sweep-lrs (judge none: reward = correctness). lora_alpha
    stays train.py's, so the LoRA scale is alpha / r: with it a good lr moves little with the rank
    ("LoRA Without Regret", Thinking Machines 2025), and the rank's own effect shows. Every run
    evaluates greedily on split val (sql_env.VAL_SIZE train tasks, which every run here leaves out
    of its training; --eval-size N: N of them), and each is paired task by task with its start.
    The pick is the run with the best validation accuracy: the whole recipe at that rank and lr.
    Runs that finished with the same flags are reused.
    """
    try:
        lrs = [float(lr) for lr in args.sweep_lrs.split(",")]
        ranks = [int(r) for r in args.sweep_ranks.split(",")]
    except ValueError:
        raise SystemExit(f"--sweep-lrs and --sweep-ranks: comma-separated numbers, got {args.sweep_lrs!r} and {args.sweep_ranks!r}")
    if args.sft_steps < 1 or args.grpo_steps < 1 or min(lrs) <= 0 or min(ranks) < 1:
        raise SystemExit("python -m bench sweep: --sft-steps and --grpo-steps >= 1, every lr > 0, every rank >= 1")
    own = [flag for flag in args.train_flags if flag.split("=")[0] in ("--eval-split", "--lora-r", "--lr", "--adapter", "--out")]
    if own:
        raise SystemExit(f"python -m bench sweep sets {', '.join(own)} itself: leave it out (the grid is --sweep-ranks and --sweep-lrs)")
    t0 = time.perf_counter()
    out = os.path.join("runs", "bench_sweep")
    common = ["--eval-split", "val", "--eval-size", str(args.eval_size), "--judge", "none", "--seed", str(args.seed),
              *args.train_flags]
    rows = []                                  # (rank, lr, start record, run folder)
    for rank in ranks:
        start = os.path.join(out, f"sft_r{rank}")
        train_unless_finished(common + ["--lora-r", str(rank), "--sft-steps", str(args.sft_steps), "--steps", "0", "--out", start])
        start_record = run_records(start)[-1]
        for lr in lrs:
            run = os.path.join(out, f"r{rank}_lr{lr:g}")
            train_unless_finished(common + ["--lora-r", str(rank), "--adapter", os.path.join(start, "final"), "--sft-steps", "0",
                                            "--steps", str(args.grpo_steps), "--lr", f"{lr:g}", "--out", run])
            rows.append((rank, lr, start_record, run))

    print(f"\nsweep: {len(split_outcomes(rows[0][2])['val'])} validation tasks (train tasks no run here trained on), greedy | a start of "
          f"{args.sft_steps} SFT steps per rank, then {args.grpo_steps} GRPO steps per lr")
    print(f"{'rank':>5}{'lr':>9}{'start':>8}{'after':>8}   {'after - start, 95% interval, McNemar p':<42}"
          f"{'mixed groups':>13}{'clip':>7}{'KL':>8}{'min':>6}")
    results = []
    for rank, lr, start_record, run in rows:
        records = run_records(run)
        before, after = split_outcomes(start_record)["val"], split_outcomes(records[-1])["val"]
        tasks = list(before)
        mean, (low, high), p = paired_difference([before[t] for t in tasks], [after[t] for t in tasks])
        steps = [r for r in records if "reward_mean" in r]
        updated = [r for r in steps if not r["skipped"]]
        accuracy = sum(after.values()) / len(after)
        results.append((accuracy, rank, lr, mean))
        print(f"{rank:>5}{lr:>9g}{sum(before.values()) / len(before):>8.3f}{accuracy:>8.3f}   "
              f"{f'{100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}], p={p:.3f}':<42}"
              f"{sum(r['trainable_groups'] for r in steps):>6}/{sum(r['submitted_groups'] for r in steps):<6}"
              f"{record_mean('clip_frac_low', updated) + record_mean('clip_frac_high', updated):>7.3f}"
              f"{record_mean('kl_old', updated):>8.4f}"
              f"{sum(r['time_step'] for r in steps) / 60:>6.1f}")
    accuracy, rank, lr, mean = max(results, key=lambda r: r[0])      # the first of equals: the order asked
    print(f"best on validation: --lora-r {rank} --lr {lr:g} (accuracy {accuracy:.3f}, {100 * mean:+.1f} points over its start) "
          f"| whole sweep {(time.perf_counter() - t0) / 60:.0f} min")


