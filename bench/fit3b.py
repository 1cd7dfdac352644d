"""Does Qwen2.5-3B train on a 16 GB T4? The fit estimate, its check on the CPU, and the GPU check.

    python -m bench memory --shape qwen2.5-3b   # no GPU: the estimate, then its method checked on the CPU
    python -m bench gpu                          # a GPU: measured, memory capped to a T4's 14.7 GiB

The intended GPU model is Qwen2.5-3B-Instruct, and the smallest GPU a user is likely to have is a
free T4 (16 GB, no bf16). Without a GPU the question gets an ESTIMATE: one decoder layer of the
3B shape measured on the CPU at the T4 precision (fp16 weights and autocast, fp32 LoRA), scaled
to 36 layers, plus analytic sizes (weights, LoRA and AdamW state, KV cache, one lm_head chunk).
The estimate's method is checked where a measurement fits on a CPU: the 3B shape cut to 2 layers,
one GRPO update measured as the resident-set peak of a fresh process. With a GPU, `bench_gpu`
measures instead: the 3B shape with random weights, the T4 precision forced, memory capped with
`torch.cuda.set_per_process_memory_fraction` (an out-of-memory error is a failure), the peaks of
a rollout and an update, update tokens per second, then three real training steps; one
`CHECK name PASS|FAIL | figures` line each.

Nothing is downloaded: the 3B config is written out below, weights are random (memory and speed
do not depend on their values), and the tokenizer only turns scripted texts into tokens (the
embedded model's, or any folder given with `--tokenizer`).
"""
import json
import time

import torch

import agentrl
import engine
import grpo
import lora
import sql_env
import train
from bench.common import (counted_rollout, in_fresh_process, one_group_batch, random_batch, reset_resident_peak,
                          resident_bytes, scripted_policy)

# Qwen2.5-3B-Instruct's published config.json, written out so that nothing is downloaded.
QWEN25_3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                 num_attention_heads=16, num_key_value_heads=2, hidden_act="silu", rms_norm_eps=1e-6,
                 rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=True,
                 bos_token_id=151643, eos_token_id=151645)
T4_CAPABILITY = (7, 5)        # no bf16, so lora.precision_for picks the fp16 path
T4_BUDGET_GIB = 14.7          # what a free Colab T4 (16 GB) leaves to PyTorch
GROUP, CONTEXT = 8, 1024      # one group of 8 trajectories, 1,024 tokens each
TARGET_TOKENS_PER_S = 5000    # the update's throughput target on an H100/H200-class GPU (capability 9.x)
GIB = 2**30


def qwen_config(**overrides):
    from transformers import Qwen2Config
    return Qwen2Config(**{**QWEN25_3B, **overrides}, attn_implementation=lora.ATTENTION)


def train_defaults():
    """train.py's defaults on this machine (micro-batch, learning rate, checkpointing): what a run uses."""
    return train.parse_args([])


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
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding
    layer = Qwen2DecoderLayer(config, layer_idx=0).to(precision.weight_dtype)   # random: sizes do not depend on values
    frozen = sum(p.numel() * p.element_size() for p in layer.parameters())
    lora_params = sum(p.numel() for p in lora.apply_lora(layer, r=lora_r))
    x = torch.randn(1, tokens, config.hidden_size, dtype=precision.weight_dtype, requires_grad=True)  # (1, T, H)
    with torch.autocast("cpu", dtype=precision.amp_dtype, enabled=precision.amp_dtype is not None):
        cos, sin = Qwen2RotaryEmbedding(config)(x, torch.arange(tokens)[None])     # (1, T, head_dim) each
        _, activations = saved_activation_bytes(lambda: layer(x, position_embeddings=(cos, sin)),
                                                [*layer.parameters(), x, cos, sin])
    return frozen, lora_params, activations


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
    precision = lora.precision_for("cuda", T4_CAPABILITY)
    frozen_layer, lora_layer, act_per_seq = measure_decoder_layer(config, context, precision, lora_r)
    L, H, V = config.num_hidden_layers, config.hidden_size, config.vocab_size
    half = torch.finfo(precision.weight_dtype).bits // 8                              # bytes per fp16 value
    head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
    lora_params = L * lora_layer                                                      # fp32 parameters
    weights = L * frozen_layer + V * H * half * (1 if config.tie_word_embeddings else 2) + H * half
    kv = group * context * L * 2 * config.num_key_value_heads * head_dim * half      # K and V, every layer
    recompute = 2 * micro_batch * act_per_seq
    head_chunk = chunk_size * V * (4 + 4 + 4 + half)
    return {
        "rollout": {"frozen weights (fp16)": weights,
                    "LoRA, fp32: params + AdamW state (+ grads)": 3 * 4 * lora_params,
                    f"KV cache ({group} x {context} tokens)": kv,
                    "KV cache growth (one layer copied)": kv // L,
                    "decode logits (B x V fp32, ~5 copies)": 5 * group * V * 4},
        "update": {"frozen weights (fp16)": weights,
                   "LoRA, fp32: params + AdamW state (+ grads)": 4 * 4 * lora_params,
                   f"checkpointed layer inputs ({L} layers)": L * micro_batch * context * H * half,
                   "final norm + hidden states": micro_batch * context * H * (4 + 2 * half),
                   "backward working set (see below)": max(recompute, head_chunk)},
        "lora_params": lora_params, "layer_activations_per_seq": act_per_seq,
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
          f"estimate ({T4_BUDGET_GIB - worst:+.2f} GiB). Measured figures: `python -m bench gpu` on a GPU.")


CUT_LAYERS = 2    # the estimate's method, checked on the CPU: the 3B shape cut to this many layers


def measure_update_on_cpu(config, micro_batch, seed):
    """Child process of check_estimate_on_cpu: the measured peak of one GRPO update of `config` on
    this CPU at the T4 precision, GROUP sequences of CONTEXT tokens, as estimate_memory assumes:
    the resident-set high-water mark above what the process held before the model was built
    (the mark is reset once the model is built, so a temporary copy made while building does not
    count). The first step also creates the AdamW state, which the estimate includes."""
    precision = lora.precision_for("cuda", T4_CAPABILITY)
    torch.manual_seed(seed)
    before = resident_bytes("VmRSS")
    model = build_random_model(config, "cpu", precision.weight_dtype)
    optimizer = torch.optim.AdamW(lora.apply_lora(model, r=16), lr=1e-5)
    step_config = grpo.GRPOConfig(micro_batch_size=micro_batch, amp_dtype=precision.amp_dtype,
                                  gradient_checkpointing=True)
    batch = one_group_batch(*random_batch(config.vocab_size, GROUP, CONTEXT, prompt=256, seed=seed))
    reset_resident_peak()
    t0 = time.perf_counter()
    stats = grpo.grpo_step(model, optimizer, batch, step_config,
                           torch.amp.GradScaler("cpu", enabled=False))   # measures memory: no fp16 overflow to guard
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
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=lora.ATTENTION)
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
    """One group through the rollout engine (engine.py), every row decoded to exactly `context` tokens.

    What runs is the rollout of train.py: the prompt's shared prefix encoded once, its KV cache
    copied into `group` rows, then one forward per token for all rows, sampling from the (B, V) logits and
    recording log-probs. Only the token kept is scripted (bench.common.scripted_policy: a long
    filler text, cut by the context limit): a random-weight model samples from a vocabulary the
    tokenizer cannot decode, and the script makes every row exactly `context` tokens long (its
    log-probs not filled in: nothing trains on them). Returns (trajectories, stats): the forwards'
    counters (bench.common.counted_rollout), with prompt_tokens and generated_tokens."""
    filler = "SELECT " + ", ".join(f"col_{i}" for i in range(context))   # more tokens than any context leaves
    limits = agentrl.Limits(max_turns=1, max_new_tokens=context, max_context=context)
    with scripted_policy([[filler]] * group, fill_logprobs=False):
        groups, stats = counted_rollout(model, tokenizer, [task], group, engine.Sampling(seed=seed), limits)
    trajectories = groups[0].trajectories
    assert all(t.stop_reason == "max_context" for t in trajectories), "a row stopped before the context limit"
    return trajectories, stats


def forced_train_steps(model, tokenizer, tasks, optimizer, config, scaler, group=GROUP):
    """Real GRPO steps, as train.py takes them with --judge none: rollouts, reward = correct,
    group advantages (grpo.make_batch), grpo_step. Each row's tool calls are scripted
    (bench.common.scripted_policy: run the gold query, then submit it in even rows, a wrong query in
    odd rows), so every group is mixed and carries signal whatever the random weights would sample.
    Returns [(step stats, seconds)], one per task."""

    limits = agentrl.Limits(max_turns=2, max_new_tokens=256, max_context=2048)
    steps = []
    for step, task in enumerate(tasks, 1):
        t0 = time.perf_counter()
        turns = [[agentrl.tool_call_text("run_sql", {"query": task.gold_sql}),
                  agentrl.tool_call_text("submit_answer", {"query": task.gold_sql if j % 2 == 0 else "SELECT 'wrong'"})]
                 for j in range(group)]
        with scripted_policy(turns):
            rolled = engine.rollout_group(model, tokenizer, task, group, engine.Sampling(seed=step), limits)
        batch, counts = grpo.make_batch([rolled], [[float(t.correct) for t in rolled.trajectories]])
        assert counts["trainable_groups"], f"{task.id}: scripted rows all got the same reward"
        stats = grpo.grpo_step(model, optimizer, batch, config, scaler)
        steps.append((stats, time.perf_counter() - t0))
    return steps


def gpu_setup(seed, tokenizer_dir=None):
    """The 3B shape at the T4 precision, forced whatever this GPU supports, under the T4 budget.
    The tokenizer only turns the scripted texts into tokens: the embedded model's by default, or any
    folder (`--tokenizer`, for a bare GPU machine without the embedded model)."""
    from transformers import AutoTokenizer
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    fraction = min(1.0, T4_BUDGET_GIB * GIB / props.total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, device)   # a larger GPU behaves like a T4
    precision = lora.precision_for("cuda", T4_CAPABILITY)
    own = lora.precision_for("cuda", torch.cuda.get_device_capability(device))
    print(f"device: {props.name}, capability {props.major}.{props.minor}, {props.total_memory / GIB:.1f} GiB | "
          f"its own policy: {own} | forced: the T4 policy {precision} | cap {T4_BUDGET_GIB} GiB "
          f"(memory fraction {fraction:.3f})")
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = build_random_model(qwen_config(), device, precision.weight_dtype)
    frozen = sum(p.numel() for p in model.parameters())
    params = lora.apply_lora(model, r=16)
    defaults = train_defaults()
    config = grpo.GRPOConfig(micro_batch_size=defaults.micro_batch_size, amp_dtype=precision.amp_dtype,
                             gradient_checkpointing=defaults.grad_checkpointing)
    print(f"model: Qwen2.5-3B shape, random weights, {frozen / 1e9:.2f}B params "
          f"{precision.weight_dtype}, LoRA r=16 {sum(p.numel() for p in params) / 1e6:.1f}M fp32, "
          f"built on the GPU in {time.perf_counter() - t0:.1f} s | update: micro-batch {config.micro_batch_size}, "
          f"checkpointing {config.gradient_checkpointing}, chunks of {config.chunk_size}, autocast {config.amp_dtype}")
    return dict(model=model, device=device, config=config,
                tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir or lora.embedded_model_dir()),
                tasks=sql_env.load_tasks(), scaler=torch.amp.GradScaler("cuda"),
                optimizer=torch.optim.AdamW(params, lr=defaults.lr))


def report(name, ok, details):
    print(f"CHECK {name:<16}{'PASS' if ok else 'FAIL'} | {details}", flush=True)
    return ok


def memory_checks(s, seed):
    """(a) rollout and (b) update peaks under the cap, and the update's throughput. The update runs
    first and again last: the first creates the AdamW state, so the rollout between sees a run's
    steady state, and the second is timed warm."""
    model, device, cap = s["model"], s["device"], T4_BUDGET_GIB * GIB
    batch = one_group_batch(*random_batch(model.config.vocab_size, GROUP, CONTEXT, prompt=256, seed=seed))

    def update():
        return grpo.grpo_step(model, s["optimizer"], batch, s["config"], s["scaler"])

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
    if args.child == "cut":
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
        raise SystemExit("python -m bench gpu needs a CUDA GPU, and this machine has none. On a CPU, "
                         "`python -m bench memory --shape qwen2.5-3b` prints an estimate instead.")
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
