"""The rollout engine's speed (agentrl.py, kvcache.py): sampling, the KV cache, greedy evaluation.

    python -m bench rollout [--adapter DIR]               # our engine vs generate() per turn; the floor
    python -m bench cache                                 # one decode step: our KVCache vs DynamicCache
    python -m bench eval --adapter runs/default [--split test] [--tasks N] [--variants a,b]

rollout: the same groups through our engine (each prompt once, the KV cache kept across turns,
every row in one batch) against the loop that re-renders the conversation and calls
model.generate per turn and per trajectory; then the floor of the forwards' work at this machine's
measured rates. The engine's forwards are counted from outside (bench.common.counted_rollout).
cache: kvcache.KVCache against transformers' DynamicCache, fp32 against bf16 keys and values.
eval: train.py's greedy evaluation, the earlier batching against continuous batching, two forked
processes, bf16 weights; each variant in a fresh process, the first the baseline.
"""
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

import agentrl
import engine
import kvcache
import lora
import parallel
import sql_env
import train
from bench.common import chosen_variants, counted_rollout, fastest, in_fresh_process, resident_bytes


# ---------------------------------------------------------------- rollout (agentrl.py)
def bench_rollout(args):
    """Groups of 8 trajectories, up to 3 turns, on the embedded model: our engine (each prompt
    encoded once, KV cache kept across turns, all rows decoded in one batch) against the
    straightforward loop that re-renders the conversation and calls model.generate per turn and
    per trajectory. Sampled text differs between the two, so tokens per second is the figure. Our
    engine's forwards are counted and timed from outside (bench.common.counted_rollout). Then the
    floor of the forwards' work at this machine's rates, what keeps the weight matmuls above it
    (weight_stream_rates), and where the forwards' time goes (the same rollout under the profiler)."""
    n, num_tasks = 8, 2
    sampling = engine.Sampling(temperature=0.7, seed=args.seed)
    limits = agentrl.Limits(max_turns=3, max_new_tokens=96, max_context=2048)
    model, tokenizer = lora.load_model()
    if args.adapter:
        lora.load_adapter(model, lora.find_adapter(args.adapter))
    tasks = sql_env.load_tasks()[::250][:num_tasks]

    # ours: one call, G*N rows
    groups, stats = counted_rollout(model, tokenizer, tasks, n, sampling, limits)
    ours_s = stats["total_s"]
    ours_gen = stats["generated_tokens"]
    ours_prompt = stats["prompt_tokens"]    # prompts, tool results and each going-on turn's last token, as fed
    turns = [t.num_turns for g in groups for t in g.trajectories]

    # baseline: per trajectory, per turn: render the whole conversation, tokenize, generate()
    torch.manual_seed(args.seed)
    stop_ids = sorted(agentrl.stop_token_ids(tokenizer))
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
                                         temperature=sampling.temperature,
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

    print(f"rollout: {lora.EMBEDDED_NAME}{' + ' + args.adapter if args.adapter else ''}, {num_tasks} tasks x {n} samples, up to {limits.max_turns} turns x "
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
    bandwidth, flops = machine_rates()
    floors = floor_seconds(forward_work(model, stats), bandwidth, flops)
    print(f"floor: this machine, measured now: {bandwidth / 1e9:.1f} GB/s (a 1 GiB copy), {flops / 1e9:.0f} GFLOP/s "
          f"(a 2048^2 fp32 matmul); the forwards' bytes and FLOPs need at least {floors['all']:.1f} s, they took "
          f"{stats['forward_s']:.1f} s: ours is {stats['forward_s'] / floors['all']:.1f}x the floor")
    rates = weight_stream_rates(model, len(tasks) * n)
    print(f"what keeps the weight matmuls above it: the model's weights through nn.functional.linear with "
          f"{len(tasks) * n} rows, a decode forward's, stream at {rates['rows']:.1f} GB/s ({rates['gflops']:.0f} GFLOP/s), "
          f"{100 * rates['rows'] / rates['read']:.0f}% of the {rates['read']:.1f} GB/s at which they are only read (a sum); "
          f"with one row (a matrix times a vector) {rates['one row']:.1f} GB/s: the matmul kernels, not the memory, "
          f"set the pace of a few dozen rows")

    # what stands between: the same rollout again (same seed, so the same tokens) under the profiler
    profiled = {}
    parts = profiled_seconds(lambda: profiled.update(counted_rollout(model, tokenizer, tasks, n, sampling, limits)[1]),
                             {"weight matmuls": "aten::linear", "attention": "aten::scaled_dot_product_attention"})
    parts["the rest"] = profiled["forward_s"] - sum(parts.values())
    print(f"where the forwards' time goes: the same rollout under torch.profiler, {profiled['forward_s']:.1f} s in "
          f"forwards ({profiled['forward_s'] / stats['forward_s']:.2f}x the unprofiled: the profiler's cost lands in the rest)")
    for name, what in (("weight matmuls", "aten::linear: every projection, the lm_head"),
                       ("attention", "scaled_dot_product_attention over the whole cache"),
                       ("the rest", "norms, rotary, masks, cache writes, Python")):
        floor = f"floor {floors[name]:5.1f} s {parts[name] / floors[name]:6.1f}x" if name in floors else ""
        print(f"  {name:16}{parts[name]:6.1f} s {100 * parts[name] / profiled['forward_s']:4.0f}%   {floor:20} {what}")


def profiled_seconds(run, ops) -> dict:
    """run() once under torch.profiler; {name: seconds inside op} for each (name, aten op) of ops,
    counting what the op calls (an attention's own matmuls and softmax are attention's)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    inclusive = {event.key: event.cpu_time_total / 1e6 for event in prof.key_averages()}   # microseconds -> s
    return {name: inclusive.get(op, 0.0) for name, op in ops.items()}


def forward_work(model, stats, prefix="") -> dict:
    """What the rollout's forward passes had to do, from their counters (bench.common.CountingForward's
    `stats`, or its flush_* part with prefix="flush_"): bytes read and FLOPs, for the weight matmuls and
    attention. Weight matmuls read the weights once per forward and do 2 FLOPs per weight per fed token
    (the lm_head once per row); attention reads every KV column each forward attends (holes
    too) and does 4 * layers * heads * head_dim FLOPs per query-key pair. Totals over the rollout, so
    a little under the sum of per-step floors. Additive: the work of two processes is the sum."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    adapter = sum(p.numel() for p in lora.lora_parameters(model))   # generation reads merged weights, not A and B
    weights = sum(p.numel() for p in model.parameters()) - adapter   # a tied embedding and head count once
    head = model.get_output_embeddings().weight.numel()
    layers = weights - head - (0 if c.tie_word_embeddings else model.get_input_embeddings().weight.numel())
    kv_column = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 4   # fp32 K and V of one token
    count = {k: stats[prefix + k] for k in ("forwards", "fed_columns", "logit_rows", "cache_columns", "query_key_pairs")}
    return {"matmul_bytes": count["forwards"] * (layers + head) * 4,   # the lookup table is not read whole
            "matmul_flops": 2 * layers * count["fed_columns"] + 2 * head * count["logit_rows"],
            "attention_bytes": count["cache_columns"] * kv_column,
            "attention_flops": 4 * c.num_hidden_layers * c.num_attention_heads * head_dim * count["query_key_pairs"]}


def machine_rates() -> tuple[float, float]:
    """This machine, measured now with this process's threads: memory bandwidth (bytes/s, a 1 GiB
    copy) and matmul throughput (FLOP/s, a 2048^2 fp32 matmul), each the fastest of 5 trials."""
    src = torch.empty(2**28)                                    # 1 GiB of fp32
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / fastest(lambda: dst.copy_(src))   # read + write
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return bandwidth, 2 * 2048**3 / fastest(lambda: a @ b)


def weight_stream_rates(model, rows) -> dict:
    """What keeps a decode forward's weight matmuls above their floor, measured now: every weight a
    decode forward multiplies (each projection and the lm_head, once; the LoRA's A and B are folded
    away while generating) through nn.functional.linear with `rows` rows and with one row (a matrix
    times a vector), and only read (a sum), each over the whole model like one forward, the fastest of
    5 trials. Returns how many weights, GB/s of them each way, and the matmul's GFLOP/s at `rows` rows."""
    weights = [p.detach() for name, p in model.named_parameters() if p.dim() == 2 and "lora_" not in name]
    params = sum(w.numel() for w in weights)
    gigabytes = sum(w.numel() * w.element_size() for w in weights) / 1e9

    def through_linear(n):   # a tied embedding is the lm_head: (vocab, hidden) like every (out, in) weight here
        inputs = [torch.randn(n, w.shape[1], dtype=w.dtype) for w in weights]
        return fastest(lambda: [torch.nn.functional.linear(x, w) for x, w in zip(inputs, weights)])
    with torch.no_grad():
        many, one, read = through_linear(rows), through_linear(1), fastest(lambda: [w.sum() for w in weights])
    return {"weights": params, "rows": gigabytes / many, "one row": gigabytes / one, "read": gigabytes / read,
            "gflops": 2 * rows * params / many / 1e9}


def floor_seconds(work, bandwidth, flops) -> dict:
    """The least time that work could take here: the larger of its bytes over the bandwidth and its
    FLOPs over the matmul rate, for the weight matmuls, attention, and all of it."""
    return {"weight matmuls": max(work["matmul_bytes"] / bandwidth, work["matmul_flops"] / flops),
            "attention": max(work["attention_bytes"] / bandwidth, work["attention_flops"] / flops),
            "all": max((work["matmul_bytes"] + work["attention_bytes"]) / bandwidth,
                       (work["matmul_flops"] + work["attention_flops"]) / flops)}




# ---------------------------------------------------------------- KV cache (kvcache.KVCache)
def bench_cache(args):
    """One decode step of the embedded model, batch 16, fp32, at 256, 768 and 1536 tokens of context:
    kvcache.KVCache (preallocated, writes one column) against transformers' DynamicCache (torch.cat,
    copies the whole cache every step). Each cache is filled by the same prefill, then both take
    decode steps in alternation (rounds of 3 steps each), and the median step time is compared."""
    B, rounds, per_round = 16, 6, 3
    model, _ = lora.load_model()
    body = model.base_model
    cache_arg = lora.cache_keyword(body)
    print(f"decode step: {lora.EMBEDDED_NAME}, batch {B}, {model.dtype}, {torch.get_num_threads()} threads, "
          f"median of {rounds} x {per_round} steps each, the two caches alternating")
    print(f"{'context':>8}{'DynamicCache ms':>17}{'KVCache ms':>12}{'ratio':>8}")
    g = torch.Generator().manual_seed(args.seed)
    for context in (256, 768, 1536):
        prompt = torch.randint(0, model.config.vocab_size, (B, context), generator=g)
        caches = {"dynamic": DynamicCache(config=model.config), "ours": kvcache.KVCache(model.config, context + 64)}
        masks, times = {}, {name: [] for name in caches}
        with torch.no_grad():
            for name, cache in caches.items():
                body(input_ids=prompt, use_cache=True, **{cache_arg: cache})
                masks[name] = torch.ones(B, context, dtype=torch.long)
            for _ in range(rounds):
                for name, cache in caches.items():
                    for _ in range(per_round):
                        masks[name] = torch.cat([masks[name], torch.ones(B, 1, dtype=torch.long)], dim=1)
                        ids = torch.randint(0, model.config.vocab_size, (B, 1), generator=g)
                        positions = masks[name].sum(-1, keepdim=True) - 1
                        t0 = time.perf_counter()
                        body(input_ids=ids, attention_mask=masks[name], position_ids=positions, use_cache=True,
                             **{cache_arg: cache})
                        times[name].append(time.perf_counter() - t0)
        dynamic, ours = statistics.median(times["dynamic"]), statistics.median(times["ours"])
        print(f"{context:>8}{1e3 * dynamic:>17.1f}{1e3 * ours:>12.1f}{dynamic / ours:>7.2f}x")
    bench_kv_dtype(model.config, B, g)


def bench_kv_dtype(config, B, g, repeats=5):
    """Keys and values stored in bf16 instead of fp32 halve the bytes attention reads per decode
    step; whether that pays depends on this CPU's bf16 attention kernel. Timed here: SDPA of one
    step's one-token queries over every layer's keys and values (the model's head counts, GQA),
    fp32 against bf16, the mean of `repeats` steps after a warm-up, and the largest difference
    of the outputs (random inputs; the model would also cast queries and outputs)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim, layers = config.hidden_size // heads, config.num_hidden_layers
    print(f"\nattention of one decode step, {layers} layers, keys and values stored as fp32 or bf16")
    print(f"{'context':>8}{'fp32 ms':>10}{'bf16 ms':>10}{'bf16 speed':>12}{'max |diff|':>12}")
    for context in (256, 768, 1536):
        q = torch.randn(B, heads, 1, dim, generator=g)
        kv = [(torch.randn(B, kv_heads, context, dim, generator=g), torch.randn(B, kv_heads, context, dim, generator=g))
              for _ in range(layers)]
        seconds, outputs = {}, {}
        for dtype in (torch.float32, torch.bfloat16):
            stored = [(k.to(dtype), v.to(dtype)) for k, v in kv]
            query = q.to(dtype)

            def step():
                return [torch.nn.functional.scaled_dot_product_attention(query, k, v, enable_gqa=True) for k, v in stored]
            step()
            t0 = time.perf_counter()
            for _ in range(repeats):
                outputs[dtype] = step()
            seconds[dtype] = (time.perf_counter() - t0) / repeats
        diff = max((a - b.float()).abs().max().item() for a, b in zip(outputs[torch.float32], outputs[torch.bfloat16]))
        fp32, bf16 = seconds[torch.float32], seconds[torch.bfloat16]
        print(f"{context:>8}{1e3 * fp32:>10.1f}{1e3 * bf16:>10.1f}{fp32 / bf16:>11.2f}x{diff:>12.1e}")


# ---------------------------------------------------------------- eval (train.py's evaluation)
# name: (how tasks are batched, rows at a time, the attention: None is lora.ATTENTION, what
# train.py runs; "sdpa" is transformers' own, which repeats keys and values for every query head;
# processes: forked, one thread each, each with a contiguous share of the tasks and its own 16
# rows, as train.py --eval-processes runs them; the weights' precision, Sampling.weight_dtype:
# None is fp32, bfloat16 is train.py --eval-dtype bf16)
EVAL_VARIANTS = {"batches-32": ("batches", 32, None, 1, None), "continuous-32": ("continuous", 32, None, 1, None),
                 "continuous-16": ("continuous", 16, None, 1, None),
                 "continuous-16-repeat-kv": ("continuous", 16, "sdpa", 1, None),
                 "continuous-16-2-processes": ("continuous", 16, None, 2, None),
                 "continuous-16-bf16": ("continuous", 16, None, 1, torch.bfloat16),
                 "continuous-16-2-processes-bf16": ("continuous", 16, None, 2, torch.bfloat16)}


def bench_eval(args):
    """The greedy evaluation of a held-out split (all of it by default), as train.py runs it, with
    train.py's default limits: the earlier way, batches of 32 tasks each waiting for its slowest
    episode, against one engine call where a finished episode's place is taken by the next task
    (continuous batching), with 32 and with 16 rows at a time; with 16, with transformers' attention
    in place of ours (it copies keys and values per query head), and in two processes of one thread
    each (train.py --eval-processes 2); 16 rows in one process and in two again with the merged
    layers and the lm_head in bf16 (train.py --eval-dtype bf16). "same outcome" counts the tasks each variant gets
    right or wrong as the first does, "same episode" those where it wrote every token the same: a
    near-tie of logits decided the other way (bf16 rounding) changes the second, and maybe the first.
    Each variant in a fresh process (eval_variant), with glibc's malloc as train.py runs it. Then
    where the time goes: each variant's time against the floor of its forwards' work (the rollout
    benchmark's floor, this machine's rates measured after the variants ran), and the flushes'
    forwards (prompts and tool messages, many tokens a row) apart from the decode forwards (a token
    a row); the forwards are counted from outside the engine (bench.common.counted_rollout). A bf16 variant is held to the same floor as the others, fp32's work at
    fp32 rates.
    """
    if args.child:
        print(json.dumps(eval_variant(args, args.child)))
        return
    argv = ["eval", "--split", args.split, "--tasks", str(args.tasks),
            *(["--adapter", args.adapter] if args.adapter else [])]
    results = {v: in_fresh_process(argv, v, hand_back_memory=False) for v in chosen_variants(args, EVAL_VARIANTS)}
    base = next(iter(results.values()))   # the first variant measured is the baseline
    print(f"\ngreedy evaluation of {base['tasks']} {args.split} tasks, {args.adapter or 'the base model'}, "
          f"{base['limits']} | {base['device']}")
    width = max(map(len, results)) + 2
    print(f"{'variant':<{width}}{'time':>9}{'tasks/min':>11}{'vs first':>12}{'rows/forward':>14}{'forwards':>10}"
          f"{'peak memory':>13}{'accuracy':>10}{'same outcome':>14}{'same episode':>14}")
    for v, r in results.items():
        same = sum(a == b for a, b in zip(r["outcomes"], base["outcomes"]))
        same_episodes = sum(a == b for a, b in zip(r["episodes"], base["episodes"]))   # every token the same
        print(f"{v:<{width}}{r['seconds']:>8.0f}s{60 * r['tasks'] / r['seconds']:>11.1f}{base['seconds'] / r['seconds']:>11.2f}x"
              f"{r['logit_rows'] / r['forwards']:>14.1f}{r['forwards']:>10}{r['peak_gib']:>9.2f} GiB"
              f"{r['outcomes'].count('1') / r['tasks']:>10.3f}{same:>9}/{r['tasks']}{same_episodes:>9}/{r['tasks']}")
    bandwidth, flops = machine_rates()
    print(f"where the time goes, against the floor (this machine now, {torch.get_num_threads()} threads: {bandwidth / 1e9:.1f} GB/s, "
          f"{flops / 1e9:.0f} GFLOP/s): the whole evaluation; the flushes' forwards (the prompts and the tool "
          f"messages, fed many tokens a row: {100 * base['flush_fed_tokens'] / base['fed_tokens']:.0f}% of the tokens fed in "
          f"{base['flush_forwards']} of {base['forwards']} forwards, first variant); the decode forwards (a token a row)")
    print(f"{'variant':<{width}}{'time':>9}{'floor':>9}{'x floor':>9}{'in forwards':>13}{'flushes':>10}{'x floor':>9}"
          f"{'decode':>9}{'x floor':>9}")
    for v, r in results.items():
        floor = floor_seconds(r["work"], bandwidth, flops)["all"]
        flush_s, decode_s = r["flush_forward_s"], r["forward_s"] - r["flush_forward_s"]   # summed over a variant's processes
        if r["processes"] == 1:
            decode_work = {k: r["work"][k] - r["flush_work"][k] for k in r["work"]}
            parts = (f"{flush_s:>9.0f}s{flush_s / floor_seconds(r['flush_work'], bandwidth, flops)['all']:>8.1f}x"
                     f"{decode_s:>8.0f}s{decode_s / floor_seconds(decode_work, bandwidth, flops)['all']:>8.1f}x")
        else:   # its processes' times add up to more than the wall time: only their shares are worth printing
            parts = f"{100 * flush_s / r['forward_s']:>9.0f}%{'':>9}{100 * decode_s / r['forward_s']:>8.0f}%{'':>9}"
        print(f"{v:<{width}}{r['seconds']:>8.0f}s{floor:>8.0f}s{r['seconds'] / floor:>8.1f}x"
              f"{100 * r['forward_s'] / r['total_s']:>12.0f}%{parts}")


def eval_variant(args, variant) -> dict:
    """One variant of bench_eval, in this (fresh) process: its time, its peak resident memory (the
    whole process: model, adapter, caches, and the freed memory malloc keeps; with forked processes,
    this one's peak and what each forked one added to the pages it started with), the engine's
    counters and work, and the outcomes, which greedy decoding makes (nearly) the same in every variant."""
    mode, rows, attention, processes, weight_dtype = EVAL_VARIANTS[variant]
    defaults = train.parse_args([])
    limits = agentrl.Limits(defaults.max_turns, defaults.max_new_tokens, defaults.max_context)
    model, tokenizer = lora.load_model()
    model.set_attn_implementation(attention or lora.ATTENTION)
    if args.adapter:
        lora.load_adapter(model, lora.find_adapter(args.adapter))
    tasks = sql_env.load_tasks("default", args.split)
    tasks = tasks[:args.tasks] if args.tasks else tasks
    greedy = engine.Sampling(greedy=True, weight_dtype=weight_dtype)

    def episodes(share, max_rows):   # outcomes, engine counters, this process's peak above its start, each episode's tokens
        start = resident_bytes("VmRSS")
        groups, stats = counted_rollout(model, tokenizer, share, 1, greedy, limits, max_rows=max_rows)
        return ("".join("1" if g.trajectories[0].correct else "0" for g in groups), stats, resident_bytes("VmHWM") - start,
                [g.trajectories[0].token_ids for g in groups])
    t0 = time.perf_counter()
    if mode == "batches":
        shares = [episodes(tasks[i:i + rows], None) for i in range(0, len(tasks), rows)]
    elif processes > 1:
        with lora.lora_merged(model, weight_dtype):     # merged once, shared, as evaluate.evaluate does
            shares = parallel.forked(lambda share: episodes(share, rows), tasks, processes)
    else:
        shares = [episodes(tasks, rows)]
    seconds = time.perf_counter() - t0
    stats = {k: sum(share[1][k] for share in shares) for k in shares[0][1]}
    # forked: a child starts with this process's pages resident (shared, counted here once); what it adds is its own
    peak = resident_bytes("VmHWM") + (sum(share[2] for share in shares) if processes > 1 else 0)
    return {"seconds": seconds, "tasks": len(tasks), "peak_gib": peak / 2**30, "processes": processes,
            "outcomes": "".join(share[0] for share in shares),
            "episodes": [hash(tuple(tokens)) for share in shares for tokens in share[3]],   # ints hash alike in any process
            "work": forward_work(model, stats), "flush_work": forward_work(model, stats, "flush_"),
            **{k: stats[k] for k in ("forwards", "logit_rows", "forward_s",
                                     "total_s", "fed_tokens", "flush_forward_s", "flush_forwards", "flush_fed_tokens")},
            "device": "cpu", "limits": f"{limits.max_turns} turns x {limits.max_new_tokens} tokens"}


