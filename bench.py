"""Benchmarks that back every performance claim in the README.

    python bench.py rollout   # our KV-cache-reusing rollout engine vs re-tokenize + generate()
    python bench.py judge     # judge prompt tokens: naive vs RULER-style vs trie serialization
    python bench.py memory    # peak memory of one GRPO update: chunked vs unchunked log-probs

Each benchmark measures the baseline and ours in the same run and prints them side by side,
with the ratio: the machines are shared and noisy, so only ratios are worth quoting.
"""
import argparse


# ---------------------------------------------------------------- rollout (agentrl.py)
def bench_rollout(args):
    """Groups of 8 trajectories, up to 3 turns, on the embedded model: our engine (each prompt
    encoded once, KV cache kept across turns, all rows decoded in one batch) against the
    straightforward loop that re-renders the conversation and calls model.generate per turn and
    per trajectory. Sampled text differs between the two, so tokens per second is the figure."""
    import time
    import torch
    import agentrl
    import sql_env

    n, num_tasks = 8, 2
    sampling = agentrl.Sampling(temperature=0.7, seed=args.seed)
    limits = agentrl.Limits(max_turns=3, max_new_tokens=96, max_context=2048)
    model, tokenizer = agentrl.load_model()
    tasks = sql_env.load_tasks()[::250][:num_tasks]

    # ours: one call, G*N rows
    stats = {}
    t0 = time.perf_counter()
    groups = agentrl.rollout_groups(model, tokenizer, tasks, n, sampling, limits, stats=stats)
    ours_s = time.perf_counter() - t0
    ours_gen = stats["generated_tokens"]
    ours_prompt = stats["prompt_tokens"] + stats["appended_tokens"]
    turns = [t.num_turns for g in groups for t in g.trajectories]

    # baseline: per trajectory, per turn: render the whole conversation, tokenize, generate()
    torch.manual_seed(args.seed)
    stop_ids = sorted(agentrl._stop_token_ids(model, tokenizer))
    base_gen = base_prompt = 0
    base_turns = []
    t0 = time.perf_counter()
    for task in tasks:
        for _ in range(n):
            env = sql_env.SQLEnv(task)
            messages = agentrl.build_messages(task, env.tools, not agentrl.template_takes_tools(tokenizer))
            for turn in range(limits.max_turns):
                text = agentrl.render(tokenizer, messages, env.tools, add_generation_prompt=True)
                ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(model.device)
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                         temperature=sampling.temperature, top_p=sampling.top_p,
                                         max_new_tokens=limits.max_new_tokens, eos_token_id=stop_ids,
                                         pad_token_id=tokenizer.pad_token_id, stop_strings=["</tool_call>"],
                                         tokenizer=tokenizer)
                new = out[0, ids.shape[1]:].tolist()
                base_prompt, base_gen = base_prompt + ids.shape[1], base_gen + len(new)
                content = tokenizer.decode([t for t in new if t not in stop_ids])
                messages.append({"role": "assistant", "content": content})
                if "<tool_call>" not in content or len(new) >= limits.max_new_tokens:
                    break
                try:
                    messages.append({"role": "tool", "content": env.call(*agentrl.parse_tool_call(content))})
                except agentrl.ToolCallError as e:
                    messages.append({"role": "tool", "content": f"Error: {e}"})
                if env.done:
                    break
            base_turns.append(turn + 1)
    base_s = time.perf_counter() - t0

    print(f"rollout: {agentrl.EMBEDDED_NAME}, {num_tasks} tasks x {n} samples, up to {limits.max_turns} turns x "
          f"{limits.max_new_tokens} tokens, T={sampling.temperature}, {model.device} {model.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'':28}{'wall s':>9}{'generated':>11}{'gen tok/s':>11}{'prompt tok computed':>21}{'turns':>7}")
    for name, secs, gen, prompt, t in [("baseline (generate per turn)", base_s, base_gen, base_prompt, base_turns),
                                       ("ours (shared prompt, KV kept)", ours_s, ours_gen, ours_prompt, turns)]:
        print(f"{name:28}{secs:9.1f}{gen:11d}{gen / secs:11.1f}{prompt:21d}{sum(t) / len(t):7.2f}")
    print(f"ratio: {(ours_gen / ours_s) / (base_gen / base_s):.2f}x generated tokens/s, "
          f"{base_prompt / max(ours_prompt, 1):.1f}x fewer prompt tokens computed")
    print(f"ours: {stats['forwards']} forwards, {stats['fed_columns']} token slots fed of which "
          f"{stats['fed_tokens']} real; time outside forward passes "
          f"{100 * (1 - stats['forward_s'] / stats['total_s']):.1f}% of the rollout")


# ---------------------------------------------------------------- judge (judge.py)
def bench_judge(args):
    """Judge prompt tokens per group: naive vs RULER-style vs trie serialization (judge.py).

    Real groups: 8 rollouts each of the embedded model on 4 tasks of the default train split,
    at two temperatures: 1.0 (the trainer's default; the untrained model's first turns all
    differ, so only the common prefix can be shared) and 0.5 (a policy that has started to
    agree with itself, as training makes it: same first tool calls, shared by some rows).
    Each prompt is the full judge chat (system prompt with rubric + serialized group) under the
    chat template, counted with the embedded tokenizer. The trie layout is given every
    trajectory, duplicates included, so the dedup that score_group adds does not flatter it.
    """
    import random
    import agentrl
    import judge
    import sql_env
    num_groups, group_size = 4, 8
    model, tokenizer = agentrl.load_model()
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


# ---------------------------------------------------------------- memory (grpo.py)
def bench_memory(args):
    """Peak memory of one GRPO update, token log-probs chunked vs unchunked (grpo.token_logprobs).

    One update = grpo.grpo_step on 8 sequences of 1,024 tokens (the last 768 trained) in one
    micro-batch, LoRA r=16 on the embedded model, gradient checkpointing on, so that what is left
    is what the log-prob computation costs. Each variant runs in a fresh process, so neither
    inherits the other's allocator state. The figure is the peak above a baseline taken just
    before the update (model, LoRA, optimizer and batch already in memory). CUDA:
    torch.cuda.max_memory_allocated. CPU: the kernel's resident-set high-water mark (VmHWM),
    reset just before the update by writing 5 to /proc/self/clear_refs, minus the resident set
    at that moment. The child runs with MALLOC_MMAP_THRESHOLD_=65536 so glibc hands every freed
    tensor back to the OS at once and the resident set tracks live memory, not allocator caches.
    """
    import json
    import math
    import os
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    import torch

    variant = os.environ.get("AGENTRL_BENCH_MEMORY_VARIANT")
    if variant is None:  # parent: one fresh process per variant, then the table
        results = {}
        for v in ("unchunked", "chunked"):
            print(f"measuring {v} ...", flush=True)
            env = {**os.environ, "AGENTRL_BENCH_MEMORY_VARIANT": v, "MALLOC_MMAP_THRESHOLD_": "65536"}
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "memory", "--seed", str(args.seed)],
                                 env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
            results[v] = json.loads(out.strip().splitlines()[-1])
        r = results["chunked"]
        print(f"\nmodel: {r['model']} | device: {r['device']} | {r['batch']} | method: {r['method']}")
        print(f"{'log-probs':<34}{'peak above baseline':>20}{'time':>9}")
        labels = {"unchunked": "unchunked (full B x T x V logits)", "chunked": f"chunked ({r['chunk_size']} positions)"}
        for v, label in labels.items():
            print(f"{label:<34}{results[v]['peak_gib']:>16.2f} GiB{results[v]['seconds']:>8.1f}s")
        ratio = results["chunked"]["peak_gib"] / results["unchunked"]["peak_gib"]
        print(f"chunked / unchunked = {ratio:.2f} (target < 0.5: {'met' if ratio < 0.5 else 'NOT met'})")
        return

    # child: measure one variant
    import agentrl
    import grpo

    torch.manual_seed(args.seed)
    model, _ = agentrl.load_model()
    agentrl.apply_lora(model, r=16)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(agentrl.lora_parameters(model), lr=1e-5)
    config = grpo.GRPOConfig(micro_batch_size=8, gradient_checkpointing=True,
                             chunk_size=None if variant == "unchunked" else grpo.GRPOConfig.chunk_size)
    V, B, T, prompt = model.config.vocab_size, 8, 1024, 256
    g = torch.Generator().manual_seed(args.seed)
    # Random tokens; the memory of an update does not depend on their values.
    trajs = [SimpleNamespace(token_ids=torch.randint(0, V, (T,), generator=g).tolist(),
                             assistant_mask=[0] * prompt + [1] * (T - prompt),
                             sampled_logprobs=[0.0] * prompt + [-math.log(V)] * (T - prompt)) for _ in range(B)]
    advantages = [1.0 if i % 2 else -1.0 for i in range(B)]

    def status_kib(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    if device.type == "cuda":
        method = "torch.cuda.max_memory_allocated"
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        method = "resident-set high-water mark (VmHWM, reset via /proc/self/clear_refs), fresh process per variant"
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set (VmHWM) to the current one
        base = status_kib("VmRSS") * 1024
    t0 = time.time()
    stats = grpo.grpo_step(model, optimizer, trajs, advantages, config)
    assert not stats["skipped"], stats["skip_reason"]
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = status_kib("VmHWM") * 1024 - base
    print(json.dumps({"model": os.path.basename(model.config._name_or_path) or model.config.model_type,
                      "device": str(device), "batch": f"{B} x {T} tokens, LoRA r=16, grad checkpointing",
                      "method": method, "chunk_size": grpo.GRPOConfig.chunk_size,
                      "peak_gib": peak / 2**30, "seconds": time.time() - t0}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["rollout", "judge", "memory"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    {"rollout": bench_rollout, "judge": bench_judge, "memory": bench_memory}[args.which](args)


if __name__ == "__main__":
    main()
