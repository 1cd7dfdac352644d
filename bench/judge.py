"""The judge (judge.py): how far to trust it, its prompt's size, and its HTTP path.

    python -m bench judge [--adapter DIR]          # agreement with correctness per judge backend; prompt tokens
    python -m bench judge-server [--adapter DIR]   # train.py's --judge http against llama.cpp's server, if installed

judge: 1) agreement (judge.agreement, a per-group AUC) of each judge backend with execution
correctness, on one fixed set of groups, with a 95% bootstrap interval over groups: the embedded
model as train.py's local judge, and llama.cpp's server on the embedded GGUF through HTTPBackend
(where llama_cpp is installed), with the verdict's schema and with plain JSON mode. 2) real groups
of the embedded policy, each serialized three ways into the full judge chat and counted with the
embedded tokenizer; the RULER-style layout is the baseline the group's tree must beat.
judge-server: train.py's own `--judge http` path end to end against a server no one here wrote.
"""
import contextlib
import importlib.metadata
import importlib.util
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

import agentrl
import engine
import files
import judge
import judge_backends
import lora
import report
import sql_env
import train


# ---------------------------------------------------------------- the layouts the tree is measured against
def serialize_naive(conversations) -> str:
    """Every trajectory in full: the baseline cost."""
    return "\n".join(judge.render_block([i], c) for i, c in enumerate(conversations, 1))


def serialize_ruler(conversations) -> str:
    """RULER's layout: the messages common to *all* trajectories once, then each remainder."""
    n = files.common_prefix_length(conversations)
    blocks = [judge.render_block(list(range(1, len(conversations) + 1)), conversations[0][:n])] if n else []
    return "\n".join(blocks + [judge.render_block([i], c[n:]) for i, c in enumerate(conversations, 1) if c[n:]])


# ---------------------------------------------------------------- a real judge server
LLAMA_ALIAS = "smollm2-135m-q4"   # the model name the server answers to


@contextlib.contextmanager
def llama_cpp_server(n_ctx=8192, start_timeout_s=120):
    """llama.cpp's OpenAI-compatible server (`pip install 'llama-cpp-python[server]'`) serving the
    embedded GGUF on a free loopback port, as LLAMA_ALIAS: yields its base URL, stops it on exit.
    Up when GET /models answers; one that exits or is not up in start_timeout_s raises
    RuntimeError with the end of its log."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", lora.embedded_gguf_path(),
                                   "--model_alias", LLAMA_ALIAS, "--host", "127.0.0.1", "--port", str(port),
                                   "--n_ctx", str(n_ctx)], stdout=log, stderr=subprocess.STDOUT)
        try:
            t0 = time.perf_counter()
            while True:
                try:
                    with urllib.request.urlopen(url + "/models", timeout=2):
                        break
                except OSError:
                    if server.poll() is not None or time.perf_counter() - t0 > start_timeout_s:
                        log.seek(0)
                        raise RuntimeError("llama.cpp server did not start:\n" + log.read().decode()[-2000:]) from None
                    time.sleep(0.5)
            yield url
        finally:
            server.terminate()
            server.wait(timeout=30)


def llama_cpp_version() -> str | None:
    """llama-cpp-python's version, or None where it is not installed."""
    return importlib.metadata.version("llama-cpp-python") if importlib.util.find_spec("llama_cpp") else None


# ---------------------------------------------------------------- agreement with correctness
AGREEMENT_GROUPS = 8
AGREEMENT_LIMITS = agentrl.Limits(max_turns=agentrl.DEMO_TURNS + 1, max_new_tokens=512, max_context=8192)


def agreement_groups(tokenizer, seed, num_groups=AGREEMENT_GROUPS):
    """The fixed groups a judge's agreement is measured on: [(conversations, correct)], one group
    for each of `num_groups` train tasks drawn with `seed`. Four trajectories each, in a seeded
    order: the gold demonstration (list the tables, describe, run, submit) and the gold query run
    and submitted at once, both right; the same two with a decoy, another train question's gold
    query on the same database that returns a different answer, both wrong. Right and wrong take
    the same steps and look as competent, so a judge can only tell them apart by checking the
    answer against the question. Correctness is the environment's, as in training."""
    rng, tasks = random.Random(seed), sql_env.load_tasks()
    groups = []
    for task in rng.sample(tasks, len(tasks)):
        others = [t.gold_sql for t in tasks if t.db_path == task.db_path and t.gold_sql != task.gold_sql]
        rng.shuffle(others)
        decoy_sql = next((sql for sql in others if not sql_env.execution_match(task.db_path, sql, task.gold_sql)), None)
        if decoy_sql is None:
            continue
        decoy = sql_env.Task(task.id, task.db_path, task.question, decoy_sql)   # its "gold" is the decoy
        turns = [agentrl.gold_turns(t, AGREEMENT_LIMITS.max_turns) for t in (task, decoy)]
        scripts = [turns[0], turns[0][-2:], turns[1], turns[1][-2:]]
        trajectories = [agentrl.scripted_trajectory(tokenizer, task, script, AGREEMENT_LIMITS) for script in scripts]
        rng.shuffle(trajectories)
        groups.append(([t.messages for t in trajectories], [t.correct for t in trajectories]))
        if len(groups) == num_groups:
            return groups
    raise ValueError(f"only {len(groups)} train tasks have a decoy; {num_groups} wanted")


def bootstrap_interval(values, seed, resamples=2000) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of the mean of `values` (resampled as units: groups)."""
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def judge_agreement(backend, groups, max_retries=0):
    """Each group judged by judge.score_group, uncached, with `max_retries` correction turns.
    Returns {agreements: one per scored group with both right and wrong, scored, seconds, errors}."""
    agreements, scored, errors, t0 = [], 0, [], time.perf_counter()
    for conversations, correct in groups:
        result = judge.score_group(judge.conversation_tree(conversations), backend, max_retries=max_retries)
        if not result.scored:
            errors.append(result.error)
            continue
        scored += 1
        value = judge.agreement(result.scores, correct)
        if value is not None:
            agreements.append(value)
    return {"agreements": agreements, "scored": scored, "seconds": time.perf_counter() - t0, "errors": errors}


def bench_agreement(args):
    """Agreement with execution correctness per judge backend, on the same fixed groups (agreement_groups).

    Backends: `local`, the embedded model as train.py's `--judge local` uses it (its next-token
    probabilities over the score's digits, G-Eval style: it always answers); where llama_cpp is
    installed, `http` against llama.cpp's
    server on the embedded GGUF, once as HTTPBackend asks by default (the verdict's schema, down
    the format ladder to the form the server takes) and once in plain JSON mode. Each judge gets
    one reply per group, no correction turns (the trainer allows 2; on 2 CPU cores they would
    triple the time): a reply above [0, 1] is rescaled, an unusable one leaves the group unscored.
    Agreement is the mean over the groups a backend scored; the interval bootstraps those groups.
    """
    model, tokenizer = lora.load_model()
    groups = agreement_groups(tokenizer, args.seed)
    mixed = sum(0 < sum(correct) < len(correct) for _, correct in groups)
    print(f"judge agreement with execution correctness: {len(groups)} groups of 4 (2 right, 2 wrong, same steps), "
          f"{mixed} mixed; one reply per group; 0.5 = a coin")
    rows = {"local (embedded, transformers)": lambda url: judge_backends.LocalBackend(model, tokenizer)}   # name: backend(url)
    version, server = llama_cpp_version(), contextlib.nullcontext()
    if version:
        server = llama_cpp_server()
        rows["http llama.cpp, schema"] = lambda url: judge_backends.HTTPBackend(url, LLAMA_ALIAS, timeout_s=300)
        rows["http llama.cpp, JSON mode"] = lambda url: judge_backends.HTTPBackend(url, LLAMA_ALIAS, timeout_s=300,
                                                                          response_format="json_object")
    print(f"{'backend':<32} {'scored':>7} {'agreement':>9} {'95% interval':>14} {'s/group':>8}  format / why unscored")
    with server as url:
        for name, make in rows.items():
            backend = make(url)
            m = judge_agreement(backend, groups)
            values = m["agreements"]
            mean, interval = "-", "-"
            if values:
                low, high = bootstrap_interval(values, args.seed)
                mean, interval = f"{sum(values) / len(values):.2f}", f"[{low:.2f}, {high:.2f}]"
            note = getattr(backend, "response_format", "-") + (f" | {m['errors'][0][:70]}" if m["errors"] else "")
            print(f"{name:<32} {m['scored']:>3}/{len(groups):<3} {mean:>9} {interval:>14} "
                  f"{m['seconds'] / len(groups):>8.1f}  {note}")
    if not version:
        print("http: skipped, llama_cpp is not installed here (README: the local judge server)")


def bench_judge(args):
    """`python -m bench judge`: agreement per judge backend (--adapter does not change its scripted
    groups), then the prompt's size (real rollouts: of the --adapter policy where given)."""
    bench_agreement(args)
    print()
    bench_prompt_tokens(args)


# ---------------------------------------------------------------- prompt size (judge.py's tree)
def bench_prompt_tokens(args):
    """Judge prompt tokens per group: naive vs RULER-style vs the group's tree (judge.py).

    Real groups: 8 rollouts each of the embedded model on 4 tasks of the default train split,
    at two temperatures: 1.0 (the trainer's GPU default; the untrained model's first turns all
    differ, so only the common prefix can be shared) and 0.5 (the CPU default; a policy that has
    started to agree with itself, as training makes it: same first tool calls, shared by some rows).
    Each prompt is the full judge chat (system prompt with rubric + serialized group) under the
    chat template, counted with the embedded tokenizer. The tree (the group's, as train.py's judge
    prints it) gives every trajectory its own id, duplicates included, so the dedup that
    score_group adds does not flatter it. Beside them, groups of the same size that branch
    (engine.branch_groups): their judge prompt and their sampled tokens against the chains'.
    --adapter DIR rolls out a trained policy instead (e.g. the warm start, runs/default/sft).
    """
    num_groups, group_size = 4, 8
    model, tokenizer = lora.load_model()
    if args.adapter:
        lora.load_adapter(model, args.adapter)
    print(f"policy: {lora.EMBEDDED_NAME}" + (f" + adapter {args.adapter}" if args.adapter else " (untrained)"))
    tasks = random.Random(args.seed).sample(sql_env.load_tasks(), num_groups)
    serializers = {"naive": lambda group: serialize_naive([t.messages for t in group.trajectories]),
                   "ruler": lambda group: serialize_ruler([t.messages for t in group.trajectories]),
                   "tree": lambda group: judge.serialize(group.tree, list(range(1, len(group.trajectories) + 1)))}

    def prompt_tokens(group, serializer):
        ids = ", ".join(map(str, range(1, len(group.trajectories) + 1)))
        messages = [{"role": "system", "content": judge.SYSTEM_PROMPT.format(rubric=judge.DEFAULT_RUBRIC)},
                    {"role": "user", "content": f"Trajectory ids: {ids}\n\n{serializer(group)}"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    for temperature in (1.0, 0.5):
        groups = engine.rollout_groups(model, tokenizer, tasks, group_size,
                                        engine.Sampling(temperature=temperature, seed=args.seed),
                                        agentrl.Limits(max_turns=3, max_new_tokens=64))
        totals, tree_never_above = dict.fromkeys(serializers, 0), True
        print(f"\ntemperature {temperature}: judge prompt tokens per group of {group_size}")
        print(f"{'task':<18} {'msgs':>5} {'naive':>7} {'ruler':>7} {'tree':>7} {'tree/ruler':>10}")
        for group in groups:
            conversations = [t.messages for t in group.trajectories]
            counts = {name: prompt_tokens(group, s) for name, s in serializers.items()}
            totals = {name: totals[name] + counts[name] for name in totals}
            tree_never_above &= counts["tree"] <= counts["ruler"]
            print(f"{group.task.id:<18} {sum(map(len, conversations)):>5} {counts['naive']:>7} "
                  f"{counts['ruler']:>7} {counts['tree']:>7} {counts['tree'] / counts['ruler']:>10.3f}")
        ratio = totals["tree"] / totals["ruler"]
        print(f"{'total':<18} {'':>5} {totals['naive']:>7} {totals['ruler']:>7} {totals['tree']:>7} {ratio:>10.3f}")
        print(f"tree <= ruler on every group: {tree_never_above} | total tree/ruler = {ratio:.3f} "
              f"(target <= 0.80) | tree/naive = {totals['tree'] / totals['naive']:.3f}")
        # groups that branch (train.py --branching uniform): half whole, half off their states; the same size
        sampling = engine.Sampling(temperature=temperature, seed=args.seed)
        limits = agentrl.Limits(max_turns=3, max_new_tokens=64)
        halves = engine.rollout_groups(model, tokenizer, tasks, group_size // 2, sampling, limits)
        branched = engine.branch_groups(model, tokenizer, halves, group_size, sampling, limits)
        tree_tokens = sum(prompt_tokens(g, serializers["tree"]) for g in branched)

        def sampled(groups):
            return sum(sum(t.assistant_mask) for g in groups for t in g.trajectories) / (len(groups) * group_size)
        print(f"branched groups of {group_size} ({group_size // 2} whole, the rest branched off their states): "
              f"judge prompt {tree_tokens} tokens, {tree_tokens / totals['tree']:.3f}x the chains' | sampled "
              f"tokens per trajectory {sampled(branched):.1f} against {sampled(groups):.1f}, "
              f"{sampled(branched) / sampled(groups):.3f}x")


# ---------------------------------------------------------------- judge-server (judge.py, train.py)
def bench_judge_server(args):
    """The judge end to end against a real OpenAI-compatible server that no one here wrote:
    llama.cpp's Python server (llama_cpp_server; not a dependency, it builds llama.cpp from
    source) serving the embedded GGUF on CPU. Real groups (4 rollouts each of the embedded policy
    on 2 train tasks, small so that a slow judge stays a short check) are scored through the
    trainer's own `--judge http` path: train.make_judge (with its GET /models check), then
    train.score_groups, one group at a time and uncached. Prints, per group: the judge prompt's
    tokens, seconds, backend calls, the scale a reply was rescaled from, the judge's agreement
    with correctness, and why a group was left unscored; then the start of each raw reply.
    Skips, saying so, where llama_cpp is not installed."""
    version = llama_cpp_version()
    if version is None:
        print("skipped: llama_cpp is not installed here (pip install 'llama-cpp-python[server]' runs this check)")
        return
    t0 = time.perf_counter()
    with llama_cpp_server() as url:
        print(f"llama.cpp server (llama-cpp-python {version}) serving {lora.EMBEDDED_GGUF} at {url}, "
              f"up in {time.perf_counter() - t0:.1f} s")
        # 1) the trainer's judge: --judge http, exactly as a user would pass it
        train_args = train.parse_args(["--judge", url, "--judge-model", LLAMA_ALIAS])
        backend = train.make_judge(train_args, None, None, torch.device("cpu"))
        replies, complete = [], backend.complete

        def recorded(messages):   # the same call, its raw reply kept to show what the judge wrote
            replies.append(complete(messages))
            return replies[-1]
        backend.complete = recorded

        # 2) real groups, judged one at a time
        num_groups, group_size = 2, 4
        model, tokenizer = lora.load_model()
        if args.adapter:
            lora.load_adapter(model, args.adapter)
        tasks = random.Random(args.seed).sample(sql_env.load_tasks(), num_groups)
        groups = engine.rollout_groups(model, tokenizer, tasks, group_size, engine.Sampling(temperature=1.0, seed=args.seed),
                                        agentrl.Limits(max_turns=3, max_new_tokens=64))
        print(f"\n{'task':<18} {'tokens':>6} {'s':>6} {'calls':>5} {'rescaled':>8} {'correct':>7} {'agree':>5}  "
              f"scores / why unscored")
        seconds, results = [], []
        for group in groups:
            correct = [t.correct for t in group.trajectories]
            prompt = judge.build_prompt(group.tree, judge.judge_ids(group.tree))
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
            t0 = time.perf_counter()
            _, (result,), _ = train.score_groups([group], backend, judge.DEFAULT_RUBRIC, train_args.bonus)
            seconds.append(time.perf_counter() - t0)
            results.append(result)
            agree = judge.agreement(result.scores, correct) if result.scored else None
            outcome = " ".join(f"{s:.2f}" for s in result.scores) if result.scored else result.error[:100]
            print(f"{group.task.id:<18} {tokens:>6} {seconds[-1]:>6.1f} {result.attempts:>5} {result.rescaled or '-':>8} "
                  f"{sum(correct):>4}/{group_size} {'-' if agree is None else f'{agree:.2f}':>5}  {outcome}")
        counters = report.judge_counters(results)
        print(f"\n{sum(r.scored for r in results)}/{num_groups} groups scored | {sum(seconds) / num_groups:.1f} s per group "
              f"(max {max(seconds):.1f}) | {sum(r.attempts for r in results)} backend calls | response_format "
              f"{backend.response_format} | " + " | ".join(f"{k}={v}" for k, v in counters.items()))
        for i, text in enumerate(replies, 1):
            print(f"reply {i} ({len(text)} chars): {text[:160]!r}")
