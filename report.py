"""What a training run reports: its step line, metrics.jsonl and trajectories/ as it runs, the
summary at its end, and one static HTML page built from its folder.

    python report.py runs/default      # rebuild runs/default/report.html from the folder
    write_report("runs/default")       # what train.py calls at each step and at the end
    step_record(...), step_line(...)   # a step's metrics, and the one line train.py prints of them

Reads a run folder (config.json, metrics.jsonl, trajectories/step_XXXX.jsonl, all written by
train.py, and progress.png, which `write_plot` draws from the metrics) and writes `report.html`:
one self-contained file any browser opens from disk (no server, no network, no JavaScript; inline
CSS, the plot as a base64 PNG, long parts folded with <details>).

The page, top to bottom: the config; held-out accuracy by phase (where RL started, steps), split
and tier, and the start and end paired by question; the learning curves; then every step and its groups.
A group shows its question and gold SQL, the messages all its trajectories share once (as the judge's
prompt prints them: common_prefix_length), then each trajectory, numbered as the judge's prompt numbers
them: its turns, whether it was correct, its reward, its advantage, the judge's score and explanation.

Invariants: everything taken from a trajectory (model output, agent SQL, observations, the
judge's text) reaches the page only through html.escape; a line of a run's files that cannot be
read (a run killed mid-write) is skipped and counted on the page, never fatal.

Simplifications, and why they are safe: the SQL highlighter colours keywords, strings and numbers
with one regular expression and never changes the text; a trajectory is shown in full after the
shared prefix, where the judge's tree also shares branches (the page reads one trajectory at a time).
"""
import argparse
import base64
import html
import json
import os
import re
import resource
import sys
import time
from pathlib import Path

import agentrl
import evaluate
import grpo
import judge
import parallel
from evaluate import behaviour, episode_record, format_evals, format_history, paired_line, split_outcomes
from files import atomic_path, common_prefix_length, read_jsonl, write_text_atomic
from sql_env import TIERS

# ----------------------------------------------------------------------------- reading a run folder


def read_run(run_dir) -> dict:
    """Everything the page shows, read from the folder: config, metrics, trajectories by step."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir}: not a run folder (no metrics.jsonl; train.py --out writes one)")
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    metrics, unreadable = read_jsonl(run_dir / "metrics.jsonl", skip_unreadable=True)
    trajectories = {}
    for path in sorted((run_dir / "trajectories").glob("step_*.jsonl")):
        records, bad = read_jsonl(path, skip_unreadable=True)
        trajectories[int(path.stem[len("step_"):])] = records
        unreadable += bad
    plot = run_dir / "progress.png"
    return {"name": run_dir.resolve().name, "config": config, "metrics": metrics,
            "trajectories": trajectories, "plot": plot.read_bytes() if plot.is_file() else None,
            "unreadable": unreadable}


def groups_of(records) -> list[list[dict]]:
    """A step's trajectory records split into its groups: by their `group` index, or, in files
    written before it was recorded, by runs of the same task id."""
    groups, key = [], None
    for record in records:
        this = record.get("group", record.get("task_id"))
        if not groups or this != key:
            groups.append([])
            key = this
        groups[-1].append(record)
    return groups


def split_results(record) -> list[tuple[str, dict]]:
    """(split, {accuracy, tasks, by_tier}) for every split in an evaluation record: the first under
    the eval_* keys (named by eval_split), each other under its own name (test_schema_accuracy)."""
    prefixes = ["eval"] + [k[:-len("_accuracy_by_tier")] for k in record
                           if k.endswith("_accuracy_by_tier") and k != "eval_accuracy_by_tier"]
    return [(record.get("eval_split", "eval") if prefix == "eval" else prefix,
             {"accuracy": record.get(f"{prefix}_accuracy"), "tasks": record.get(f"{prefix}_tasks"),
              "by_tier": record.get(f"{prefix}_accuracy_by_tier") or {}}) for prefix in prefixes]


# ----------------------------------------------------------------------------- small renderers
def esc(value) -> str:
    """Any value as escaped text: the only way untrusted text reaches the page."""
    return html.escape(str(value), quote=True)


def number(value, digits=3) -> str:
    if value is None:
        return "&ndash;"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return esc(value)
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


SQL_KEYWORDS = set("""SELECT FROM WHERE JOIN INNER LEFT RIGHT OUTER CROSS NATURAL ON USING GROUP BY ORDER
HAVING LIMIT OFFSET AS AND OR NOT IN IS NULL LIKE GLOB BETWEEN EXISTS DISTINCT ALL UNION INTERSECT EXCEPT CASE
WHEN THEN ELSE END ASC DESC WITH RECURSIVE COUNT SUM AVG MIN MAX CAST ROUND COALESCE IFNULL LENGTH LOWER UPPER
SUBSTR STRFTIME DATE""".split())
SQL_TOKEN = re.compile(r"(?P<string>'(?:[^']|'')*'?)|(?P<number>\b\d+(?:\.\d+)?\b)|"
                       r"(?P<word>[A-Za-z_]\w*)|(?P<other>.)", re.DOTALL)


def highlight_sql(sql: str) -> str:
    """SQL as escaped HTML with keywords, strings and numbers in spans; the text itself unchanged."""
    parts = []
    for match in SQL_TOKEN.finditer(sql):
        text, kind = esc(match.group()), match.lastgroup
        if kind == "word" and match.group().upper() in SQL_KEYWORDS:
            kind = "kw"
        parts.append(f'<span class="{kind}">{text}</span>' if kind in ("kw", "string", "number") else text)
    return "".join(parts)


def sql_block(sql, missing="none") -> str:
    return (f'<pre class="sql">{highlight_sql(sql)}</pre>' if isinstance(sql, str)
            else f'<p class="none">{missing}</p>')


def render_message(message, turn=None) -> str:
    """One message: a tool call by name with its arguments (a query highlighted) and any text written
    around it, an observation as text (errors marked), anything else (system prompt, question, prose)
    as text."""
    role, content = str(message.get("role", "?")), str(message.get("content", ""))
    label = esc(role) + (f" &middot; turn {turn}" if turn else "")
    if role == "assistant":
        try:
            name, args = agentrl.parse_tool_call(content)
        except agentrl.ToolCallError as e:
            body = f'<p class="note">no usable tool call: {esc(e)}</p><pre class="text">{esc(content)}</pre>'
        else:
            shown = [sql_block(v) if k == "query" and isinstance(v, str) else f'<pre class="text">{esc(k)}: '
                     f'{esc(json.dumps(v) if not isinstance(v, str) else v)}</pre>'
                     for k, v in args.items()]
            around = agentrl.TOOL_CALL_RE.sub("", content, count=1).strip()
            shown += [f'<pre class="text">{esc(around)}</pre>'] if around else []
            body = f'<div class="call"><span class="tool">{esc(name)}</span>{"".join(shown)}</div>'
    else:
        error = role == "tool" and content.startswith("Error:")
        body = f'<pre class="text{" error" if error else ""}">{esc(content)}</pre>'
    return f'<div class="msg {esc(role)}"><div class="role">{label}</div>{body}</div>'


def render_table(header, rows) -> str:
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# ----------------------------------------------------------------------------- the sections
def render_config(config) -> str:
    if not config:
        return "<p class=\"none\">no config.json in the folder</p>"
    key_settings = ", ".join(f"{k}={esc(config[k])}" for k in ("model", "data", "steps", "groups_per_step",
                                                               "group_size", "judge", "bonus", "lr")
                             if k in config)
    rows = [(esc(k), f"<code>{esc(json.dumps(v))}</code>") for k, v in config.items()]
    return (f"<details><summary>{len(config)} settings: {key_settings}</summary>"
            f"{render_table(['setting', 'value'], rows)}</details>")


def render_evals(metrics) -> str:
    evals = [r for r in metrics if "eval_accuracy" in r]
    if not evals:
        return "<p class=\"none\">no evaluation yet</p>"
    results = [(r.get("phase") or f"step {r.get('step')}", split, m)
               for r in evals for split, m in split_results(r)]
    seen = {tier for _, _, m in results for tier in m["by_tier"]}
    tiers = [t for t in TIERS if t in seen] + sorted(seen - set(TIERS))
    rows = [(esc(phase), esc(split), f"<b>{number(m['accuracy'])}</b>", number(m["tasks"]),
             *(number(m["by_tier"].get(t), 2) for t in tiers)) for phase, split, m in results]
    table = render_table(["phase", "split", "accuracy", "tasks", *map(esc, tiers)], rows)
    # where RL started, as train.py's summary pairs it
    start = [r for r in evals if r.get("step") == 0][-1:]
    if not start or start[0] is evals[-1]:
        return table
    before, after = evaluate.split_outcomes(start[0]), evaluate.split_outcomes(evals[-1])
    paired = "".join(f"<li>{esc(split)}: {esc(evaluate.paired_line(before[split], after[split]))}</li>"
                     for split in before if split in after)
    return table + (f"<p>RL start &rarr; end, paired by question "
                    f"(95% bootstrap interval, exact McNemar p):</p><ul>{paired}</ul>")


def render_plot(png) -> str:
    if png is None:
        return "<p class=\"none\">no plot yet (progress.png is written after the first step)</p>"
    data = base64.b64encode(png).decode("ascii")
    return (f'<img class="plot" alt="reward, train accuracy and held-out accuracy by step" '
            f'src="data:image/png;base64,{data}">')


def messages_of(record) -> list[dict]:
    """A record's conversation as {role, content} strings, whatever a damaged file holds."""
    messages = record.get("messages") if isinstance(record.get("messages"), list) else []
    return [{"role": str(m.get("role", "?")), "content": str(m.get("content", ""))} if isinstance(m, dict)
            else {"role": "?", "content": str(m)} for m in messages]


def render_trajectory(record, messages, number_in_group, judge_number, prefix_length, anchor) -> str:
    """One trajectory after the group's shared prefix, with its outcome and what training made of it."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    question_at = users[-1] if users else -1        # turns are counted from the question on
    turns, parts = 0, []
    for i, message in enumerate(messages):
        turn = None
        if message["role"] == "assistant" and i > question_at:
            turns += 1
            turn = turns
        if i >= prefix_length:
            parts.append(render_message(message, turn))
    correct, advantage = bool(record.get("correct")), record.get("advantage")
    if isinstance(advantage, list) and len(set(advantage)) == 1:
        advantage = advantage[0]                  # every turn the same: GRPO's one a trajectory
    per_turn = isinstance(advantage, list)        # with --step-credit: A^E + w * A^S, a turn each
    known = isinstance(advantage, (int, float)) or per_turn and advantage
    mean = sum(advantage) / len(advantage) if per_turn and advantage else advantage
    sign = "pos" if known and mean > 0 else "neg" if known and mean < 0 else ""
    head = [f'<span class="badge">{"correct" if correct else "wrong"}</span> <b>trajectory '
            f'{number_in_group}</b>' + (f" (the judge's {judge_number}: it sees identical trajectories once)"
                                        if judge_number != number_in_group else ""),
            f"reward {number(record.get('reward'))}",
            f'advantage{" by turn" * per_turn} <span class="{sign}">'
            f'{" ".join(map(number, advantage)) if per_turn else number(advantage)}</span>',
            f"stop: {esc(record.get('stop_reason', '?'))}"]
    score, explanation = record.get("judge_score"), record.get("judge_explanation") or ""
    judged = (f'judge {number(score, 2)}: {esc(explanation) or "(no explanation)"}' if score is not None
              else "not judged (no judge, or the judge could not score this group)")
    submitted = sql_block(record.get("submitted_sql"), "no query submitted")
    return (f'<div class="trajectory {"right" if correct else "wrong"}" id="{anchor}">'
            f'<div class="head">{" &middot; ".join(head)}</div><p class="judge">{judged}</p>{"".join(parts)}'
            f'<div class="submitted"><span class="label">submitted</span>{submitted}</div></div>')


def render_tree(records, conversations, prefix) -> str:
    """The group's tree of turns past the messages all share: each turn (the call the model wrote)
    with the trajectories through it and their mean reward. Where trajectories that took one turn
    (and got one answer) part, they part from a state they share: where step credit (--step-credit)
    compares what each did next."""
    tree = judge.conversation_tree(conversations)

    def mean_reward(rows):
        rewards = [r for r in (records[i].get("reward") for i in rows) if isinstance(r, (int, float))]
        return number(sum(rewards) / len(rewards)) if rewards else number(None)

    def turns(node, depth):         # the <li> of the assistant turns below node (depth: its messages so far)
        items = []
        for child in node.children:
            below = turns(child, depth + 1)
            if child.messages[0]["role"] != "assistant" or depth < prefix:
                items += below
                continue
            items.append(f"<li><code>{esc(child.messages[0]['content'][:100])}</code> &middot; "
                         f"{len(child.through)} trajector{'ies' if len(child.through) > 1 else 'y'}, "
                         f"mean reward {mean_reward(child.through)}"
                         + (f"<ul>{''.join(below)}</ul>" if below else "")
                         + "</li>")
        return items

    return (f'<details class="turns"><summary>the group as a tree of turns (mean reward '
            f'{mean_reward(tree.through)})</summary><ul class="tree">{"".join(turns(tree, 0))}</ul>'
            '</details>')


def render_group(records, step, g) -> str:
    """A group: its task once, the messages all its trajectories share once, then each trajectory."""
    first, conversations = records[0], [messages_of(r) for r in records]
    prefix = common_prefix_length([[(m["role"], m["content"]) for m in c] for c in conversations])
    ids = judge.judge_ids(judge.conversation_tree(conversations))
    right = sum(bool(r.get("correct")) for r in records)
    shared = "".join(render_message(m) for m in conversations[0][:prefix])
    trajectories = "".join(render_trajectory(r, c, k, ids[k - 1], prefix, f"s{step:04d}-g{g}-t{k}")
                           for k, (r, c) in enumerate(zip(records, conversations), 1))
    reasoning = first.get("judge_reasoning") or ""     # the judge's thinking before its verdict, never scored
    if reasoning:
        trajectories = (f"<details class=\"prefix\"><summary>the judge's reasoning before its verdict (not "
                        f"scored; clipped)</summary><pre>{esc(reasoning)}</pre></details>") + trajectories
    return (f'<section class="group" id="s{step:04d}-g{g}">'
            f'<h3>group {g} &middot; {esc(first.get("difficulty", "?"))} '
            f"&middot; {right}/{len(records)} correct &middot; {esc(first.get('task_id', '?'))}</h3>"
            f'<p class="question">{esc(first.get("question", ""))}</p>'
            f'<div class="gold"><span class="label">gold SQL</span>{sql_block(first.get("gold_sql"))}</div>'
            f"<details class=\"prefix\"><summary>shared by all {len(records)} trajectories: "
            f"{prefix} messages, printed once in the judge's prompt</summary>{shared}</details>"
            f"{render_tree(records, conversations, prefix)}{trajectories}</section>")


def render_steps(metrics, trajectories) -> str:
    step_records = {r["step"]: r for r in metrics if "reward_mean" in r and isinstance(r.get("step"), int)}
    steps = sorted(set(step_records) | set(trajectories))
    if not steps:
        return "<p class=\"none\">no GRPO step yet</p>"
    parts = []
    for step in steps:
        r = step_records.get(step, {})
        summary = (f"step {step} &middot; reward {number(r.get('reward_mean'))} "
                   f"&plusmn; {number(r.get('reward_std'))} "
                   f"&middot; train accuracy {number(r.get('train_accuracy'))} &middot; mixed groups "
                   f"{number(r.get('mixed_candidates'))} of {number(r.get('candidate_groups'))} rolled out, "
                   f"{number(r.get('trainable_groups'))} trained on"
                   + (f" &middot; judge agreement {number(r['judge_agreement'], 2)} "
                      f"({r.get('judge_agreement_groups')} groups)"
                      if r.get("judge_agreement") is not None else "")
                   + (" &middot; update skipped" if r.get("skipped") else " &middot; update applied"))
        groups = "".join(render_group(records, step, g)
                         for g, records in enumerate(groups_of(trajectories.get(step, [])), 1))
        groups = groups or '<p class="none">no trajectories saved</p>'
        parts.append(f'<details class="step" id="step-{step:04d}"{" open" if step == steps[-1] else ""}>'
                     f"<summary>{summary}</summary>{groups}</details>")
    return "".join(parts)


STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1100px; padding: 1em 2em;
       color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; margin-top: 1.6em; }
h3 { font-size: 1em; margin: 0 0 0.3em; }
.meta, .none, .note { color: #666; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 2px 8px; text-align: left; }
th { background: #f3f3f3; } code { font-size: 0.9em; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; margin: 0.2em 0;
      font: 13px/1.35 ui-monospace, monospace; }
img.plot { max-width: 100%; border: 1px solid #ddd; }
details.step { border: 1px solid #ccc; border-radius: 4px; margin: 0.5em 0; padding: 0.3em 0.8em; }
details.step > summary { font-weight: 600; cursor: pointer; }
section.group { border-top: 2px solid #bbb; margin-top: 0.8em; padding-top: 0.5em; }
.question { font-size: 1.05em; font-style: italic; margin: 0.2em 0; }
details.prefix, details.turns { margin: 0.4em 0; }
details.prefix > summary, details.turns > summary { color: #555; cursor: pointer; }
.trajectory { border-left: 5px solid #c33; background: #fdf6f6; margin: 0.6em 0; padding: 0.3em 0.8em; }
.trajectory.right { border-left-color: #2a2; background: #f5fbf5; }
.badge { color: #fff; background: #c33; border-radius: 3px; padding: 0 6px; font-size: 0.85em; }
.right .badge { background: #2a2; }
.judge { color: #444; margin: 0.2em 0; }
.msg { margin: 0.3em 0 0.3em 0.5em; } .role { font-size: 0.8em; color: #777; text-transform: uppercase; }
.msg.tool pre, .msg.system pre { background: #f4f4f4; padding: 2px 6px; }
pre.error { background: #fde8e8 !important; }
.call .tool { font-weight: 600; color: #245; }
pre.sql { background: #f1f4fa; padding: 2px 6px; }
.label { font-size: 0.8em; color: #777; text-transform: uppercase; margin-right: 0.5em; }
.kw { color: #0b4fa8; font-weight: 600; } .string { color: #a3411a; } .number { color: #7a3a9a; }
.pos { color: #2a2; font-weight: 600; } .neg { color: #c33; font-weight: 600; }
"""


def render(run) -> str:
    """The whole page for a run read by read_run."""
    config, metrics = run["config"], run["metrics"]
    n = sum(len(records) for records in run["trajectories"].values())
    done = max((r["step"] for r in metrics if "reward_mean" in r and isinstance(r.get("step"), int)),
               default=0)
    bonus = config.get("bonus", "bonus")
    std = "" if config.get("no_std_scaling") else " / std"
    unreadable = (f" &middot; {run['unreadable']} unreadable lines skipped" if run["unreadable"] else "")
    return f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>agentrl run {esc(run['name'])}</title><style>{STYLE}</style></head>
<body>
<h1>agentrl run {esc(run['name'])}</h1>
<p class="meta">step {done} of {esc(config.get('steps', '?'))} &middot; {n} trajectories &middot; written
{time.strftime('%Y-%m-%d %H:%M:%S')}{unreadable}</p>
<h2>Config</h2>
{render_config(config)}
<h2>Held-out accuracy</h2>
<p class="meta">Greedy, one episode per question; by phase (where RL started: after the warm start or the
--adapter; after a step) and tier.</p>
{render_evals(metrics)}
<h2>Learning curves</h2>
{render_plot(run['plot'])}
<h2>Steps</h2>
<p class="meta">Each step's groups: one task, several trajectories. reward = judge score + {esc(bonus)}
&times; correct; advantage = (reward &minus; group mean){std}, the weight the update gave the trajectory's
tokens (&ndash;: not trained on: its group's rewards were all equal, or the row was cut on non-finite logits);
with --step-credit, one a turn, plus w times the turn's step advantage (a turn it copied, branched, is
its parent's to train on).
Trajectories are numbered in group order, as the judge's prompt numbers them.</p>
{render_steps(metrics, run['trajectories'])}
</body>
</html>
"""


def write_report(run_dir) -> Path:
    """Read the run folder and (re)write its report.html atomically; returns the page's path."""
    path = Path(run_dir) / "report.html"
    write_text_atomic(path, render(read_run(run_dir)))
    return path


def write_plot(run_dir, metrics) -> Path:
    """run_dir/progress.png from the run's metrics records (metrics.jsonl): train reward (mean and
    spread), accuracy, the share of mixed groups and the judge's agreement (when one ran) per step,
    held-out accuracy per split. Returns its path."""
    import matplotlib        # here, not at the top: only train.py draws, and it is slow to import
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in metrics if "reward_mean" in r]
    evals = [r for r in metrics if "eval_accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    steps, reward = [r["step"] for r in train], [r["reward_mean"] for r in train]
    ax.plot(steps, reward, label="train reward (mean, \u00b1 sd shaded)")
    spread = [r.get("reward_std", 0.0) for r in train]       # (not in the records of older runs)
    ax.fill_between(steps, [m - s for m, s in zip(reward, spread)], [m + s for m, s in zip(reward, spread)],
                    alpha=0.15)
    ax.plot(steps, [r["train_accuracy"] for r in train], label="train accuracy (every rollout)")
    mixed = [r for r in train if "candidate_groups" in r]
    ax.plot([r["step"] for r in mixed], [r["mixed_candidates"] / r["candidate_groups"] for r in mixed], ":",
            label="mixed groups (share of those rolled out)")
    judged = [r for r in train if r.get("judge_agreement") is not None]
    if judged:          # a judge ran: how often it ranked right above wrong (0.5: a coin)
        ax.plot([r["step"] for r in judged], [r["judge_agreement"] for r in judged], "x-.",
                label="judge agreement with correctness")
    ax.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-",
            label=(f"held-out accuracy, {evals[0].get('eval_split', 'eval')} (greedy)" if evals
                   else "held-out accuracy"))
    others = [k for k in (evals[0] if evals else {}) if k.endswith("_accuracy") and k != "eval_accuracy"]
    for key in others:            # the other held-out splits (test_schema_accuracy, ...)
        ax.plot([r["step"] for r in evals if key in r], [r[key] for r in evals if key in r], "s--",
                label=f"held-out accuracy, {key[:-len('_accuracy')]} (greedy)")
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(run_dir) / "progress.png"
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- what a run prints and logs
def judge_counters(results):
    """How the judge fared this step, so a bad judge shows at once: groups whose reply was on
    another scale and rescaled in order, and correction turns sent (unusable replies, scores
    above 1). Groups it left unscored are judge_failed_groups (score_groups)."""
    return {"judge_rescaled_groups": sum(bool(r.rescaled) for r in results),
            "judge_corrections": sum(max(0, r.attempts - 1) for r in results)}


def judge_agreement(groups, results):
    """How far to trust the judge this step: over the groups it scored that hold both right and
    wrong rollouts, the mean share of (right, wrong) pairs it ranked the right way (judge.agreement),
    and how many groups that is. None where no group had both."""
    values = [a for group, r in zip(groups, results) if r.scored and
              (a := judge.agreement(r.scores, [t.correct for t in group.trajectories])) is not None]
    return {"judge_agreement": sum(values) / len(values) if values else None,
            "judge_agreement_groups": len(values)}


def judge_noise_warning(records, least_groups=8, margin=0.1):
    """A plain warning, or None: the judge's agreement with execution correctness over the run's
    step records so far is within `margin` of the 0.5 a coin would score (after `least_groups` groups)."""
    counted = [r for r in records if r.get("judge_agreement") is not None]
    groups = sum(r["judge_agreement_groups"] for r in counted)
    if groups < least_groups:
        return None
    mean = sum(r["judge_agreement"] * r["judge_agreement_groups"] for r in counted) / groups
    if abs(mean - 0.5) >= margin:
        return None
    return (f"warning: over {groups} groups the judge ranked a right rollout above a wrong one {mean:.0%} of "
            f"the time, about as often as a coin would: its scores add noise to the reward. Try a stronger "
            f"--judge-model, or train on correctness alone with --judge none.")


def append_jsonl(path, record):
    if not parallel.is_main():   # every writer of the run folder: rank 0 only
        return
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def shared_states(groups):
    """Where step credit has turns to compare: the states past the prompt from which two or more of a
    group's trajectories take their next turn (grpo.step_advantages), as (their sizes, the turns taken
    past each trajectory's first, those of them taken from such a state)."""
    sizes, later = [], 0

    def visit(state, past_prompt):
        nonlocal later
        taking = sum(len(turn.through) for turn in state.children)
        if past_prompt:
            later += taking
            sizes.extend([taking] * (taking >= 2))
        for turn in state.children:
            visit(turn, True)

    for group in groups:
        for prompt in group.tree.children:
            visit(prompt, False)
    return sizes, later, sum(sizes)


def step_record(step, **extra):
    """One step's metrics, the record in metrics.jsonl (step_line prints the gist), from what the step
    did (train.Step): its kept groups and their rewards, every rolled-out group's pass rate (with
    --branching over all its rows, as the choice of groups reads it), make_batch's counts, the
    update's stats, the judge's results and the times; extra: more figures (frontier_tasks)."""
    trajectories = [t for g in step.groups for t in g.trajectories]
    flat_rewards = [r for rs in step.rewards for r in rs]
    reward_mean = sum(flat_rewards) / len(flat_rewards)
    sizes, later_turns, shared_turns = shared_states(step.groups)
    return {
        "step": step.number,
        "reward_mean": reward_mean,
        "reward_std": (sum((r - reward_mean) ** 2 for r in flat_rewards) / len(flat_rewards)) ** 0.5,
        # every rolled-out candidate's
        "train_accuracy": sum(rate for _, rate in step.pass_rates) / len(step.pass_rates),
        "candidate_groups": len(step.pass_rates),
        "mixed_candidates": sum(0 < rate < 1 for _, rate in step.pass_rates),
        "trainable_groups": step.counts["trainable_groups"],
        "mixed_group_rate": sum(0 < sum(t.correct for t in g.trajectories) < len(g.trajectories)
                                for g in step.groups) / len(step.groups),
        "no_signal_groups": step.counts["no_signal_groups"],
        "too_small_groups": step.counts["too_small_groups"],
        "non_finite_trajectories": step.counts["non_finite_trajectories"],
        "shared_states": len(sizes),                       # of the kept groups (shared_states)
        "shared_state_size": sum(sizes) / max(1, len(sizes)),
        "shared_turn_share": shared_turns / max(1, later_turns),
        "submitted_groups": len(step.groups),
        "kept_accuracy": sum(t.correct for t in trajectories) / len(trajectories),   # the groups trained on
        "mean_turns": sum(t.num_turns for t in trajectories) / len(trajectories),
        "tool_error_rate": sum(t.num_tool_errors for t in trajectories)
                           / max(1, sum(t.num_tool_calls for t in trajectories)),
        **behaviour(trajectories),
        "gen_tokens": sum(sum(t.assistant_mask) for t in trajectories),
        # every rollout's, trained or not (stats' entropy: the trained)
        "rollout_entropy": grpo.sampled_entropy(trajectories),
        "judge_failed_groups": step.judge_failed, **judge_counters(step.results),
        **judge_agreement(step.groups, step.results), **step.times, **extra,
        **{k: v for k, v in step.stats.items() if isinstance(v, (int, float, bool, str))},
    }


def step_line(record, steps):
    """A step as one line: the signal found, the reward, how far the update moved, whether it ran."""
    clipped = (f"clipped {record['clip_frac_low'] + record['clip_frac_high']:.1%} of tokens | "
               if "clip_frac_low" in record else "")       # (--update rft clips nothing)
    update = (f"update skipped ({record.get('skip_reason', 'unknown')})" if record["skipped"]
              else clipped + "update applied")
    judged = (f" | judge agreement {record['judge_agreement']:.2f} ({record['judge_agreement_groups']}"
              f" groups)" if record.get("judge_agreement") is not None else "")
    if (record.get("judge_failed_groups") or record.get("judge_rescaled_groups")
            or record.get("judge_corrections")):
        judged += (f" | judge: {record['judge_failed_groups']} groups failed, "
                   f"{record['judge_rescaled_groups']} rescaled, {record['judge_corrections']} corrections")
    return (f"step {record['step']}/{steps} | "
            f"mixed groups {record['mixed_candidates']}/{record['candidate_groups']}, "
            f"{record['trainable_groups']} trained on | kept groups: reward {record['reward_mean']:.2f} ± "
            f"{record['reward_std']:.2f}, accuracy {record['kept_accuracy']:.2f} | every candidate: accuracy "
            f"{record['train_accuracy']:.2f} | shared states {record['shared_states']} "
            f"({record['shared_state_size']:.1f} trajectories each, "
            f"{record['shared_turn_share']:.0%} of later turns) | {update}{judged} | "
            f"{record['time_step']:.0f} s")


def write_trajectories(run_dir, step, trained=True):
    """trajectories/step_XXXX.jsonl: every conversation of the step (train.Step) with its reward,
    judgement and advantage, one a turn (the value on its first token); None for a trajectory not
    trained on (its group carried no signal, or the row was cut), and for all with trained=False
    (--update rft: no advantage is trained). Rank 0 only."""
    if not parallel.is_main():
        return
    lines = []
    for g, (group, rewards, result, advantages) in enumerate(zip(step.groups, step.rewards, step.results,
                                                                 step.advantages)):
        for i, (t, a) in enumerate(zip(group.trajectories, advantages)):
            lines.append(json.dumps({
                "step": step.number, "group": g, **episode_record(group.task, t),
                "reward": rewards[i], "judge_score": result.scores[i] if result.scores else None,
                "judge_explanation": result.explanations[i] if result.explanations else "",
                "judge_reasoning": result.reasoning,
                "advantage": [a[start] for start, _ in t.turns] if a and trained else None,
                "judge_rescaled": result.rescaled}) + "\n")
    write_text_atomic(os.path.join(run_dir, "trajectories", f"step_{step.number:04d}.jsonl"), "".join(lines))


def print_summary(config, metrics_path, final_dir, seconds, peak_gib):
    """The end-of-run summary: held-out accuracy by phase, the last evaluation, updates, where the
    process's `seconds` went (each phase's minutes, from metrics.jsonl), its peak summed memory
    (`peak_gib`, parallel.PeakMemory; 0: unknown), where things are."""
    records = read_jsonl(metrics_path)
    evals = [r for r in records if "eval_accuracy" in r]
    print("\n" + "=" * 72)
    print(f"held-out accuracy (greedy):\n{format_history(evals, config.eval_splits)}")
    print(f"final eval:\n{format_evals(evals[-1], config.eval_splits)}")
    # where RL started: after the warm start, or the --adapter
    start = [r for r in evals if r["step"] == 0][-1]
    if evals[-1] is not start:
        before, after = split_outcomes(start), split_outcomes(evals[-1])
        print("RL start -> end, paired by question (95% bootstrap interval, exact McNemar p):")
        for split in config.eval_splits:
            print(f"  {split + ':':<{max(map(len, config.eval_splits)) + 1}} "
                  f"{paired_line(before[split], after[split])}")
    steps = [r for r in records if "reward_mean" in r]
    print(f"updates:    {sum(not r['skipped'] for r in steps)} applied, {sum(r['skipped'] for r in steps)} "
          f"skipped (no mixed group, or a non-finite loss/gradient: see metrics.jsonl)")
    if steps:
        # (not in older runs' records)
        entropies = [r["rollout_entropy"] for r in steps if "rollout_entropy" in r]
        print(f"signal:     {sum(r['trainable_groups'] for r in steps)}/"
              f"{sum(r['submitted_groups'] for r in steps)} kept groups trained on, sampled tokens' entropy "
              f"{sum(entropies) / max(1, len(entropies)):.3f} nats, temperature {config.temperature:.2f}")
    sft = [r["time_step"] for r in records if "sft_step" in r]
    rl = [r["time_step"] for r in steps]
    timed_evals = [r["time_eval"] for r in evals if "time_eval" in r]
    phases = sum(sft) + sum(rl) + sum(timed_evals)
    # each phase's minutes over the whole run (a resumed run's earlier processes included)
    rest = "" if config.resume else f", the rest (loading, checkpoints) {max(0.0, seconds - phases) / 60:.1f}"
    print(f"time:       {seconds / 60:.1f} min: warm start {sum(sft) / 60:.1f} ({len(sft)} steps), evaluations "
          f"{sum(timed_evals) / 60:.1f} ({len(timed_evals)}), RL {sum(rl) / 60:.1f} ({len(rl)} steps){rest}")
    if peak_gib:
        print(f"memory:     {peak_gib:.2f} GiB peak, this process and the ones it forked together "
              f"(summed PSS: a page they share counted once)")
    else:   # no /proc: this process alone (ru_maxrss: bytes on macOS, KiB on Linux)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        print(f"memory:     {peak / 2**30:.2f} GiB peak resident (this process alone)")
    print(f"adapter:    {final_dir}  (PEFT layout)")
    print(f"metrics:    {metrics_path}   plot: {os.path.join(config.out, 'progress.png')}   "
          f"report: {os.path.join(config.out, 'report.html')}")
    print(f"evaluate:   python train.py --eval-only --adapter {final_dir}"
          + (f" --model {config.model}" if config.model else ""))
    return evals[-1]


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description="Rebuild a training run's report.html from its folder.")
    p.add_argument("run", help="the run folder (train.py --out)")
    args = p.parse_args(argv)
    try:
        path = write_report(args.run)
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"report: {path}")
    return path


if __name__ == "__main__":
    main()
