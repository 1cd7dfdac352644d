"""Tests for forward.py: token log-probs, the shared prompt and group segments, on a tiny
random Llama. Each forward that shares tokens is checked against policy_loss (or the SFT loss)
on the whole sequences: the same loss and the same update.

Run: python -m pytest -q tests/test_forward.py
"""
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import forward
import grpo
import lora

VOCAB = 97

# ---------------------------------------------------------------- fixtures
def tiny_model(seed=0):
    """2-layer random Llama with agentrl's LoRA (B = 0 at init); returns (model, lora params)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).float()
    return model, lora.apply_lora(model, r=4, alpha=8, targets=("q_proj", "v_proj"))


def perturb_lora(params, seed=1):
    """Nonzero B so that the adapter changes the model (and A gets gradients)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(0.3 * torch.randn(p.shape, generator=g))


def trajectories(n=6, seed=0):
    """Trajectories of different lengths: a prompt (mask 0), then sampled tokens (mask 1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt, sampled = 3 + i % 3, 4 + (2 * i) % 7
        ids = torch.randint(0, VOCAB, (prompt + sampled,), generator=g).tolist()
        mask = [0] * prompt + [1] * sampled
        logps = [-(0.5 + torch.rand(1, generator=g).item() * 4) * m for m in mask]
        out.append(SimpleNamespace(token_ids=ids, assistant_mask=mask, sampled_logprobs=logps))
    return out


ADVANTAGES = [1.0, -0.5, 0.7, -1.2, 0.0, 0.4]


# ---------------------------------------------------------------- token log-probs
def padded_batch(trajs):
    b = forward.collate(trajs, [0.0] * len(trajs), torch.device("cpu"))
    return b["input_ids"], b["attention_mask"]


def test_token_logprobs_match_the_model_logits_per_sequence():
    """Right-padded batch == each sequence alone through model(...).logits: positions and shift are right."""
    model, _ = tiny_model()
    trajs = trajectories(3)
    ids, attn = padded_batch(trajs)
    with torch.no_grad():
        got = forward.token_logprobs(model, ids, attn, chunk_size=5)  # (B, T)
        for i, t in enumerate(trajs):
            x = torch.tensor([t.token_ids])
            want = model(x).logits[0, :-1].log_softmax(-1).gather(-1, x[0, 1:, None]).squeeze(-1)
            torch.testing.assert_close(got[i, 1:len(t.token_ids)], want, rtol=1e-5, atol=1e-5)
            assert got[i, 0] == 0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_chunked_logprobs_equal_unchunked_in_values_and_gradients(checkpointing):
    """Chunking (with per-chunk recompute) and layer checkpointing change memory, never the math."""
    model, params = tiny_model()
    perturb_lora(params)
    model.train()
    ids, attn = padded_batch(trajectories(4))
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))
    results = []
    for chunk_size, gc in [(None, False), (7, checkpointing)]:
        forward.set_gradient_checkpointing(model, gc)
        logps = forward.token_logprobs(model, ids, attn, chunk_size=chunk_size)
        grads = torch.autograd.grad((logps * weights).sum(), params)
        results.append((logps.detach(), grads))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for g0, g1 in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(g0, g1, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_logprobs_at_trained_positions_only_equal_the_full_ones_there(chunk_size):
    """positions= runs the lm_head only where a token is trained: the same values and gradients
    there, 0 elsewhere (prompt, tool results, padding)."""
    model, params = tiny_model()
    perturb_lora(params)
    model.train()
    trajs = trajectories(4)
    b = forward.collate(trajs, [0.0] * 4, torch.device("cpu"))
    weights = torch.randn(b["mask"].shape, generator=torch.Generator().manual_seed(0)) * b["mask"]
    full = forward.token_logprobs(model, b["input_ids"], b["attention_mask"], chunk_size)
    full_grads = torch.autograd.grad((full * weights).sum(), params)
    only = forward.token_logprobs(model, b["input_ids"], b["attention_mask"], chunk_size, positions=b["mask"])
    only_grads = torch.autograd.grad((only * weights).sum(), params)
    torch.testing.assert_close(only, full * b["mask"], rtol=1e-5, atol=1e-6)
    assert (only[b["mask"] == 0] == 0).all()
    for g0, g1 in zip(full_grads, only_grads):
        torch.testing.assert_close(g0, g1, rtol=1e-4, atol=1e-6)



# ---------------------------------------------------------------- the shared prompt
NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)   # fp32: the scaler is a pass-through


def step(model, params, config, trajs=None, advantages=ADVANTAGES, lr=0.1, **kw):
    optimizer = torch.optim.SGD(params, lr=lr)
    trajs = trajs or trajectories(len(advantages))
    return grpo.grpo_step(model, optimizer, trajs, advantages, config, NO_SCALER, **kw)



def shared_prompt_trajectories(n=6, seed=0):
    """Trajectories as a step has them: one long prompt in common (the system prompt), a question
    of their own, then sampled tokens. Trajectories 0 and 1 share their question too (one group)."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, VOCAB, (12,), generator=g).tolist()
    out = []
    for i, t in enumerate(trajectories(n, seed)):
        question = [5, 6, 7] if i < 2 else [8 + i, 9]
        t.token_ids = system + question + t.token_ids
        t.assistant_mask = [0] * (len(system) + len(question)) + t.assistant_mask
        t.sampled_logprobs = [0.0] * (len(system) + len(question)) + t.sampled_logprobs
        out.append(t)
    return out


def test_shared_prefix_length_stops_at_the_first_difference_or_before_the_first_trained_token():
    one = SimpleNamespace(token_ids=[1, 2, 3, 4, 5, 6], assistant_mask=[0, 0, 0, 0, 1, 1])
    same_prompt = SimpleNamespace(token_ids=[1, 2, 3, 4, 5, 7], assistant_mask=[0, 0, 0, 0, 1, 1])
    other = SimpleNamespace(token_ids=[1, 2, 9, 4, 5, 6], assistant_mask=[0, 0, 0, 0, 0, 1])
    assert forward.shared_prefix_length([one]) == 3              # position 3 predicts the first trained token
    assert forward.shared_prefix_length([one, same_prompt]) == 3
    assert forward.shared_prefix_length([one, same_prompt, other]) == 2
    trajs = shared_prompt_trajectories(6)
    assert forward.shared_prefix_length(trajs) == 12 and forward.shared_prefix_length(trajs[:2]) == 15   # their own tokens differ from there


def count_layer_forwards(model):
    """Count the decoder layers' attention forwards (a checkpointed layer runs again in the backward)."""
    calls = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls



@pytest.mark.parametrize("kl_coef,checkpointing", [(0.0, False), (0.1, False), (0.0, True), (0.1, True)])
@pytest.mark.parametrize("mbs", [1, 4])
def test_a_shared_prefix_gives_the_update_of_forwarding_every_sequence_whole(mbs, kl_coef, checkpointing):
    """The step's common prompt forwarded once (forward.SharedPrefix) and its gradient carried back
    after the micro-batches: the same loss, KL and update as policy_loss on the whole sequences,
    with layer checkpointing too (the micro-batches' layers recomputed, the prefix's cache read twice)."""
    trajs = shared_prompt_trajectories(6)
    model, params = tiny_model()
    perturb_lora(params)
    b = forward.collate(trajs, ADVANTAGES, torch.device("cpu"))
    model.train()
    logps = forward.token_logprobs(model, b["input_ids"], b["attention_mask"], chunk_size=None)
    with torch.no_grad(), lora.lora_disabled(model):
        refs = forward.token_logprobs(model, b["input_ids"], b["attention_mask"], chunk_size=None)
    loss, want = grpo.policy_loss(logps, b["old_logprobs"], b["advantages"], b["mask"], kl_coef=kl_coef,
                                  ref_logprobs=refs)
    grads = torch.autograd.grad(loss, params)
    expected = [p.detach() - 0.1 * g for p, g in zip(params, grads)]

    model, params = tiny_model()
    perturb_lora(params)
    config = grpo.GRPOConfig(micro_batch_size=mbs, kl_coef=kl_coef, max_grad_norm=1e9, gradient_checkpointing=checkpointing)
    assert forward._prefix_length(trajs, config) == 12
    calls = count_layer_forwards(model)
    stats = step(model, params, config, trajs=trajs, reference_context=lora.lora_disabled(model))
    batches = math.ceil((6 if kl_coef else 5) / mbs)      # without KL the zero-advantage trajectory is not forwarded
    forwards = 2 * (1 + (kl_coef > 0)) * (1 + batches) + 2 * (1 + batches) * checkpointing   # 2 layers each time
    assert len(calls) == forwards      # the prefix and each micro-batch (and the reference's), recomputed with grad
    assert stats["loss"] == pytest.approx(loss.item(), rel=1e-4)
    assert stats["kl"] == (None if kl_coef == 0 else pytest.approx(want["kl"], rel=1e-4))
    for want_p, p in zip(expected, params):
        torch.testing.assert_close(p.detach(), want_p, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- group segments
def family_trajectories(seed=0, shape="part after a turn"):
    """A step as GRPO sees it after SFT: one prompt for all (12 tokens); two groups whose rollouts
    go on together through a first turn and its tool result (20 tokens: 6 sampled, then 14 of
    mask 0), then part, each with a sampled tail of its own; one more trajectory alone. Each row
    has its own rollout log-probs, on the shared tokens too (the sampler's batches round apart).
    Other shapes of the first group: "part at once", its rows share a long question (20 tokens)
    and differ from their first sampled token (a segment with nothing trained); "the same to the
    end", one trajectory three times, closed by a tool message (nothing trained after the segment)."""
    g = torch.Generator().manual_seed(seed)
    ints = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()
    prompt, out = ints(12), []
    for group, rows in enumerate((3, 2, 1)):
        question, turn, result, same_tail = ints(3), ints(6), ints(14), ints(4)
        long_question = ints(20)
        for _ in range(rows):
            tail = same_tail if group == 0 and shape == "the same to the end" else ints(3 + len(out) % 4)
            ids = prompt + question + turn + result + tail + [1, 2]
            mask = [0] * 15 + [1] * 6 + [0] * 14 + [1] * len(tail) + [0, 0]
            if group == 0 and shape == "part at once":
                ids, mask = prompt + long_question + tail, [0] * 32 + [1] * len(tail)
            logps = [-(0.5 + torch.rand(1, generator=g).item() * 3) * m for m in mask]
            out.append(SimpleNamespace(token_ids=ids, assistant_mask=mask, sampled_logprobs=logps))
    return out


def test_prefix_families_find_each_group_s_shared_run():
    trajs = family_trajectories()
    assert forward._prefix_length(trajs, grpo.GRPOConfig()) == 12       # the prompt: the questions differ
    # each group's run ends one token before its rows part (35 tokens in common: index 34); the
    # trajectory alone comes last, from the prompt on
    families = forward.prefix_families(trajs, 12)
    assert sorted((end, sorted(rows)) for end, rows in families[:2]) == [(34, [0, 1, 2]), (34, [3, 4])]
    assert families[2:] == [(12, [5])]
    assert [(end, sorted(rows)) for end, rows in forward.prefix_families(trajs, 12, min_segment=23)] == [(12, list(range(6)))]
    assert forward.prefix_families(trajs[:1], 12) == [(12, [0])]
    # a fourth row of the first group parts at token 20, a third of the way into the run: joined, it
    # would cut the others' run to 7 tokens, so it stays alone (with the short segments allowed)
    deviant = SimpleNamespace(**vars(trajs[0]))
    deviant.token_ids = trajs[0].token_ids[:20] + [(trajs[0].token_ids[20] + 1) % VOCAB] + trajs[0].token_ids[21:]
    families = [(end, sorted(rows)) for end, rows in forward.prefix_families(trajs + [deviant], 12, min_segment=4)]
    assert (34, [0, 1, 2]) in families and families[-1] == (12, [5, 6])
    # the shapes where a segment holds no trained token, and where rows hold none after it
    def first_group(trajectories):
        return next((end, sorted(rows)) for end, rows in forward.prefix_families(trajectories, 12) if 0 in rows)
    assert first_group(family_trajectories(shape="part at once")) == (31, [0, 1, 2])
    same = family_trajectories(shape="the same to the end")
    assert first_group(same) == (len(same[0].token_ids) - 2, [0, 1, 2])


@pytest.mark.parametrize("shape", ["part after a turn", "part at once", "the same to the end"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("mbs,aggregation", [(1, "token"), (2, "sequence"), (1, "constant")])
def test_group_segments_give_the_update_of_forwarding_every_sequence_whole(mbs, aggregation, checkpointing, shape):
    """Each group's shared run forwarded once (a SharedPrefix segment after the prompt), its
    trained tokens' log-probs taken once and each row's loss terms on them: the same loss and
    update as policy_loss on the whole sequences (the rows' rollout log-probs far from the model's,
    so the clip acts), with layer checkpointing too; one forward per segment, none for rows left
    with nothing to train; a segment with nothing to train is still read by its rows."""
    trajs, advantages = family_trajectories(shape=shape), [1.0, -0.5, -0.5, 0.8, -0.8, 0.3]
    model, params = tiny_model()
    perturb_lora(params)
    b = forward.collate(trajs, advantages, torch.device("cpu"))
    model.train()
    logps = forward.token_logprobs(model, b["input_ids"], b["attention_mask"], chunk_size=None)
    loss, want = grpo.policy_loss(logps, b["old_logprobs"], b["advantages"], b["mask"], aggregation=aggregation,
                                  max_tokens=16)
    grads = torch.autograd.grad(loss, params)
    expected = [p.detach() - 0.1 * g for p, g in zip(params, grads)]
    assert want["clip_frac_low"] + want["clip_frac_high"] > 0

    model, params = tiny_model()
    perturb_lora(params)
    config = grpo.GRPOConfig(micro_batch_size=mbs, aggregation=aggregation, max_tokens=16, max_grad_norm=1e9,
                             gradient_checkpointing=checkpointing)
    calls = count_layer_forwards(model)
    stats = step(model, params, config, trajs=trajs, advantages=advantages)
    rows = (0 if shape == "the same to the end" else 3, 2, 1)       # rows with a trained token after their segment
    forwards = 1 + 2 + sum(math.ceil(n / mbs) for n in rows)         # the prompt, 2 segments, the micro-batches
    assert len(calls) == 2 * forwards * (1 + checkpointing)          # 2 layers, each recomputed in the backward
    assert stats["loss"] == pytest.approx(loss.item(), rel=1e-4) and stats["forwarded_tokens"] == want["tokens"]
    assert not stats["skipped"] and stats["forwarded_sequences"] == 6
    for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "kl_old"):
        assert stats[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
    for want_p, p in zip(expected, params):
        torch.testing.assert_close(p.detach(), want_p, rtol=1e-4, atol=1e-6)


SFT_CASES = {   # name: (trajectories, forwards of each layer: the prompt, then segments and rows)
    "the prompt shared": (lambda: shared_prompt_trajectories(4), 1 + 4),
    "part after a turn": (lambda: family_trajectories(shape="part after a turn"), 1 + 2 + 6),
    "part at once": (lambda: family_trajectories(shape="part at once"), 1 + 2 + 6),
    "the same to the end": (lambda: family_trajectories(shape="the same to the end"), 1 + 2 + 3)}


@pytest.mark.parametrize("case", list(SFT_CASES))
@pytest.mark.parametrize("checkpointing", [False, True])
def test_sft_step_with_a_shared_prefix_and_group_segments_equals_the_whole_sequences(checkpointing, case):
    """The supervised step (the warm start; rejection sampling's step on a group's correct
    rollouts): the prompt forwarded once, each group's shared run once (a segment, its tokens
    counted once per row), and the same loss and update as the whole sequences; one forward per
    segment, none for rows left with nothing to train."""
    make, forwards = SFT_CASES[case]
    trajs = make()
    model, params = tiny_model()
    perturb_lora(params)
    b = forward.collate(trajs, [0.0] * len(trajs), torch.device("cpu"))
    model.train()
    logps = forward.token_logprobs(model, b["input_ids"], b["attention_mask"], chunk_size=None)
    loss = -(logps * b["mask"]).sum() / b["mask"].sum()
    grads = torch.autograd.grad(loss, params)
    expected = [p.detach() - 0.1 * g for p, g in zip(params, grads)]
    model, params = tiny_model()
    perturb_lora(params)
    calls = count_layer_forwards(model)
    stats = grpo.sft_step(model, torch.optim.SGD(params, lr=0.1), trajs,
                          grpo.GRPOConfig(micro_batch_size=1, max_grad_norm=1e9, gradient_checkpointing=checkpointing),
                          NO_SCALER)
    assert len(calls) == 2 * forwards * (1 + checkpointing)     # 2 layers, each recomputed in the backward
    assert stats["sft_loss"] == pytest.approx(loss.item(), rel=1e-4)
    for want_p, p in zip(expected, params):
        torch.testing.assert_close(p.detach(), want_p, rtol=1e-4, atol=1e-6)
