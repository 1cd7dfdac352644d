"""The judge's prompt size and its HTTP path (judge.py).

    python -m bench judge [--adapter DIR]          # judge prompt tokens: naive vs RULER-style vs trie
    python -m bench judge-server [--adapter DIR]   # --judge http against llama.cpp's server, if installed

judge: real groups of the embedded policy, each serialized three ways into the full judge chat and
counted with the embedded tokenizer; the RULER-style layout is the baseline the trie must beat.
judge-server: train.py's own `--judge http` path end to end against a server no one here wrote.
"""
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
import judge
import lora
import sql_env
import train


def bench_judge(args):
    """Judge prompt tokens per group: naive vs RULER-style vs trie serialization (judge.py).

    Real groups: 8 rollouts each of the embedded model on 4 tasks of the default train split,
    at two temperatures: 1.0 (the trainer's GPU default; the untrained model's first turns all
    differ, so only the common prefix can be shared) and 0.5 (the CPU default; a policy that has
    started to agree with itself, as training makes it: same first tool calls, shared by some rows).
    Each prompt is the full judge chat (system prompt with rubric + serialized group) under the
    chat template, counted with the embedded tokenizer. The trie layout is given every
    trajectory, duplicates included, so the dedup that score_group adds does not flatter it.
    --adapter DIR rolls out a trained policy instead (e.g. the warm start, runs/default/sft).
    """
    num_groups, group_size = 4, 8
    model, tokenizer = lora.load_model()
    if args.adapter:
        lora.load_adapter(model, args.adapter)
    print(f"policy: {lora.EMBEDDED_NAME}" + (f" + adapter {args.adapter}" if args.adapter else " (untrained)"))
    tasks = random.Random(args.seed).sample(sql_env.load_tasks(), num_groups)
    serializers = {"naive": judge.serialize_naive, "ruler": judge.serialize_ruler, "trie": judge.serialize_trie}

    def prompt_tokens(conversations, serializer):
        messages = judge.build_prompt(conversations, serializer=serializer)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    for temperature in (1.0, 0.5):
        groups = agentrl.rollout_groups(model, tokenizer, tasks, group_size,
                                        agentrl.Sampling(temperature=temperature, seed=args.seed),
                                        agentrl.Limits(max_turns=3, max_new_tokens=64))
        totals, trie_never_above = dict.fromkeys(serializers, 0), True
        print(f"\ntemperature {temperature}: judge prompt tokens per group of {group_size}")
        print(f"{'task':<18} {'msgs':>5} {'naive':>7} {'ruler':>7} {'trie':>7} {'trie/ruler':>10}")
        for group in groups:
            conversations = [t.messages for t in group.trajectories]
            counts = {name: prompt_tokens(conversations, s) for name, s in serializers.items()}
            totals = {name: totals[name] + counts[name] for name in totals}
            trie_never_above &= counts["trie"] <= counts["ruler"]
            print(f"{group.task.id:<18} {sum(map(len, conversations)):>5} {counts['naive']:>7} "
                  f"{counts['ruler']:>7} {counts['trie']:>7} {counts['trie'] / counts['ruler']:>10.3f}")
        ratio = totals["trie"] / totals["ruler"]
        print(f"{'total':<18} {'':>5} {totals['naive']:>7} {totals['ruler']:>7} {totals['trie']:>7} {ratio:>10.3f}")
        print(f"trie <= ruler on every group: {trie_never_above} | total trie/ruler = {ratio:.3f} "
              f"(target <= 0.80) | trie/naive = {totals['trie'] / totals['naive']:.3f}")


# ---------------------------------------------------------------- judge-server (judge.py, train.py)
def bench_judge_server(args):
    """The judge end to end against a real OpenAI-compatible server that no one here wrote:
    llama.cpp's Python server (`pip install 'llama-cpp-python[server]'`; not a dependency, it
    builds llama.cpp from source) serving the embedded GGUF on CPU. Real groups (4 rollouts each
    of the embedded policy on 2 train tasks, small so that a slow judge stays a short check) are
    scored through the trainer's own `--judge http` path: train.make_judge (with its GET /models
    check), then train.score_groups, one group at a time and uncached. Prints, per group: the judge prompt's
    tokens, seconds, backend calls, the scale a reply was rescaled from, and why a group was
    left unscored; then the start of each raw reply. Skips, saying so, where llama_cpp is not
    installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        print("skipped: llama_cpp is not installed here (pip install 'llama-cpp-python[server]' runs this check)")
        return
    # 1) the server, on a free loopback port, its output kept for when it fails to start
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url, alias = f"http://127.0.0.1:{port}/v1", "smollm2-135m-q4"
    server_log = tempfile.TemporaryFile()
    server = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", lora.embedded_gguf_path(),
                               "--model_alias", alias, "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "8192"],
                              stdout=server_log, stderr=subprocess.STDOUT)
    try:
        t0 = time.perf_counter()
        while True:   # up when GET /models answers; a server that exits or takes 2 minutes has failed
            try:
                with urllib.request.urlopen(url + "/models", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.perf_counter() - t0 > 120:
                    server_log.seek(0)
                    raise SystemExit("llama.cpp server did not start:\n" + server_log.read().decode()[-2000:])
                time.sleep(0.5)
        print(f"llama.cpp server (llama-cpp-python {importlib.metadata.version('llama-cpp-python')}) serving "
              f"{lora.EMBEDDED_GGUF} at {url}, up in {time.perf_counter() - t0:.1f} s")

        # 2) the trainer's judge: --judge http, exactly as a user would pass it
        train_args = train.parse_args(["--judge", "http", "--judge-url", url, "--judge-model", alias])
        backend = train.make_judge(train_args, None, None, torch.device("cpu"))
        replies, complete = [], backend.complete

        def recorded(messages):   # the same call, its raw reply kept to show what the judge wrote
            replies.append(complete(messages))
            return replies[-1]
        backend.complete = recorded

        # 3) real groups, judged one at a time
        num_groups, group_size = 2, 4
        model, tokenizer = lora.load_model()
        if args.adapter:
            lora.load_adapter(model, args.adapter)
        tasks = random.Random(args.seed).sample(sql_env.load_tasks(), num_groups)
        groups = agentrl.rollout_groups(model, tokenizer, tasks, group_size, agentrl.Sampling(temperature=1.0, seed=args.seed),
                                        agentrl.Limits(max_turns=3, max_new_tokens=64))
        print(f"\n{'task':<18} {'tokens':>6} {'s':>6} {'calls':>5} {'rescaled':>8} {'correct':>7}  scores / why unscored")
        seconds, calls = [], []
        results = []
        for group in groups:
            conversations = [t.messages for t in group.trajectories]
            text = tokenizer.apply_chat_template(judge.build_prompt(conversations), tokenize=False, add_generation_prompt=True)
            tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
            t0 = time.perf_counter()
            _, (result,), _ = train.score_groups([group], backend, judge.DEFAULT_RUBRIC, train_args.bonus, cache_dir=None)
            seconds.append(time.perf_counter() - t0)
            calls.append(result.attempts)
            results.append(result)
            outcome = " ".join(f"{s:.2f}" for s in result.scores) if result.scored else result.error[:100]
            print(f"{group.task.id:<18} {tokens:>6} {seconds[-1]:>6.1f} {result.attempts:>5} {result.rescaled or '-':>8} "
                  f"{sum(t.correct for t in group.trajectories):>4}/{group_size}  {outcome}")
        counters = train.judge_counters(results)
        print(f"\n{sum(r.scored for r in results)}/{num_groups} groups scored | {sum(seconds) / num_groups:.1f} s per group "
              f"(max {max(seconds):.1f}) | {sum(calls)} backend calls | " + " | ".join(f"{k}={v}" for k, v in counters.items()))
        for i, text in enumerate(replies, 1):
            print(f"reply {i} ({len(text)} chars): {text[:160]!r}")
    finally:
        server.terminate()
        server.wait(timeout=30)
        server_log.close()


