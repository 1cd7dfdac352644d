"""Tests for grpo.py: the math by hand on tiny tensors, the plumbing on a tiny random Llama.

Run: python -m pytest -q tests/test_grpo.py
"""
import math
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

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


# ---------------------------------------------------------------- advantages
def test_advantages_are_group_normalized():
    """GRPO: reward minus group mean over group std (n - 1); Dr. GRPO: no std division."""
    adv, counts = grpo.group_advantages([[1.0, 2.0, 3.0], [0.0, 1.0]])
    assert adv[0] == pytest.approx([-1.0, 0.0, 1.0])
    assert adv[1] == pytest.approx([-math.sqrt(0.5), math.sqrt(0.5)])
    adv, _ = grpo.group_advantages([[1.0, 2.0, 4.0]], scale_by_std=False)
    assert adv[0] == pytest.approx([-4 / 3, -1 / 3, 5 / 3])
    assert counts == {"groups": 2, "trainable_groups": 2, "zero_variance_groups": 0, "unscored_groups": 0}


def test_zero_variance_and_unscored_groups_contribute_nothing_and_are_counted():
    """An all-equal group has no signal and an unscored one has no rewards: both None, both counted."""
    adv, counts = grpo.group_advantages([[0.5, 0.5, 0.5], None, [0.0, 1.0]])
    assert adv[0] is None and adv[1] is None and adv[2] is not None
    assert counts == {"groups": 3, "trainable_groups": 1, "zero_variance_groups": 1, "unscored_groups": 1}


def test_batch_from_groups_drops_non_finite_rows_before_the_baseline_and_flattens():
    """Rows cut on non-finite logits leave their group before the mean is taken; a group left with
    one row is unscored; an all-equal group adds nothing; the rest is flattened in group order."""
    def group(*rows):      # (reward, stop_reason) per trajectory
        return SimpleNamespace(trajectories=[SimpleNamespace(stop_reason=s, name=f"{r}/{s}") for r, s in rows])

    ok, bad = "submitted", "non_finite_logits"
    groups = [group((1.0, ok), (0.0, ok), (5.0, bad)),      # the 5.0 must not move the baseline
              group((1.0, ok), (0.0, bad)),                 # one row left: unscored
              group((1.0, ok), (1.0, ok)),                  # all equal: no signal
              group((0.0, ok), (2.0, ok))]
    rewards = [[float(t.name.split("/")[0]) for t in g.trajectories] for g in groups]
    batch, advantages, counts = grpo.batch_from_groups(groups, rewards, scale_by_std=False)
    assert [t.name for t in batch] == ["1.0/submitted", "0.0/submitted", "0.0/submitted", "2.0/submitted"]
    assert advantages == [0.5, -0.5, -1.0, 1.0]
    assert counts["non_finite_trajectories"] == 2 and counts["unscored_groups"] == 1
    assert counts["zero_variance_groups"] == 1 and counts["trainable_groups"] == 2


def test_worked_examples_in_docstrings():
    """The `>>>` examples in grpo.py (advantages and the clipped loss, by hand) hold."""
    import doctest
    result = doctest.testmod(grpo)
    assert result.attempted >= 6 and result.failed == 0


# ---------------------------------------------------------------- the loss by hand
def hand_example():
    """Seq 0 (A = +1): ratios 1.5 (clipped at 1.28), 0.9. Seq 1 (A = -1): ratio 0.5 (clipped at 0.8).
    Per-token losses -1.28, -0.9 and +0.8; the masked positions hold garbage that must not count."""
    old = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -1.0, 0.0, 0.0]])
    logprobs = old + torch.log(torch.tensor([[1.0, 1.5, 0.9, 1.0], [1.0, 0.5, 1.0, 1.0]]))
    logprobs[:, 3] = -50.0  # padding: huge log-ratio, masked
    mask = torch.tensor([[0.0, 1, 1, 0], [0, 1, 0, 0]])
    return logprobs, old, torch.tensor([1.0, -1.0]), mask


@pytest.mark.parametrize("aggregation,expected", [
    ("token", (-1.28 - 0.9 + 0.8) / 3),              # DAPO: all trained tokens weigh the same
    ("sequence", ((-1.28 - 0.9) / 2 + 0.8 / 1) / 2),  # GRPO: per-sequence mean, then batch mean
    ("constant", (-1.28 - 0.9 + 0.8) / (2 * 4)),     # Dr. GRPO: sum / (B * max_tokens)
])
def test_loss_variants_match_hand_computed_values(aggregation, expected):
    """Each aggregation is exactly its normalizer applied to the same clipped per-token losses."""
    loss, stats = grpo.policy_loss(*hand_example(), aggregation=aggregation, max_tokens=4)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["clip_frac_high"] == pytest.approx(1 / 3) and stats["clip_frac_low"] == pytest.approx(1 / 3)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.9 + 0.5) / 3, abs=1e-6)
    assert stats["tokens"] == 3 and stats["kl"] is None


@pytest.mark.parametrize("ratio,adv,clipped,stat", [
    (1.28 + 1e-4, 1.0, True, "clip_frac_high"),   # above 1 + eps_high, A > 0: clipped, no gradient
    (1.28 - 1e-4, 1.0, False, None),              # just inside: full gradient
    (1.28 + 1e-4, -1.0, False, None),             # above the range but A < 0: the min keeps r A, gradient flows
    (0.8 - 1e-4, -1.0, True, "clip_frac_low"),    # below 1 - eps_low, A < 0: clipped
    (0.8 + 1e-4, -1.0, False, None),              # just inside
    (0.8 - 1e-4, 1.0, False, None),               # below the range but A > 0: gradient flows
])
def test_clipping_at_the_boundaries_depends_on_advantage_sign(ratio, adv, clipped, stat):
    """The clip zeroes the gradient only where it makes the objective more pessimistic (PPO)."""
    old = torch.tensor([[0.0, -1.0]], dtype=torch.float64)
    logprobs = (old + torch.tensor([[0.0, math.log(ratio)]], dtype=torch.float64)).requires_grad_(True)
    loss, stats = grpo.policy_loss(logprobs, old, torch.tensor([adv]), torch.tensor([[0.0, 1.0]]))
    loss.backward()
    expected_grad = 0.0 if clipped else -adv * ratio  # d(-r A)/d logp = -r A
    assert logprobs.grad[0, 1].item() == pytest.approx(expected_grad, abs=1e-9)
    bound = 1.28 if ratio > 1 else 0.8
    assert loss.item() == pytest.approx(-adv * (bound if clipped else ratio), abs=1e-9)
    for key in ("clip_frac_low", "clip_frac_high"):
        assert stats[key] == (1.0 if key == stat else 0.0)


def test_kl_k3_by_hand_and_zero_when_reference_equals_policy():
    """k3 = exp(d) - d - 1 with d = ref - logp: 1 - ln 2 at d = ln 2, exactly 0 at d = 0."""
    logprobs, old, adv, mask = hand_example()
    base, _ = grpo.policy_loss(logprobs, old, adv, mask)
    same, stats = grpo.policy_loss(logprobs, old, adv, mask, kl_coef=0.5, ref_logprobs=logprobs.clone())
    assert stats["kl"] == 0.0 and same.item() == pytest.approx(base.item())
    shifted, stats = grpo.policy_loss(logprobs, old, adv, mask, kl_coef=0.5, ref_logprobs=logprobs + math.log(2))
    assert stats["kl"] == pytest.approx(1 - math.log(2), abs=1e-6)
    assert shifted.item() == pytest.approx(base.item() + 0.5 * (1 - math.log(2)), abs=1e-6)


# ---------------------------------------------------------------- token log-probs
def padded_batch(trajs):
    b = grpo._collate(trajs, [0.0] * len(trajs), torch.device("cpu"))
    return b["input_ids"], b["attention_mask"]


def test_token_logprobs_match_the_model_logits_per_sequence():
    """Right-padded batch == each sequence alone through model(...).logits: positions and shift are right."""
    model, _ = tiny_model()
    trajs = trajectories(3)
    ids, attn = padded_batch(trajs)
    with torch.no_grad():
        got = grpo.token_logprobs(model, ids, attn, chunk_size=5)  # (B, T)
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
        grpo.set_gradient_checkpointing(model, gc)
        logps = grpo.token_logprobs(model, ids, attn, chunk_size=chunk_size)
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
    b = grpo._collate(trajs, [0.0] * 4, torch.device("cpu"))
    weights = torch.randn(b["mask"].shape, generator=torch.Generator().manual_seed(0)) * b["mask"]
    full = grpo.token_logprobs(model, b["input_ids"], b["attention_mask"], chunk_size)
    full_grads = torch.autograd.grad((full * weights).sum(), params)
    only = grpo.token_logprobs(model, b["input_ids"], b["attention_mask"], chunk_size, positions=b["mask"])
    only_grads = torch.autograd.grad((only * weights).sum(), params)
    torch.testing.assert_close(only, full * b["mask"], rtol=1e-5, atol=1e-6)
    assert (only[b["mask"] == 0] == 0).all()
    for g0, g1 in zip(full_grads, only_grads):
        torch.testing.assert_close(g0, g1, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- one step
NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)   # fp32: the scaler is a pass-through


def step(model, params, config, trajs=None, advantages=ADVANTAGES, lr=0.1, **kw):
    optimizer = torch.optim.SGD(params, lr=lr)
    trajs = trajs or trajectories(len(advantages))
    return grpo.grpo_step(model, optimizer, trajs, advantages, config, NO_SCALER, **kw)


@pytest.mark.parametrize("aggregation", grpo.AGGREGATIONS)
def test_micro_batch_accumulation_equals_one_big_batch(aggregation):
    """With step-wide normalizers, micro-batches of 1, 2 or 6 (zero-advantage trajectory skipped) give
    the update of policy_loss on all 6 trajectories at once."""
    model, params = tiny_model()
    perturb_lora(params)
    trajs = trajectories(6)
    b = grpo._collate(trajs, ADVANTAGES, torch.device("cpu"))
    model.train()
    logps = grpo.token_logprobs(model, b["input_ids"], b["attention_mask"], chunk_size=None)
    loss, _ = grpo.policy_loss(logps, b["old_logprobs"], b["advantages"], b["mask"], aggregation=aggregation,
                               max_tokens=max(sum(t.assistant_mask) for t in trajs))
    grads = torch.autograd.grad(loss, params)
    expected = [p.detach() - 0.1 * g for p, g in zip(params, grads)]  # one SGD step, lr 0.1
    for mbs in (1, 2, 6):
        model, params = tiny_model()
        perturb_lora(params)
        config = grpo.GRPOConfig(micro_batch_size=mbs, aggregation=aggregation, max_grad_norm=1e9)
        stats = step(model, params, config, trajs=trajs)
        assert stats["loss"] == pytest.approx(loss.item(), rel=1e-4) and stats["forwarded_sequences"] == 5
        for want, p in zip(expected, params):
            torch.testing.assert_close(p.detach(), want, rtol=1e-4, atol=1e-6)


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
    assert grpo.shared_prefix_length([one]) == 3              # position 3 predicts the first trained token
    assert grpo.shared_prefix_length([one, same_prompt]) == 3
    assert grpo.shared_prefix_length([one, same_prompt, other]) == 2
    trajs = shared_prompt_trajectories(6)
    assert grpo.shared_prefix_length(trajs) == 12 and grpo.shared_prefix_length(trajs[:2]) == 15   # their own tokens differ from there


def count_layer_forwards(model):
    """Count the decoder layers' attention forwards (a checkpointed layer runs again in the backward)."""
    calls = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


@pytest.mark.parametrize("kl_coef,checkpointing", [(0.0, False), (0.1, False), (0.0, True), (0.1, True)])
@pytest.mark.parametrize("mbs", [1, 4])
def test_a_shared_prefix_gives_the_update_of_forwarding_every_sequence_whole(mbs, kl_coef, checkpointing):
    """The step's common prompt forwarded once (grpo.SharedPrefix) and its gradient carried back
    after the micro-batches: the same loss, KL and update as policy_loss on the whole sequences,
    with layer checkpointing too (the micro-batches' layers recomputed, the prefix's cache read twice)."""
    trajs = shared_prompt_trajectories(6)
    model, params = tiny_model()
    perturb_lora(params)
    b = grpo._collate(trajs, ADVANTAGES, torch.device("cpu"))
    model.train()
    logps = grpo.token_logprobs(model, b["input_ids"], b["attention_mask"], chunk_size=None)
    with torch.no_grad(), lora.lora_disabled(model):
        refs = grpo.token_logprobs(model, b["input_ids"], b["attention_mask"], chunk_size=None)
    loss, want = grpo.policy_loss(logps, b["old_logprobs"], b["advantages"], b["mask"], kl_coef=kl_coef,
                                  ref_logprobs=refs)
    grads = torch.autograd.grad(loss, params)
    expected = [p.detach() - 0.1 * g for p, g in zip(params, grads)]

    model, params = tiny_model()
    perturb_lora(params)
    config = grpo.GRPOConfig(micro_batch_size=mbs, kl_coef=kl_coef, max_grad_norm=1e9, gradient_checkpointing=checkpointing)
    assert grpo._prefix_length(trajs, config) == 12
    calls = count_layer_forwards(model)
    stats = step(model, params, config, trajs=trajs, reference_context=lora.lora_disabled(model))
    batches = math.ceil((6 if kl_coef else 5) / mbs)      # without KL the zero-advantage trajectory is not forwarded
    forwards = 2 * (1 + (kl_coef > 0)) * (1 + batches) + 2 * (1 + batches) * checkpointing   # 2 layers each time
    assert len(calls) == forwards      # the prefix and each micro-batch (and the reference's), recomputed with grad
    assert stats["loss"] == pytest.approx(loss.item(), rel=1e-4)
    assert stats["kl"] == (None if kl_coef == 0 else pytest.approx(want["kl"], rel=1e-4))
    for want_p, p in zip(expected, params):
        torch.testing.assert_close(p.detach(), want_p, rtol=1e-4, atol=1e-6)


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
    assert grpo._prefix_length(trajs, grpo.GRPOConfig()) == 12       # the prompt: the questions differ
    # each group's run ends one token before its rows part (35 tokens in common: index 34); the
    # trajectory alone comes last, from the prompt on
    families = grpo.prefix_families(trajs, 12)
    assert sorted((end, sorted(rows)) for end, rows in families[:2]) == [(34, [0, 1, 2]), (34, [3, 4])]
    assert families[2:] == [(12, [5])]
    assert [(end, sorted(rows)) for end, rows in grpo.prefix_families(trajs, 12, min_segment=23)] == [(12, list(range(6)))]
    assert grpo.prefix_families(trajs[:1], 12) == [(12, [0])]
    # a fourth row of the first group parts at token 20, a third of the way into the run: joined, it
    # would cut the others' run to 7 tokens, so it stays alone (with the short segments allowed)
    deviant = SimpleNamespace(**vars(trajs[0]))
    deviant.token_ids = trajs[0].token_ids[:20] + [(trajs[0].token_ids[20] + 1) % VOCAB] + trajs[0].token_ids[21:]
    families = [(end, sorted(rows)) for end, rows in grpo.prefix_families(trajs + [deviant], 12, min_segment=4)]
    assert (34, [0, 1, 2]) in families and families[-1] == (12, [5, 6])
    # the shapes where a segment holds no trained token, and where rows hold none after it
    def first_group(trajectories):
        return next((end, sorted(rows)) for end, rows in grpo.prefix_families(trajectories, 12) if 0 in rows)
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
    b = grpo._collate(trajs, advantages, torch.device("cpu"))
    model.train()
    logps = grpo.token_logprobs(model, b["input_ids"], b["attention_mask"], chunk_size=None)
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
    b = grpo._collate(trajs, [0.0] * len(trajs), torch.device("cpu"))
    model.train()
    logps = grpo.token_logprobs(model, b["input_ids"], b["attention_mask"], chunk_size=None)
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


def test_trajectories_without_signal_are_not_forwarded_unless_kl():
    """A = 0 or no trained token: no gradient without KL, so no forward; with KL, A = 0 still pulls."""
    model, params = tiny_model()
    trajs = trajectories(6)
    trajs[1].assistant_mask = [0] * len(trajs[1].token_ids)  # cut off before sampling anything
    trajs[1].sampled_logprobs = [0.0] * len(trajs[1].token_ids)
    assert step(model, params, grpo.GRPOConfig(), trajs=trajs)["forwarded_sequences"] == 4
    stats = step(model, params, grpo.GRPOConfig(kl_coef=0.1), trajs=trajs,
                 reference_context=lora.lora_disabled(model))
    assert stats["forwarded_sequences"] == 5


def test_one_step_changes_lora_params_and_only_them():
    """AdamW on the LoRA parameters moves them; the frozen base model stays bit-identical."""
    model, params = tiny_model()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    stats = grpo.grpo_step(model, optimizer, trajectories(6), ADVANTAGES, grpo.GRPOConfig(micro_batch_size=4), NO_SCALER)
    assert not stats["skipped"] and stats["grad_norm"] > 0
    assert any(not torch.equal(b, p) for b, p in zip(before, params))
    for n, p in model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(frozen[n], p), f"frozen parameter {n} changed"
    assert all(p.grad is None for p in params), "the step leaves no gradient behind"


def test_a_step_raises_the_log_prob_of_positive_advantages_and_lowers_negative_ones():
    """The direction of the policy gradient: after one small step, each trajectory's summed
    log-prob moves with the sign of its advantage (recorded log-probs are fresh, so ratio = 1)."""
    model, params = tiny_model()
    perturb_lora(params)
    trajs = trajectories(2, seed=3)

    def masked_logprobs(t):
        with torch.no_grad():
            ids = torch.tensor([t.token_ids])
            lp = grpo.token_logprobs(model, ids, torch.ones_like(ids))[0].tolist()
        return [v * m for v, m in zip(lp, t.assistant_mask)]

    for t in trajs:  # on-policy: the "sampled" log-probs are the current policy's
        t.sampled_logprobs = masked_logprobs(t)
    before = [sum(t.sampled_logprobs) for t in trajs]
    grpo.grpo_step(model, torch.optim.SGD(params, lr=1e-2), trajs, [1.0, -1.0], grpo.GRPOConfig(), NO_SCALER)
    after = [sum(masked_logprobs(t)) for t in trajs]
    assert after[0] > before[0] and after[1] < before[1], (before, after)


def test_kl_is_zero_while_the_adapter_is_a_no_op_then_positive():
    """With B = 0 the policy is the base model, so KL(policy || LoRA-off) is exactly 0; after a step it is not."""
    model, params = tiny_model()
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    config = grpo.GRPOConfig(kl_coef=0.1)
    first, second = (grpo.grpo_step(model, optimizer, trajectories(6), ADVANTAGES, config, NO_SCALER,
                                    reference_context=lora.lora_disabled(model)) for _ in range(2))
    assert first["kl"] == 0.0 and second["kl"] > 0


def test_grpo_update_with_one_epoch_and_one_minibatch_is_one_grpo_step():
    """K = 1 is today's step, bit for bit."""
    results = []
    for update in ("step", "update"):
        model, params = tiny_model()
        perturb_lora(params)
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        call = grpo.grpo_step if update == "step" else grpo.grpo_update
        stats = call(model, optimizer, trajectories(6), ADVANTAGES, grpo.GRPOConfig(micro_batch_size=4), NO_SCALER)
        results.append(([p.detach().clone() for p in params], stats))
    (a, stats_a), (b, stats_b) = results
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert stats_b["updates"] == 1 and stats_a["loss"] == stats_b["loss"]


def test_several_steps_per_batch_with_a_kl_term_reuse_the_reference_context():
    """grpo_update enters the one reference context it is given at every step (4 here)."""
    model, params = tiny_model()
    perturb_lora(params)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    config = grpo.GRPOConfig(epochs=2, minibatches=2, kl_coef=0.1)
    stats = grpo.grpo_update(model, optimizer, trajectories(6), ADVANTAGES, config, NO_SCALER,
                             reference_context=lora.lora_disabled(model))
    assert stats["updates"] == 4 and stats["kl"] > 0
    assert all(m.enabled for m in model.modules() if isinstance(m, lora.LoRALinear))


def test_several_steps_per_batch_make_the_ratio_move_and_the_clip_act():
    """On fresh rollouts (recorded log-probs = the policy's own) the first step sees ratio 1 and
    clips nothing; after 2 epochs x 2 minibatches at a high learning rate the policy has moved away
    from the sampler: kl_old > 0 and the clip acts on some tokens."""
    model, params = tiny_model()
    perturb_lora(params)
    trajs = trajectories(6, seed=5)
    b = grpo._collate(trajs, ADVANTAGES, torch.device("cpu"))
    with torch.no_grad():
        fresh = grpo.token_logprobs(model.eval(), b["input_ids"], b["attention_mask"])
    for t, row in zip(trajs, fresh):
        t.sampled_logprobs = [lp * m for lp, m in zip(row[:len(t.token_ids)].tolist(), t.assistant_mask)]
    optimizer = torch.optim.AdamW(params, lr=5e-2)
    first = grpo.grpo_step(model, optimizer, trajs, ADVANTAGES, grpo.GRPOConfig(), NO_SCALER)
    assert first["kl_old"] < 1e-5 and first["clip_frac_low"] + first["clip_frac_high"] == 0
    model, params = tiny_model()
    perturb_lora(params)
    optimizer = torch.optim.AdamW(params, lr=5e-2)
    stats = grpo.grpo_update(model, optimizer, trajs, ADVANTAGES, grpo.GRPOConfig(epochs=2, minibatches=2), NO_SCALER)
    assert stats["updates"] == 4 and stats["kl_old_last"] > 1e-3
    assert stats["clip_frac_low"] + stats["clip_frac_high"] > 0


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_non_finite_guard_skips_the_step_and_leaves_params_untouched(where):
    """A nan loss (bad rollout log-prob, fp16 overflow) or nan gradient must not reach the weights."""
    model, params = tiny_model()
    perturb_lora(params)
    trajs = trajectories(6)
    if where == "loss":
        trajs[0].sampled_logprobs[-1] = float("nan")
    else:
        params[0].register_hook(lambda g: g * float("nan"))
    before = [p.detach().clone() for p in params]
    stats = step(model, params, grpo.GRPOConfig(), trajs=trajs)
    assert stats["skipped"] and "non-finite" in stats["skip_reason"] and where in stats["skip_reason"]
    assert all(torch.equal(b, p) for b, p in zip(before, params))
    assert all(p.grad is None for p in params)


def test_fp16_grad_scaler_overflow_skips_the_step_and_lowers_the_scale():
    """The T4 path: fp16 autocast + GradScaler. An inf gradient must skip the step (weights untouched)
    and halve the scale, and the next step must go through."""
    model, params = tiny_model()
    perturb_lora(params)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    config = grpo.GRPOConfig(amp_dtype=torch.float16)
    hook = params[0].register_hook(lambda g: g * float("inf"))
    before = [p.detach().clone() for p in params]
    stats = grpo.grpo_step(model, optimizer, trajectories(6), ADVANTAGES, config, scaler)
    assert stats["skipped"] and "non-finite gradient" in stats["skip_reason"] and scaler.get_scale() == 2.0**15
    assert all(torch.equal(b, p) for b, p in zip(before, params))
    hook.remove()
    assert not grpo.grpo_step(model, optimizer, trajectories(6), ADVANTAGES, config, scaler)["skipped"]


def test_stats_are_reported_and_model_mode_restored():
    """Every logged number exists and is finite; the model goes back to eval mode for rollouts."""
    model, params = tiny_model()
    model.eval()
    stats = step(model, params, grpo.GRPOConfig(micro_batch_size=2, gradient_checkpointing=True))
    for key in ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "entropy", "grad_norm"):
        assert math.isfinite(stats[key]), key
    assert stats["entropy"] > 0 and not model.training and stats["tokens"] == sum(
        sum(t.assistant_mask) for t in trajectories(6))


def test_sft_steps_lower_the_loss_on_the_demonstrations():
    """The warm start must fit its demonstrations: the masked NLL falls over a few steps, and
    only LoRA parameters move."""
    model, params = tiny_model()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    demos = trajectories(n=4)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    config = grpo.GRPOConfig(micro_batch_size=2)
    losses = [grpo.sft_step(model, optimizer, demos, config, NO_SCALER)["sft_loss"] for _ in range(8)]
    assert all(b < a for a, b in zip(losses, losses[1:])), f"the loss must fall at every step: {losses}"
    assert losses[-1] < 0.99 * losses[0], losses
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_sft_step_fp16_overflow_skips_the_step_and_lowers_the_scale():
    """The warm start on a T4 takes the same fp16 path as GRPO: an inf gradient skips the step
    and halves the loss scale; the next step goes through and moves the LoRA weights."""
    model, params = tiny_model()
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    config = grpo.GRPOConfig(amp_dtype=torch.float16)
    hook = params[0].register_hook(lambda g: g * float("inf"))
    before = [p.detach().clone() for p in params]
    stats = grpo.sft_step(model, optimizer, trajectories(4), config, scaler)
    assert stats["skipped"] and "non-finite gradient" in stats["skip_reason"] and scaler.get_scale() == 2.0**15
    assert all(torch.equal(b, p) for b, p in zip(before, params))
    hook.remove()
    assert not grpo.sft_step(model, optimizer, trajectories(4), config, scaler)["skipped"]
    assert any(not torch.equal(b, p) for b, p in zip(before, params))


def test_rft_update_takes_as_many_steps_as_grpo_and_one_pass_is_one_sft_step():
    """Rejection sampling steps as often as GRPO: one epoch of one minibatch is one sft_step, bit for
    bit; 2 epochs x 2 minibatches are 4 optimizer steps, each on its part of the correct rollouts,
    every rollout seen once a pass (the parts minibatch_passes gives, as grpo_update's)."""
    results = []
    for update in ("sft_step", "rft_update"):
        model, params = tiny_model()
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        call = grpo.sft_step if update == "sft_step" else grpo.rft_update
        stats = call(model, optimizer, trajectories(4), grpo.GRPOConfig(micro_batch_size=2), NO_SCALER)
        results.append(([p.detach().clone() for p in params], stats))
    (a, stats_a), (b, stats_b) = results
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert stats_b["updates"] == 1 and stats_a["sft_loss"] == stats_b["sft_loss"]

    config = grpo.GRPOConfig(micro_batch_size=2, epochs=2, minibatches=2)
    passes = grpo.minibatch_passes(4, config, seed=3)
    assert len(passes) == 4 and sorted(passes[0] + passes[1]) == sorted(passes[2] + passes[3]) == [0, 1, 2, 3]
    model, params = tiny_model()
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    stats = grpo.rft_update(model, optimizer, trajectories(4), config, NO_SCALER, seed=3)
    assert stats["updates"] == 4 and not stats["skipped"] and stats["sft_loss"] > 0
    assert stats["tokens"] == sum(sum(t.assistant_mask) for t in trajectories(4))
    assert all(optimizer.state[p]["step"] == 4 for p in params)


# ---------------------------------------------------------------- data parallel (train.py under torchrun)
def in_threads(shares, run):
    """Run run(rank, all_reduce) for each share in its own thread, `all_reduce` summing a tensor
    over the threads (in rank order, like a collective) as torch.distributed.all_reduce sums over
    processes; returns the results in rank order. Models are built before: seeding is global."""
    parts, barrier = [None] * len(shares), threading.Barrier(len(shares), timeout=60)

    def all_reduce_for(rank):
        def all_reduce(tensor):
            parts[rank] = tensor.clone()
            barrier.wait()
            total = sum(parts[1:], parts[0].clone())
            barrier.wait()
            tensor.copy_(total)
        return all_reduce

    results = [None] * len(shares)

    def target(rank):
        results[rank] = run(rank, all_reduce_for(rank))

    threads = [threading.Thread(target=target, args=(r,)) for r in range(len(shares))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None for r in results), "a thread failed or hung"
    return results


@pytest.mark.parametrize("aggregation", grpo.AGGREGATIONS)
@pytest.mark.parametrize("split", [2, 5])   # 5: rank 1 holds only the zero-advantage trajectory, so forwards nothing
def test_two_processes_with_the_step_counts_equal_one(aggregation, split):
    """Two processes, each with part of the step's trajectories, the whole step's normalizer counts
    and their gradients summed, take the one-process step: the same loss (summed), the same weights,
    identical on both (SGD, so the weights show the gradient itself). A process with nothing to
    forward still takes part."""
    trajs, config = trajectories(6), grpo.GRPOConfig(micro_batch_size=2, aggregation=aggregation)
    advantages = ADVANTAGES[:4] + [ADVANTAGES[5], ADVANTAGES[4]]       # the zero advantage last
    model, params = tiny_model()
    perturb_lora(params)
    one = grpo.grpo_step(model, torch.optim.SGD(params, lr=0.1), trajs, advantages, config, NO_SCALER)
    counts = grpo.normalizer_counts(trajs, config)
    shares = [(trajs[:split], advantages[:split]), (trajs[split:], advantages[split:])]
    models = [tiny_model() for _ in shares]
    for _, lora_params in models:
        perturb_lora(lora_params)

    def run(rank, all_reduce):
        model, params = models[rank]
        batch, adv = shares[rank]
        stats = grpo.grpo_step(model, torch.optim.SGD(params, lr=0.1), batch, adv, config, NO_SCALER,
                               counts=counts, all_reduce=all_reduce)
        return stats, [p.detach() for p in params]

    (stats0, params0), (stats1, params1) = in_threads(shares, run)
    assert not stats0["skipped"] and stats0["grad_norm"] == stats1["grad_norm"]
    assert stats0["loss"] + stats1["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert stats0["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for a, b, want in zip(params0, params1, params):
        assert torch.equal(a, b), "the processes' weights must stay identical"
        torch.testing.assert_close(a, want.detach(), rtol=1e-5, atol=1e-6)


def test_a_non_finite_loss_in_one_process_skips_the_step_in_all():
    """The processes must take the same decision: one nan loss, and nobody steps."""
    trajs = trajectories(6)
    trajs[3].sampled_logprobs[-1] = float("nan")
    config = grpo.GRPOConfig(micro_batch_size=2)
    counts = grpo.normalizer_counts(trajs, config)
    models = [tiny_model() for _ in range(2)]

    def run(rank, all_reduce):
        model, params = models[rank]
        before = [p.detach().clone() for p in params]
        part = slice(0, 3) if rank == 0 else slice(3, 6)
        stats = grpo.grpo_step(model, torch.optim.AdamW(params, lr=1e-2), trajs[part], ADVANTAGES[part], config,
                               NO_SCALER, counts=counts, all_reduce=all_reduce)
        return stats, all(torch.equal(b, p) for b, p in zip(before, params))

    (stats0, same0), (stats1, same1) = in_threads([0, 1], run)
    assert stats0["skipped"] and stats1["skipped"] and same0 and same1
    assert "another process" in stats0["skip_reason"] and "non-finite loss" in stats1["skip_reason"]
