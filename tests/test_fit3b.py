"""Tests for bench/fit3b.py: the T4 training path end to end, and the pieces of the 3B memory
estimate and GPU check that run on a CPU (with bench.common's memory instruments they use).

Run: python -m pytest -q tests/test_fit3b.py

Covered in tests/test_grpo.py, not repeated here: the non-finite guard (nan loss, nan gradient,
and an fp16 GradScaler overflow), and gradient checkpointing giving the same LoRA gradients as
without.
"""
from types import SimpleNamespace

import pytest
import torch

import grpo
import lora
import sql_env
from bench import common, fit3b
from conftest import build_tiny_model

# A Qwen2 decoder small enough to build and run in milliseconds.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def test_t4_path_trains_end_to_end(qwen_tokenizer):
    """The T4 policy (fp16 frozen weights, fp16 autocast, fp32 LoRA, GradScaler) through the GPU
    check's training loop: rollouts, rewards, advantages, grpo_step. The step is applied, the LoRA
    moves and stays fp32, the frozen weights stay fp16 and bit-identical."""
    precision = lora.precision_for("cuda", fit3b.T4_CAPABILITY)
    model = build_tiny_model("qwen2").to(precision.weight_dtype)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = lora.apply_lora(model, r=4)
    before = [p.detach().clone() for p in params]
    config = grpo.GRPOConfig(micro_batch_size=2, amp_dtype=precision.amp_dtype, gradient_checkpointing=True)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    steps = fit3b.forced_train_steps(model, qwen_tokenizer, sql_env.load_tasks()[:1], optimizer, config,
                                     torch.amp.GradScaler("cpu"), group=2)
    assert [s["skipped"] for s, _ in steps] == [False]
    assert any(not torch.equal(b, p) for b, p in zip(before, params))
    assert all(p.dtype == torch.float32 for p in params)
    for name, p in model.named_parameters():
        if "lora_" not in name:
            name = name.replace(".base_layer", "")
            assert p.dtype == torch.float16 and torch.equal(p, frozen[name]), f"frozen {name} changed"


# ---------------------------------------------------------------- rollouts free their KV cache
@pytest.fixture(scope="module")
def forced(smol_tokenizer):
    """fit3b.forced_rollout on a tiny model: 2 rows decoded to 400 tokens (the prompt is ~300)."""
    context = 400
    task = sql_env.load_tasks()[0]
    trajectories, stats = fit3b.forced_rollout(build_tiny_model("llama"), smol_tokenizer, task, 2, context)
    return trajectories, context, stats


def _tensors(value):
    """Every torch.Tensor reachable from value through dataclasses, lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if hasattr(value, "__dataclass_fields__"):
        return _tensors(vars(value))
    return []


def test_rollouts_return_plain_python_data(forced):
    """A trajectory holds lists and strings only: nothing keeps the KV cache (or any logits) alive
    into the update, so a step never holds the rollout's peak and the update's at once."""
    trajectories, _, _ = forced
    assert _tensors(trajectories) == []


def test_forced_rollout_fills_every_row_to_the_context(forced):
    """The memory benchmark's rollout is what it says: every row decoded to exactly `context` tokens."""
    trajectories, context, _ = forced
    for t in trajectories:
        prompt = t.assistant_mask.index(1)                 # the first decoded token
        assert t.stop_reason == "max_context" and len(t.token_ids) >= context   # closing tokens follow, never fed
        assert t.assistant_mask[prompt:context] == [1] * (context - prompt)


def test_forced_rollout_counts_what_the_memory_check_prints(forced):
    """memory_checks prints the rollout's prompt and decoded tokens from forced_rollout's counters
    (bench.common.counted_rollout): the decoded tokens are the rows' sampled ones; the two rows
    agree on their prompt, so it is fed once, at the first flush."""
    trajectories, context, stats = forced
    prompt = trajectories[0].assistant_mask.index(1)
    assert stats["generated_tokens"] == sum(sum(t.assistant_mask) for t in trajectories) >= 2 * (context - prompt)
    # fed once for both rows (the prompt's last token may go with the first decode forward), not twice
    assert stats["prompt_tokens"] == stats["flush_fed_tokens"] and prompt - 1 <= stats["prompt_tokens"] < 2 * (prompt - 1)
    assert stats["forwards"] >= context - prompt and stats["logit_rows"] >= stats["forwards"]


# ---------------------------------------------------------------- the CPU estimate
def test_saved_activation_bytes_by_hand():
    """Activation memory = what autograd saves: exp saves its output (4 x 8 fp32 = 128 bytes), and
    a * a saves `a` twice, one storage, counted once; the excluded input is not counted."""
    x = torch.randn(4, 8, requires_grad=True)

    def square_of_exp():
        a = x.exp()
        return a * a

    assert fit3b.saved_activation_bytes(square_of_exp, [x])[1] == 128
    assert fit3b.saved_activation_bytes(lambda: x.exp() * x.exp(), [x])[1] == 2 * 128   # two exp outputs


def estimate(layers=2, micro_batch=2):
    return fit3b.estimate_memory(fit3b.qwen_config(**{**TINY, "num_hidden_layers": layers}), group=2, context=32,
                                 micro_batch=micro_batch, chunk_size=16, lora_r=4)


def test_estimate_sizes_match_a_real_model():
    """The analytic terms are the real sizes: weights and LoRA count of the full model built from the
    same config at the T4 precision, and the KV cache of K and V for every layer, row and token."""
    config = fit3b.qwen_config(**TINY)
    est = estimate()
    model = fit3b.build_random_model(config, "cpu", torch.float16)
    assert est["rollout"]["frozen weights (fp16)"] == sum(p.numel() * 2 for p in model.parameters())
    assert est["lora_params"] == sum(p.numel() for p in lora.apply_lora(model, r=4))
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    assert est["rollout"]["KV cache (2 x 32 tokens)"] == 2 * 32 * 2 * 2 * TINY["num_key_value_heads"] * head_dim * 2


def test_estimate_grows_with_layers_and_micro_batch():
    """More layers cost more in both phases; a bigger micro-batch costs the update, not the rollout."""
    base, deeper, wider = estimate(), estimate(layers=4), estimate(micro_batch=4)
    total = {name: {phase: sum(e[phase].values()) for phase in ("rollout", "update")}
             for name, e in [("base", base), ("deeper", deeper), ("wider", wider)]}
    assert total["deeper"]["rollout"] > total["base"]["rollout"] and total["deeper"]["update"] > total["base"]["update"]
    assert total["wider"]["update"] > total["base"]["update"] and total["wider"]["rollout"] == total["base"]["rollout"]
    assert base["layer_activations_per_seq"] > 0 and all(v > 0 for v in base["update"].values())


def test_resident_peak_sees_a_freed_tensor_until_reset():
    """The instrument of the CPU measurements (bench_memory, check_estimate_on_cpu): the peak
    resident set keeps a 256 MiB tensor that is already freed, and a reset forgets it."""
    mib = 2**20
    common.reset_resident_peak()
    before = common.resident_bytes("VmRSS")
    x = torch.ones(256 * mib // 4)           # fp32: 256 MiB, written, so resident
    del x
    assert common.resident_bytes("VmHWM") - before >= 250 * mib
    assert common.resident_bytes("VmRSS") - before < 64 * mib
    common.reset_resident_peak()
    assert common.resident_bytes("VmHWM") - common.resident_bytes("VmRSS") < 64 * mib


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_check_without_a_gpu_exits_nonzero_and_says_why():
    """`python -m bench gpu` on a CPU stops at once with a nonzero status and a sentence, not a traceback."""
    with pytest.raises(SystemExit) as stop:
        fit3b.bench_gpu(SimpleNamespace(seed=0))
    assert "needs a CUDA GPU" in str(stop.value.code)
