"""Benchmarks that back every performance claim in the README.

    python bench.py rollout   # our KV-cache-reusing rollout engine vs re-tokenize + generate()
    python bench.py judge     # judge prompt tokens: naive vs RULER-style vs trie serialization
    python bench.py memory    # peak memory of one GRPO update: chunked vs unchunked log-probs
    python bench.py learn     # held-out accuracy: base, SFT, SFT + GRPO, and SFT for the same compute
    python bench.py learn --lr 5e-4   # any other flag goes to train.py, for both arms
    python bench.py memory --shape qwen2.5-3b   # does a 3B model train on a 16 GB T4? (CPU: an estimate, checked)
    python bench.py gpu       # the GPU check: 3B memory under a T4 cap, then real training steps

Each benchmark measures the baseline and ours in the same run and prints them side by side,
with the ratio: the machines are shared and noisy, so only ratios are worth quoting.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch


# ---------------------------------------------------------------- rollout (agentrl.py)
def bench_rollout(args):
    """Groups of 8 trajectories, up to 3 turns, on the embedded model: our engine (each prompt
    encoded once, KV cache kept across turns, all rows decoded in one batch) against the
    straightforward loop that re-renders the conversation and calls model.generate per turn and
    per trajectory. Sampled text differs between the two, so tokens per second is the figure."""
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
    --adapter DIR rolls out a trained policy instead (e.g. the warm start, runs/default/sft).
    """
    import random
    import agentrl
    import judge
    import sql_env
    num_groups, group_size = 4, 8
    model, tokenizer = agentrl.load_model()
    if args.adapter:
        agentrl.load_adapter(model, args.adapter)
    print(f"policy: {agentrl.EMBEDDED_NAME}" + (f" + adapter {args.adapter}" if args.adapter else " (untrained)"))
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
CHILD_VARIANT = "AGENTRL_BENCH_MEMORY_VARIANT"   # set in a child process: which measurement it runs


def in_fresh_process(argv, variant):
    """`python bench.py *argv` in a child process told to measure `variant`: the JSON its last line
    prints. A fresh process inherits no allocator state, and MALLOC_MMAP_THRESHOLD_ makes glibc hand
    every freed tensor back to the OS at once, so on a CPU the resident set tracks live memory."""
    env = {**os.environ, CHILD_VARIANT: variant, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv],
                         env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def resident_bytes(field):
    """This process's resident memory from /proc/self/status: VmRSS (now) or VmHWM (the peak)."""
    with open("/proc/self/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_resident_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set (VmHWM) to the current one


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
    `--shape qwen2.5-3b` measures something else: the fit of a 3B model on a T4 (bench_memory_3b).
    """
    if args.shape == "qwen2.5-3b":
        return bench_memory_3b(args)
    variant = os.environ.get(CHILD_VARIANT)
    if variant is None:  # parent: one fresh process per variant, then the table
        results = {}
        for v in ("unchunked", "chunked"):
            print(f"measuring {v} ...", flush=True)
            results[v] = in_fresh_process(["memory", "--seed", str(args.seed)], v)
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
    B, T = 8, 1024
    trajs, advantages = random_batch(model.config.vocab_size, B, T, prompt=256, seed=args.seed)

    if device.type == "cuda":
        method = "torch.cuda.max_memory_allocated"
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        method = "resident-set high-water mark (VmHWM, reset via /proc/self/clear_refs), fresh process per variant"
        reset_resident_peak()
        base = resident_bytes("VmRSS")
    t0 = time.time()
    stats = grpo.grpo_step(model, optimizer, trajs, advantages, config)
    assert not stats["skipped"], stats["skip_reason"]
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resident_bytes("VmHWM") - base
    print(json.dumps({"model": os.path.basename(model.config._name_or_path) or model.config.model_type,
                      "device": str(device), "batch": f"{B} x {T} tokens, LoRA r=16, grad checkpointing",
                      "method": method, "chunk_size": grpo.GRPOConfig.chunk_size,
                      "peak_gib": peak / 2**30, "seconds": time.time() - t0}))


# ---------------------------------------------------------------- a 3B model on a 16 GB T4 (agentrl.precision_for)
# Qwen2.5-3B-Instruct's published config.json, written out so that nothing is downloaded.
QWEN25_3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                 num_attention_heads=16, num_key_value_heads=2, hidden_act="silu", rms_norm_eps=1e-6,
                 rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=True,
                 bos_token_id=151643, eos_token_id=151645)
T4_CAPABILITY = (7, 5)        # no bf16, so agentrl.precision_for picks the fp16 path
T4_BUDGET_GIB = 14.7          # what a free Colab T4 (16 GB) leaves to PyTorch
GROUP, CONTEXT = 8, 1024      # one group of 8 trajectories, 1,024 tokens each
TARGET_TOKENS_PER_S = 5000    # the update's throughput target on an H100/H200-class GPU (capability 9.x)
GIB = 2**30


def qwen_config(**overrides):
    from transformers import Qwen2Config
    return Qwen2Config(**{**QWEN25_3B, **overrides}, attn_implementation="sdpa")


def train_defaults():
    """train.py's defaults on this machine (micro-batch, learning rate, checkpointing): what a run uses."""
    import train
    return train.parse_args([])


def random_batch(vocab, n, length, prompt, seed):
    """An update's batch: n trajectories of `length` random tokens, the last length - prompt
    trained, and advantages alternating -1, +1; the memory and speed of an update do not depend
    on the values. Returns (trajectories, advantages)."""
    import math
    from types import SimpleNamespace
    g = torch.Generator().manual_seed(seed)
    trajectories = [SimpleNamespace(token_ids=torch.randint(0, vocab, (length,), generator=g).tolist(),
                                    assistant_mask=[0] * prompt + [1] * (length - prompt),
                                    sampled_logprobs=[0.0] * prompt + [-math.log(vocab)] * (length - prompt))
                    for _ in range(n)]
    return trajectories, [1.0 if i % 2 else -1.0 for i in range(n)]


# ------------------------------------------------ the CPU estimate
def saved_activation_bytes(fn, exclude):
    """(fn(), bytes autograd saves for the backward while fn runs): its activation memory.
    Storages in `exclude` (parameters, the inputs) are not counted; a storage that several saved
    tensors share is counted once."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    sizes = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            sizes[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(sizes.values())


def measure_decoder_layer(config, tokens, precision, lora_r=16):
    """ONE decoder layer of `config` with our LoRA, on the CPU at `precision`, forward on one sequence
    of `tokens` tokens: (frozen parameter bytes, LoRA parameter count, activation bytes saved for
    the backward). The input requires grad, as the residual stream does in a model with LoRA below."""
    import agentrl
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding
    layer = Qwen2DecoderLayer(config, layer_idx=0).to(precision.weight_dtype)   # random: sizes do not depend on values
    frozen = sum(p.numel() * p.element_size() for p in layer.parameters())
    lora = sum(p.numel() for p in agentrl.apply_lora(layer, r=lora_r))
    x = torch.randn(1, tokens, config.hidden_size, dtype=precision.weight_dtype, requires_grad=True)  # (1, T, H)
    with torch.autocast("cpu", dtype=precision.amp_dtype, enabled=precision.amp_dtype is not None):
        cos, sin = Qwen2RotaryEmbedding(config)(x, torch.arange(tokens)[None])     # (1, T, head_dim) each
        _, activations = saved_activation_bytes(lambda: layer(x, position_embeddings=(cos, sin)),
                                                [*layer.parameters(), x, cos, sin])
    return frozen, lora, activations


def estimate_memory(config, group=GROUP, context=CONTEXT, micro_batch=4, chunk_size=512, lora_r=16):
    """ESTIMATE (bytes per term) of the peak GPU memory of a rollout and of a GRPO update at the T4
    precision: one decoder layer measured on the CPU (measure_decoder_layer) plus sizes from shapes.

    rollout: a group of `group` rows decoded to `context` tokens, in a run past its first step
        (AdamW state exists, gradients are freed).
    update: `group` sequences of `context` tokens in micro-batches of `micro_batch`, gradient
        checkpointing (each layer keeps only its input until its backward recomputes it), log-probs
        in chunks of `chunk_size` positions. The backward's working set is the larger of one layer
        recomputed plus its gradients (bounded by twice its saved activations: at most one gradient
        per saved tensor) and one lm_head chunk (fp32 log-softmax, its gradient, the logits'
        gradient in fp32 and in fp16), which never coexist.
    Left out, each under 1% here: the prompt's prefill, rotary tables, the padding mask, the
    optimizer's temporaries; and what the allocator does not count (CUDA context, cuBLAS
    workspace), which the T4 budget of 14.7 GiB already excludes.
    Returns {"rollout": {term: bytes}, "update": {term: bytes}} and the figures behind them."""
    import agentrl
    precision = agentrl.precision_for("cuda", T4_CAPABILITY)
    frozen_layer, lora_layer, act_per_seq = measure_decoder_layer(config, context, precision, lora_r)
    L, H, V = config.num_hidden_layers, config.hidden_size, config.vocab_size
    half = torch.finfo(precision.weight_dtype).bits // 8                              # bytes per fp16 value
    head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
    lora = L * lora_layer                                                             # fp32 parameters
    weights = L * frozen_layer + V * H * half * (1 if config.tie_word_embeddings else 2) + H * half
    kv = group * context * L * 2 * config.num_key_value_heads * head_dim * half      # K and V, every layer
    recompute = 2 * micro_batch * act_per_seq
    head_chunk = chunk_size * V * (4 + 4 + 4 + half)
    return {
        "rollout": {"frozen weights (fp16)": weights,
                    "LoRA, fp32: params + AdamW state (+ grads)": 3 * 4 * lora,
                    f"KV cache ({group} x {context} tokens)": kv,
                    "KV cache growth (one layer copied)": kv // L,
                    "decode logits (B x V fp32, ~5 copies)": 5 * group * V * 4},
        "update": {"frozen weights (fp16)": weights,
                   "LoRA, fp32: params + AdamW state (+ grads)": 4 * 4 * lora,
                   f"checkpointed layer inputs ({L} layers)": L * micro_batch * context * H * half,
                   "final norm + hidden states": micro_batch * context * H * (4 + 2 * half),
                   "backward working set (see below)": max(recompute, head_chunk)},
        "lora_params": lora, "layer_activations_per_seq": act_per_seq,
        "layer_recompute": recompute, "lm_head_chunk": head_chunk,
        "micro_batch": micro_batch, "chunk_size": chunk_size, "group": group, "context": context, "lora_r": lora_r,
    }


def print_estimate(est):
    print("ESTIMATE, not a measurement: one decoder layer measured on this CPU at the T4 precision "
          "(fp16 weights and autocast, fp32 LoRA), scaled, plus analytic sizes")
    print(f"rollout: {est['group']} rows decoded to {est['context']} tokens | update: {est['group']} x "
          f"{est['context']} tokens, micro-batch {est['micro_batch']}, gradient checkpointing, "
          f"log-probs in chunks of {est['chunk_size']} | LoRA r={est['lora_r']}: "
          f"{est['lora_params'] / 1e6:.1f}M params")
    print(f"{'':46}{'rollout':>10}{'update':>10}")
    for term in dict.fromkeys([*est["rollout"], *est["update"]]):
        cells = [f"{est[phase][term] / GIB:>6.2f} GiB" if term in est[phase] else f"{'':>10}"
                 for phase in ("rollout", "update")]
        print(f"  {term:<44}{cells[0]}{cells[1]}")
    totals = {phase: sum(est[phase].values()) / GIB for phase in ("rollout", "update")}
    print(f"  {'total (estimate)':<44}{totals['rollout']:>6.2f} GiB{totals['update']:>6.2f} GiB")
    print(f"backward working set = max(one layer recomputed with its gradients {est['layer_recompute'] / GIB:.2f} GiB "
          f"[measured: {est['layer_activations_per_seq'] / 2**20:.0f} MiB saved per sequence], "
          f"one lm_head chunk {est['lm_head_chunk'] / GIB:.2f} GiB)")
    worst = max(totals.values())
    print(f"T4 budget {T4_BUDGET_GIB} GiB: {'fits' if worst <= T4_BUDGET_GIB else 'does NOT fit'} by this "
          f"estimate ({T4_BUDGET_GIB - worst:+.2f} GiB). Measured figures: `python bench.py gpu` on a GPU.")


CUT_LAYERS = 2    # the estimate's method, checked on the CPU: the 3B shape cut to this many layers


def measure_update_on_cpu(config, micro_batch, seed):
    """Child process of check_estimate_on_cpu: the measured peak of one GRPO update of `config` on
    this CPU at the T4 precision, GROUP sequences of CONTEXT tokens, as estimate_memory assumes:
    the resident-set high-water mark above what the process held before the model was built
    (the mark is reset once the model is built, so a temporary copy made while building does not
    count). The first step also creates the AdamW state, which the estimate includes."""
    import agentrl
    import grpo
    precision = agentrl.precision_for("cuda", T4_CAPABILITY)
    torch.manual_seed(seed)
    before = resident_bytes("VmRSS")
    model = build_random_model(config, "cpu", precision.weight_dtype)
    optimizer = torch.optim.AdamW(agentrl.apply_lora(model, r=16), lr=1e-5)
    step_config = grpo.GRPOConfig(micro_batch_size=micro_batch, amp_dtype=precision.amp_dtype,
                                  gradient_checkpointing=True)
    trajectories, advantages = random_batch(config.vocab_size, GROUP, CONTEXT, prompt=256, seed=seed)
    reset_resident_peak()
    t0 = time.perf_counter()
    stats = grpo.grpo_step(model, optimizer, trajectories, advantages, step_config)
    assert not stats["skipped"], stats["skip_reason"]
    return {"peak_bytes": resident_bytes("VmHWM") - before, "seconds": time.perf_counter() - t0}


def check_estimate_on_cpu(args, micro_batch):
    """The update estimate against a measurement, where one fits on a CPU: the 3B shape cut to
    CUT_LAYERS layers (every term of the estimate is there, each layer and the lm_head chunk at
    full size; only the layer count is smaller), measured in a fresh process."""
    print(f"\nthe estimate's method against a measurement on this CPU: the 3B shape cut to {CUT_LAYERS} layers, "
          f"one GRPO update of {GROUP} x {CONTEXT} tokens (a few minutes) ...", flush=True)
    measured = in_fresh_process(["memory", "--shape", "qwen2.5-3b", "--seed", str(args.seed)], "cut")
    est = estimate_memory(qwen_config(num_hidden_layers=CUT_LAYERS), micro_batch=micro_batch)
    estimated = sum(est["update"].values())
    print(f"{CUT_LAYERS}-layer update: estimate {estimated / GIB:.2f} GiB, measured {measured['peak_bytes'] / GIB:.2f} GiB "
          f"(resident-set peak, fresh process; the step took {measured['seconds']:.0f} s) | "
          f"measured / estimate = {measured['peak_bytes'] / estimated:.2f}")


# ------------------------------------------------ the GPU measurement
def build_random_model(config, device, dtype):
    """A causal LM of `config` with random weights, created directly on `device` in `dtype`: no
    fp32 copy on the CPU first (12 GB for the 3B shape)."""
    from transformers import AutoModelForCausalLM
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def timed(fn, device):
    """fn() with its wall time and, on CUDA, its peak memory: dict(result, seconds, peak, reserved, oom).
    An out-of-memory error under the cap is a result (oom=True), not a crash."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0, result, oom = time.perf_counter(), None, False
    try:
        result = fn()
    except torch.cuda.OutOfMemoryError:
        oom = True
    if cuda:
        torch.cuda.synchronize()
    return dict(result=result, seconds=time.perf_counter() - t0, oom=oom,
                peak=torch.cuda.max_memory_allocated() if cuda else None,
                reserved=torch.cuda.max_memory_reserved() if cuda else None)


def forced_rollout(model, tokenizer, task, group, context, seed=0):
    """One group through agentrl's engine, every row decoded to exactly `context` tokens.

    What runs is the rollout of train.py: the prompt encoded once, its KV cache copied into
    `group` rows, then one forward per token for all rows, sampling from the (B, V) logits and
    recording log-probs. Only the token kept is forced (a long filler text, cut by the context
    limit): a random-weight model samples from a vocabulary the tokenizer cannot decode, and
    forcing makes every row exactly `context` tokens long. Returns (trajectories, engine stats)."""
    import agentrl
    filler = "SELECT " + ", ".join(f"col_{i}" for i in range(context))   # more tokens than any context leaves
    limits = agentrl.Limits(max_turns=1, max_new_tokens=context, max_context=context)
    stats = {}
    trajectories = agentrl.rollout_group(model, tokenizer, task, group, agentrl.Sampling(seed=seed), limits,
                                         forced_turns=[[filler]] * group, stats=stats).trajectories
    assert all(t.stop_reason == "max_context" for t in trajectories), "a row stopped before the context limit"
    return trajectories, stats


def forced_train_steps(model, tokenizer, tasks, optimizer, config, scaler, group=GROUP):
    """Real GRPO steps, as train.py takes them with --judge none: rollouts, reward = correct,
    group advantages, grpo_step. Each row's tool calls are forced (run the gold query, then
    submit it in even rows, a wrong query in odd rows), so every group is mixed and carries
    signal whatever the random weights would sample. Returns [(step stats, seconds)], one per task."""
    import agentrl
    import grpo

    def call(name, sql):
        return "<tool_call>" + json.dumps({"name": name, "arguments": {"query": sql}}) + "</tool_call>"

    limits = agentrl.Limits(max_turns=2, max_new_tokens=256, max_context=2048)
    steps = []
    for step, task in enumerate(tasks, 1):
        t0 = time.perf_counter()
        forced = [[call("run_sql", task.gold_sql),
                   call("submit_answer", task.gold_sql if j % 2 == 0 else "SELECT 'wrong'")] for j in range(group)]
        trajectories = agentrl.rollout_group(model, tokenizer, task, group, agentrl.Sampling(seed=step), limits,
                                             forced_turns=forced).trajectories
        (advantages,), _ = grpo.group_advantages([[float(t.correct) for t in trajectories]])
        assert advantages is not None, f"{task.id}: forced rows all got the same reward"
        stats = grpo.grpo_step(model, optimizer, trajectories, advantages, config, scaler=scaler)
        steps.append((stats, time.perf_counter() - t0))
    return steps


def gpu_setup(seed, tokenizer_dir=None):
    """The 3B shape at the T4 precision, forced whatever this GPU supports, under the T4 budget.
    The tokenizer only turns the forced texts into tokens: the embedded model's by default, or any
    folder (`--tokenizer`, for a bare GPU machine without the embedded model)."""
    import agentrl
    import grpo
    import sql_env
    from transformers import AutoTokenizer
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    fraction = min(1.0, T4_BUDGET_GIB * GIB / props.total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, device)   # a larger GPU behaves like a T4
    precision = agentrl.precision_for("cuda", T4_CAPABILITY)
    own = agentrl.precision_for("cuda", torch.cuda.get_device_capability(device))
    print(f"device: {props.name}, capability {props.major}.{props.minor}, {props.total_memory / GIB:.1f} GiB | "
          f"its own policy: {own} | forced: the T4 policy {precision} | cap {T4_BUDGET_GIB} GiB "
          f"(memory fraction {fraction:.3f})")
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = build_random_model(qwen_config(), device, precision.weight_dtype)
    frozen = sum(p.numel() for p in model.parameters())
    params = agentrl.apply_lora(model, r=16)
    defaults = train_defaults()
    config = grpo.GRPOConfig(micro_batch_size=defaults.micro_batch_size, amp_dtype=precision.amp_dtype,
                             gradient_checkpointing=defaults.grad_checkpointing)
    print(f"model: Qwen2.5-3B shape, random weights, {frozen / 1e9:.2f}B params "
          f"{precision.weight_dtype}, LoRA r=16 {sum(p.numel() for p in params) / 1e6:.1f}M fp32, "
          f"built on the GPU in {time.perf_counter() - t0:.1f} s | update: micro-batch {config.micro_batch_size}, "
          f"checkpointing {config.gradient_checkpointing}, chunks of {config.chunk_size}, autocast {config.amp_dtype}")
    return dict(model=model, device=device, config=config,
                tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir or agentrl.embedded_model_dir()),
                tasks=sql_env.load_tasks(), scaler=torch.amp.GradScaler("cuda"),
                optimizer=torch.optim.AdamW(params, lr=defaults.lr))


def report(name, ok, details):
    print(f"CHECK {name:<16}{'PASS' if ok else 'FAIL'} | {details}", flush=True)
    return ok


def memory_checks(s, seed):
    """(a) rollout and (b) update peaks under the cap, and the update's throughput. The update runs
    first and again last: the first creates the AdamW state, so the rollout between sees a run's
    steady state, and the second is timed warm."""
    import grpo
    model, device, cap = s["model"], s["device"], T4_BUDGET_GIB * GIB
    trajectories, advantages = random_batch(model.config.vocab_size, GROUP, CONTEXT, prompt=256, seed=seed)

    def update():
        return grpo.grpo_step(model, s["optimizer"], trajectories, advantages, s["config"], scaler=s["scaler"])

    first = timed(update, device)
    held = torch.cuda.memory_allocated()
    rollout = timed(lambda: forced_rollout(model, s["tokenizer"], s["tasks"][0], GROUP, CONTEXT, seed), device)
    held = torch.cuda.memory_allocated() - held          # what outlives the rollout: the KV cache must not
    second = timed(update, device)
    results = []
    if rollout["oom"]:
        results.append(report("memory-rollout", False, f"out of memory under the {T4_BUDGET_GIB} GiB cap"))
    else:
        stats = rollout["result"][1]
        ok = rollout["peak"] <= cap and rollout["reserved"] <= cap
        results.append(report("memory-rollout", ok, (
            f"peak {rollout['peak'] / GIB:.2f} GiB allocated, {rollout['reserved'] / GIB:.2f} GiB reserved, cap "
            f"{T4_BUDGET_GIB} GiB | {GROUP} rows x {CONTEXT} tokens ({stats['prompt_tokens']} prompt, "
            f"{stats['generated_tokens']} decoded) in {rollout['seconds']:.1f} s, "
            f"{stats['generated_tokens'] / rollout['seconds']:.0f} decoded tokens/s | "
            f"allocated after return minus before: {held / 2**20:.0f} MiB")))
    if first["oom"] or second["oom"]:
        results.append(report("memory-update", False, f"out of memory under the {T4_BUDGET_GIB} GiB cap"))
        return results
    peak, reserved = max(first["peak"], second["peak"]), max(first["reserved"], second["reserved"])
    skipped = [r["result"]["skip_reason"] for r in (first, second) if r["result"]["skipped"]]
    tokens_per_s = GROUP * CONTEXT / second["seconds"]
    full_pass = second["result"]["forwarded_sequences"] == GROUP     # every micro-batch ran forward and backward
    results.append(report("memory-update", peak <= cap and reserved <= cap, (
        f"peak {peak / GIB:.2f} GiB allocated, {reserved / GIB:.2f} GiB reserved, cap {T4_BUDGET_GIB} GiB | "
        f"{GROUP} x {CONTEXT} tokens in {second['seconds']:.2f} s (warm), {tokens_per_s:,.0f} tokens/s"
        + (f" | skipped: {skipped}" if skipped else ""))))
    if torch.cuda.get_device_capability(device) >= (9, 0):
        results.append(report("update-speed", tokens_per_s >= TARGET_TOKENS_PER_S and full_pass,
                              f"{tokens_per_s:,.0f} tokens/s, target >= {TARGET_TOKENS_PER_S:,} "
                              f"on an H100/H200-class GPU"))
    else:
        print(f"CHECK {'update-speed':<16}n/a  | the {TARGET_TOKENS_PER_S:,} tokens/s target is for "
              f"H100/H200-class GPUs")
    return results


def bench_memory_3b(args):
    """`memory --shape qwen2.5-3b`: measured on a GPU (memory_checks), else the labelled estimate and
    its method checked against a measurement that fits on the CPU (check_estimate_on_cpu)."""
    micro_batch = train_defaults().micro_batch_size
    if os.environ.get(CHILD_VARIANT) == "cut":
        print(json.dumps(measure_update_on_cpu(qwen_config(num_hidden_layers=CUT_LAYERS), micro_batch, args.seed)))
        return
    if not torch.cuda.is_available():
        print("memory --shape qwen2.5-3b: the measured figure needs a CUDA GPU, and this machine has none.")
        print_estimate(estimate_memory(qwen_config(), micro_batch=micro_batch))
        check_estimate_on_cpu(args, micro_batch)
        return
    if not all(memory_checks(gpu_setup(args.seed, args.tokenizer), args.seed)):
        raise SystemExit(1)


def bench_gpu(args):
    """The GPU check: one command, no network, a few minutes on one modern GPU. At the Qwen2.5-3B
    shape with random weights, the T4 precision forced and memory capped to a T4's 14.7 GiB:
    the memory benchmark (rollout and update peaks, update throughput), then a few real
    training steps (forced_train_steps). One `CHECK name PASS|FAIL | figures` line per check;
    exit status 1 if any failed."""
    if not torch.cuda.is_available():
        raise SystemExit("bench.py gpu needs a CUDA GPU, and this machine has none. On a CPU, "
                         "`python bench.py memory --shape qwen2.5-3b` prints an estimate instead.")
    t0 = time.perf_counter()
    s = gpu_setup(args.seed, args.tokenizer)
    results = memory_checks(s, args.seed)
    lora = [p.detach().clone() for p in s["optimizer"].param_groups[0]["params"]]
    run = timed(lambda: forced_train_steps(s["model"], s["tokenizer"], s["tasks"][1:4], s["optimizer"],
                                           s["config"], s["scaler"]), s["device"])
    steps = run["result"] or []
    for i, (stats, seconds) in enumerate(steps, 1):
        outcome = f"skipped: {stats['skip_reason']}" if stats["skipped"] else "applied"
        print(f"  step {i}: loss={stats['loss']:.4g} | grad_norm={stats['grad_norm']:.4g} | "
              f"tokens={stats['tokens']} | {outcome} | {seconds:.1f} s")
    applied = sum(not stats["skipped"] for stats, _ in steps)
    moved = any(not torch.equal(a, p) for a, p in zip(lora, s["optimizer"].param_groups[0]["params"]))
    ok = not run["oom"] and applied > 0 and moved and run["reserved"] <= T4_BUDGET_GIB * GIB
    results.append(report("train-steps", ok, (
        "out of memory under the cap" if run["oom"] else
        f"{len(steps)} steps, {applied} applied, {len(steps) - applied} skipped (fp16 overflow guard), loss scale "
        f"now {s['scaler'].get_scale():.0f} | LoRA "
        f"{'moved' if moved else 'did NOT move'} | peak {run['peak'] / GIB:.2f} GiB allocated, "
        f"{run['reserved'] / GIB:.2f} GiB reserved")))
    print(f"gpu check: {sum(results)} passed, {len(results) - sum(results)} failed in {time.perf_counter() - t0:.0f} s")
    if not all(results):
        raise SystemExit(1)


# ---------------------------------------------------------------- learn (train.py)
def bench_learn(args):
    """What does GRPO add over supervised learning? Held-out split, greedy, fixed seeds, one run:

        base           the embedded model
        SFT S          S warm-start steps on gold demonstrations
        SFT S + GRPO G then G GRPO steps (judge none: reward = correctness)
        SFT S + X      the fair control: SFT goes on instead, for X steps taking the GRPO steps' time

    Both arms are train.py runs with the same seed, so they share the base evaluation and the
    first S SFT steps exactly (same LoRA init, same demonstrations in the same order).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import train

    if args.sft_steps < 1 or args.grpo_steps < 1:
        raise SystemExit("bench.py learn compares SFT with GRPO: --sft-steps and --grpo-steps must be >= 1")
    t0 = time.perf_counter()
    out = os.path.join("runs", "bench_learn")
    common = ["--eval-size", str(args.eval_size), "--seed", str(args.seed), "--judge", "none", *args.train_flags]

    def records(arm):
        return [json.loads(line) for line in open(os.path.join(out, arm, "metrics.jsonl"))]

    train.main(common + ["--sft-steps", str(args.sft_steps), "--steps", str(args.grpo_steps),
                         "--out", os.path.join(out, "grpo")])
    grpo = records("grpo")
    grpo_s = sum(r["time_step"] for r in grpo if "reward_mean" in r)
    sft_step_s = sum(r["time_step"] for r in grpo if "sft_step" in r) / args.sft_steps
    extra = max(1, round(grpo_s / sft_step_s))
    train.main(common + ["--sft-steps", str(args.sft_steps + extra), "--steps", "0", "--out", os.path.join(out, "control")])
    control = records("control")

    evals = [r for r in grpo if "eval_accuracy" in r]
    control_evals = [r for r in control if "eval_accuracy" in r]
    agents = [("base", evals[0]), (f"SFT {args.sft_steps}", evals[1]),
              (f"SFT {args.sft_steps} + GRPO {args.grpo_steps}", evals[-1]),
              (f"SFT {args.sft_steps + extra} (control)", control_evals[-1])]
    tiers = list(evals[0]["eval_accuracy_by_tier"])
    print(f"\nlearn: {evals[0]['eval_tasks']} held-out tasks, greedy | GRPO phase {grpo_s:.0f} s = {extra} SFT steps "
          f"of {sft_step_s:.1f} s")
    run = json.load(open(os.path.join(out, "grpo", "config.json")))
    print(f"GRPO: {run['groups_per_step']} groups x {run['group_size']} per step, temperature {run['temperature']}, "
          f"lr {run['lr']:g}, loss {run['loss']}; SFT lr {run['sft_lr']:g}, {run['sft_batch_size']} demonstrations per step")
    print(f"{'agent':<26}{'accuracy':>9}" + "".join(f"{t:>8}" for t in tiers) + f"{'turns':>7}{'tool err':>9}")
    for name, r in agents:
        print(f"{name:<26}{r['eval_accuracy']:>9.3f}" + "".join(f"{r['eval_accuracy_by_tier'][t]:>8.2f}" for t in tiers)
              + f"{r['eval_mean_turns']:>7.2f}{r['eval_tool_error_rate']:>9.2f}")
    gain = 100 * (agents[2][1]["eval_accuracy"] - agents[3][1]["eval_accuracy"])
    print(f"GRPO over the SFT control: {gain:+.1f} points (target >= +5)")
    same_base = all(evals[0][k] == control_evals[0][k] for k in ("eval_accuracy", "eval_mean_turns", "eval_tool_error_rate"))
    print(f"the two arms' base evaluations agree (same seed, same start): {'yes' if same_base else 'NO'}")

    # Why GRPO did (not) help: the signal it had. A group whose rewards are all equal has zero
    # advantage; one optimizer step per batch keeps the ratio at 1, so clipping stays idle.
    steps = [r for r in grpo if "reward_mean" in r]
    groups = sum(r["submitted_groups"] for r in steps)
    mixed = sum(r["trainable_groups"] for r in steps)
    updated = [r for r in steps if not r["skipped"]]
    accuracy_by_step = " ".join(f"{r['train_accuracy']:.2f}" for r in steps)
    print(f"GRPO signal: {mixed}/{groups} groups mixed, {len(updated)}/{len(steps)} updates applied | train accuracy "
          f"by step {accuracy_by_step} | clip fraction "
          f"{max([r['clip_frac_low'] + r['clip_frac_high'] for r in updated], default=0):.3f} at most | "
          f"step time {grpo_s / len(steps):.0f} s = rollout {sum(r['time_rollout'] for r in steps) / grpo_s:.0%}")

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(agents)
    for i, (name, r) in enumerate(agents):
        left.bar([j + i * width for j in range(len(tiers) + 1)],
                 [r["eval_accuracy"]] + [r["eval_accuracy_by_tier"][t] for t in tiers], width, label=name)
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(tiers) + 1)], ["all"] + tiers)
    left.set_ylabel("held-out accuracy (greedy)")
    left.set_ylim(0, 1)
    left.legend(fontsize=8)
    right.plot([r["step"] for r in steps], [r["train_accuracy"] for r in steps], "o-", label="GRPO: train accuracy")
    sft = [r for r in control if "sft_step" in r]
    right.plot([r["sft_step"] for r in sft], [r["sft_loss"] for r in sft], label="SFT control: loss")
    right.set_xlabel("step")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "learn.png"))
    print(f"curves: {os.path.join(out, 'learn.png')} | whole benchmark {(time.perf_counter() - t0) / 60:.0f} min")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["rollout", "judge", "memory", "gpu", "learn"])
    parser.add_argument("--shape", choices=["smollm2-135m", "qwen2.5-3b"], default="smollm2-135m",
                        help="memory: the embedded model (chunked vs unchunked log-probs), or the "
                             "Qwen2.5-3B shape with random weights (the fit on a 16 GB T4)")
    parser.add_argument("--adapter", default=None, help="judge: roll out the embedded model with this saved adapter")
    parser.add_argument("--tokenizer", default=None,
                        help="gpu, memory --shape qwen2.5-3b: a tokenizer folder (default: the embedded model's)")
    parser.add_argument("--eval-size", type=int, default=64, help="learn: held-out tasks per evaluation")
    parser.add_argument("--sft-steps", type=int, default=32, help="learn: warm-start steps before the two arms")
    parser.add_argument("--grpo-steps", type=int, default=6, help="learn: GRPO steps (the control gets their time)")
    parser.add_argument("--seed", type=int, default=0)
    args, train_flags = parser.parse_known_args()
    if train_flags and args.which != "learn":
        parser.error(f"unrecognized arguments: {' '.join(train_flags)}")
    args.train_flags = train_flags  # learn: any other flag goes to train.py, for both arms (e.g. --temperature 1.0)
    benches = {"rollout": bench_rollout, "judge": bench_judge, "memory": bench_memory, "gpu": bench_gpu, "learn": bench_learn}
    benches[args.which](args)


if __name__ == "__main__":
    main()
