"""Tests for grpo.py: the math by hand on tiny tensors, the steps on a tiny random Llama (the
model and trajectories of tests/test_forward.py, which tests the forward the steps share).

Run: python -m pytest -q tests/test_grpo.py
"""
import functools
import math
import threading
from types import SimpleNamespace

import pytest
import torch

import agentrl
import forward
import grpo
import lora
import parallel
import report
from test_forward import (ADVANTAGES, NO_SCALER, as_batch, per_token, perturb_lora, step, tiny_model, trajectories,
                          whole_logprobs)


# ---------------------------------------------------------------- advantages
def test_advantages_are_group_normalized():
    """GRPO: reward minus group mean over group std (n - 1); Dr. GRPO: no std division; an
    all-equal group: zeros (no signal)."""
    assert grpo.normalized([1.0, 2.0, 3.0]) == pytest.approx([-1.0, 0.0, 1.0])
    assert grpo.normalized([0.0, 1.0]) == pytest.approx([-math.sqrt(0.5), math.sqrt(0.5)])
    assert grpo.normalized([1.0, 2.0, 4.0], scale_by_std=False) == pytest.approx([-4 / 3, -1 / 3, 5 / 3])
    assert grpo.normalized([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]


def episode(turns, stop_reason="submitted"):
    """A trajectory whose prompt is tokens [1, 2] and whose turns are the runs in `turns` (each a
    sampled call, mask 1, then the tool's answer, mask 0), recorded as the engine records them."""
    tokens, mask, messages, starts = [1, 2], [0, 0], [{"role": "user", "content": "q"}], []
    for call, answer in turns:
        starts.append((len(tokens), len(messages)))
        tokens, mask = tokens + call + answer, mask + [1] * len(call) + [0] * len(answer)
        messages += [{"role": "assistant", "content": str(call)}, {"role": "tool", "content": str(answer)}]
    return agentrl.Trajectory("t", messages, tokens, mask, [0.0] * len(tokens), None, False, stop_reason,
                              len(turns), len(turns), 0, turns=starts)


def test_make_batch_drops_non_finite_rows_before_the_baseline_and_counts_each_kind():
    """Rows cut on non-finite logits leave their group before the mean is taken (advantage None); a
    group left with one row is too small; an all-equal group has no signal; each is counted, and
    only the trainable groups' trajectories carry advantages, one float a token."""
    def group(*stops):
        return agentrl.make_group(None, [episode([([3], [4])], s) for s in stops])

    ok, bad = "submitted", "non_finite_logits"
    rewards = [[1.0, 0.0, 5.0], [1.0, 0.0], [1.0, 1.0], [0.0, 2.0]]   # the 5.0 must not move the baseline
    groups = [group(ok, ok, bad), group(ok, bad), group(ok, ok), group(ok, ok)]
    batch, counts = grpo.make_batch(groups, rewards, functools.partial(grpo.grpo_advantages, scale_by_std=False))
    assert batch.groups == groups
    assert [[a and a[0] for a in advantages] for advantages in batch.advantages] == [
        [0.5, -0.5, None], [None, None], [None, None], [-1.0, 1.0]]
    assert all(a is None or a == [a[0]] * len(t.token_ids) for g, advantages in zip(groups, batch.advantages)
               for t, a in zip(g.trajectories, advantages))
    assert counts == {"groups": 4, "trainable_groups": 2, "no_signal_groups": 1, "too_small_groups": 1,
                      "non_finite_trajectories": 2}
    assert (batch.num_sequences, batch.num_tokens, batch.max_tokens) == (4, 4, 1)   # one sampled token each


def test_step_credit_gives_each_turn_its_episode_and_step_advantage():
    """--step-credit w: every token of turn k gets A^E + w * A^S(k), A^S read off the group's tree at
    the state the turn starts from (the docstring's group of four, without std scaling); a state
    one trajectory reaches gives 0; the copied prompt keeps A^E (mask 0: never trained)."""
    listing, describe = ([10, 11], [50]), ([12], [51, 52])
    group = agentrl.make_group(None, [episode([listing, describe, ([20], [60])]),     # r = 1
                                      episode([listing, describe, ([21, 22], [61])]),  # r = 0
                                      episode([listing, ([23], [62])]),                # r = 1
                                      episode([([24, 25, 26], [63])])])                # r = 0
    rewards = [1.0, 0.0, 1.0, 0.0]
    plain = grpo.grpo_advantages(group, rewards, scale_by_std=False)
    assert [a[0] for a in plain] == [0.5, -0.5, 0.5, -0.5]
    advantages = grpo.step_credit_advantages(group, rewards, weight=0.5, scale_by_std=False)
    step = {0: [0.5, 1 / 3, 0.5], 1: [-0.5, -2 / 3, -0.5], 2: [0.5, 1 / 3], 3: [-0.5]}
    for i, (t, a) in enumerate(zip(group.trajectories, advantages)):
        episode_advantage = [0.5, -0.5, 0.5, -0.5][i]
        bounds = [s for s, _ in t.turns] + [len(t.token_ids)]
        expected = [episode_advantage] * bounds[0] + [episode_advantage + 0.5 * step[i][k]
                                                      for k in range(len(bounds) - 1)
                                                      for _ in range(bounds[k + 1] - bounds[k])]
        assert a == pytest.approx(expected)


def test_shared_states_count_where_step_credit_compares_turns():
    """report.shared_states: the states past the prompt two or more trajectories take a turn from,
    their sizes, and the share of later turns taken from one; two identical trajectories ending at
    one leaf share a state they take no turn from, which does not count."""
    listing, describe = ([10, 11], [50]), ([12], [51, 52])
    group = agentrl.make_group(None, [episode([listing, describe, ([20], [60])]), episode([listing, describe, ([21], [61])]),
                                      episode([listing, ([23], [62])]), episode([([24, 25, 26], [63])])])
    assert report.shared_states([group]) == ([3, 2], 5, 5)   # later turns: 2 + 2 + 1 + 0, all from a shared state
    twins = agentrl.make_group(None, [episode([listing, ([20], [60])]), episode([listing, ([20], [60])]),
                                      episode([([24], [63])])])
    assert report.shared_states([twins]) == ([2], 2, 2)


def test_step_credit_pushes_the_worse_branch_down_where_the_episode_advantage_cannot():
    """A scripted policy with known pass rates: in a group of 8, four rows fail their first call
    (r = 0); four list the tables, then describe the right table (passes 90%) or a wrong one (40%).
    The wrong describe still beats the group's mean, so GRPO's A^E pushes it up; at the state after
    list_tables, A^S compares it with the right describe alone, and pushes it down."""
    import random
    rng = random.Random(0)
    credit = {"right": [], "wrong": []}                  # (A^E, A^S) of each describe turn
    for _ in range(400):
        trajectories, rewards, branches = [], [], []
        for row in range(8):
            if row < 4:
                trajectories.append(episode([([30 + row], [70])]))
                rewards.append(0.0)
                continue
            branch = rng.choice(["right", "wrong"])
            describe = ([12], [51]) if branch == "right" else ([13], [52])
            trajectories.append(episode([([10, 11], [50]), describe, ([20 + row], [60])]))
            rewards.append(float(rng.random() < (0.9 if branch == "right" else 0.4)))
            branches.append(branch)
        group = agentrl.make_group(None, trajectories)
        episode_advantages = grpo.normalized(rewards, scale_by_std=False)
        steps = grpo.step_advantages(group.tree, rewards, scale_by_std=False)
        for branch, a, s in zip(branches, episode_advantages[4:], steps[4:]):
            credit[branch].append((a, s[1]))              # s[1]: the describe turn, from the listed state
    (right_e, right_s), (wrong_e, wrong_s) = ([sum(c) / len(pairs) for c in zip(*pairs)]
                                              for pairs in (credit["right"], credit["wrong"]))
    # expected for a listed row i, the other three passing 0.65 on average: A^E = r_i - mean of 8 =
    # 7/8 E[r_i] - 3/8 0.65: right +0.54, wrong +0.11; A^S = r_i - mean of the 4 listed =
    # 3/4 E[r_i] - 3/4 0.65: right +0.19, wrong -0.19
    assert wrong_e > 0.05 and wrong_s < -0.1 < 0.1 < right_s
    assert right_e + right_s - (wrong_e + wrong_s) > 1.5 * (right_e - wrong_e)   # expected 0.81 vs 0.65


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
    return logprobs, old, torch.tensor([[1.0] * 4, [-1.0] * 4]), mask


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
    loss, stats = grpo.policy_loss(logprobs, old, torch.full((1, 2), adv), torch.tensor([[0.0, 1.0]]))
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


# ---------------------------------------------------------------- one step
@pytest.mark.parametrize("aggregation", grpo.AGGREGATIONS)
def test_micro_batch_accumulation_equals_one_big_batch(aggregation):
    """With step-wide normalizers, micro-batches of 1, 2 or 6 (zero-advantage trajectory skipped) give
    the update of policy_loss on all 6 trajectories at once."""
    model, params = tiny_model()
    perturb_lora(params)
    trajs = trajectories(6)
    b = forward.collate(trajs, per_token(trajs, ADVANTAGES), torch.device("cpu"))
    model.train()
    logps = whole_logprobs(model, trajs)
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


def test_trajectories_without_signal_are_not_forwarded_unless_kl():
    """A = 0 or no trained token: no gradient without KL, so no forward; with KL, A = 0 still pulls."""
    model, params = tiny_model()
    trajs = trajectories(6)
    trajs[1].assistant_mask = [0] * len(trajs[1].token_ids)  # cut off before sampling anything
    trajs[1].sampled_logprobs = [0.0] * len(trajs[1].token_ids)
    assert step(model, params, grpo.GRPOConfig(), trajs=trajs)["forwarded_sequences"] == 4
    stats = step(model, params, grpo.GRPOConfig(kl_coef=0.1), trajs=trajs,
                 reference=lora.lora_disabled(model))
    assert stats["forwarded_sequences"] == 5


def test_an_advantage_a_trajectory_instead_of_a_token_is_a_clear_error():
    """A fork's estimator that gives one float a trajectory, not one a token, stops the update with
    a message that says so, before any forward, not with a shape error inside torch."""
    model, params = tiny_model()
    trajs = trajectories(2)
    masks = [sum(t.assistant_mask) for t in trajs]
    batch = grpo.Batch([agentrl.make_group(None, trajs)], [[[1.0], [-1.0]]], 2, sum(masks), max(masks))
    with pytest.raises(AssertionError, match="one a token"):
        grpo.grpo_step(model, torch.optim.SGD(params, lr=0.1), batch, grpo.GRPOConfig(), NO_SCALER)


def test_one_step_changes_lora_params_and_only_them():
    """AdamW on the LoRA parameters moves them; the frozen base model stays bit-identical."""
    model, params = tiny_model()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    stats = grpo.grpo_step(model, optimizer, as_batch(trajectories(6), ADVANTAGES), grpo.GRPOConfig(micro_batch_size=4), NO_SCALER)
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
            lp = whole_logprobs(model, [t])[0].tolist()
        return [v * m for v, m in zip(lp, t.assistant_mask)]

    for t in trajs:  # on-policy: the "sampled" log-probs are the current policy's
        t.sampled_logprobs = masked_logprobs(t)
    before = [sum(t.sampled_logprobs) for t in trajs]
    grpo.grpo_step(model, torch.optim.SGD(params, lr=1e-2), as_batch(trajs, [1.0, -1.0]), grpo.GRPOConfig(), NO_SCALER)
    after = [sum(masked_logprobs(t)) for t in trajs]
    assert after[0] > before[0] and after[1] < before[1], (before, after)


def test_kl_is_zero_while_the_adapter_is_a_no_op_then_positive():
    """With B = 0 the policy is the base model, so KL(policy || LoRA-off) is exactly 0; after a step it is not."""
    model, params = tiny_model()
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    config = grpo.GRPOConfig(kl_coef=0.1)
    first, second = (grpo.grpo_step(model, optimizer, as_batch(trajectories(6), ADVANTAGES), config, NO_SCALER,
                                    reference=lora.lora_disabled(model)) for _ in range(2))
    assert first["kl"] == 0.0 and second["kl"] > 0


def test_fresh_rollouts_give_ratio_one_and_a_moved_policy_is_clipped():
    """On fresh rollouts (recorded log-probs = the policy's own) a step sees ratio 1 and clips
    nothing; on rollouts a far-moved policy sampled, kl_old > 0 and the clip acts on some tokens."""
    model, params = tiny_model()
    perturb_lora(params)
    trajs = trajectories(6, seed=5)
    with torch.no_grad():
        fresh = whole_logprobs(model.eval(), trajs)
    for t, row in zip(trajs, fresh):
        t.sampled_logprobs = [lp * m for lp, m in zip(row[:len(t.token_ids)].tolist(), t.assistant_mask)]
    first = grpo.grpo_step(model, torch.optim.AdamW(params, lr=5e-2), as_batch(trajs, ADVANTAGES), grpo.GRPOConfig(),
                           NO_SCALER)
    assert first["kl_old"] < 1e-5 and first["clip_frac_low"] + first["clip_frac_high"] == 0
    model, params = tiny_model()
    perturb_lora(params, seed=7)            # another policy: the one that "sampled" is far from it
    stats = grpo.grpo_step(model, torch.optim.AdamW(params, lr=5e-2), as_batch(trajs, ADVANTAGES), grpo.GRPOConfig(),
                           NO_SCALER)
    assert stats["kl_old"] > 1e-3 and stats["clip_frac_low"] + stats["clip_frac_high"] > 0


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
    stats = grpo.grpo_step(model, optimizer, as_batch(trajectories(6), ADVANTAGES), config, scaler)
    assert stats["skipped"] and "non-finite gradient" in stats["skip_reason"] and scaler.get_scale() == 2.0**15
    assert all(torch.equal(b, p) for b, p in zip(before, params))
    hook.remove()
    assert not grpo.grpo_step(model, optimizer, as_batch(trajectories(6), ADVANTAGES), config, scaler)["skipped"]


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
    one = grpo.grpo_step(model, torch.optim.SGD(params, lr=0.1), as_batch(trajs, advantages), config, NO_SCALER)
    shares = [as_batch(trajs[:split], advantages[:split], step=trajs), as_batch(trajs[split:], advantages[split:], step=trajs)]
    models = [tiny_model() for _ in shares]
    for _, lora_params in models:
        perturb_lora(lora_params)

    def run(rank, all_reduce):
        model, params = models[rank]
        stats = grpo.grpo_step(model, torch.optim.SGD(params, lr=0.1), shares[rank], config, NO_SCALER,
                               sum_processes=functools.partial(parallel.sum_gradients, all_reduce=all_reduce))
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
    models = [tiny_model() for _ in range(2)]

    def run(rank, all_reduce):
        model, params = models[rank]
        before = [p.detach().clone() for p in params]
        part = slice(0, 3) if rank == 0 else slice(3, 6)
        stats = grpo.grpo_step(model, torch.optim.AdamW(params, lr=1e-2), as_batch(trajs[part], ADVANTAGES[part], step=trajs),
                               config, NO_SCALER, sum_processes=functools.partial(parallel.sum_gradients, all_reduce=all_reduce))
        return stats, all(torch.equal(b, p) for b, p in zip(before, params))

    (stats0, same0), (stats1, same1) = in_threads([0, 1], run)
    assert stats0["skipped"] and stats1["skipped"] and same0 and same1
    assert "another process" in stats0["skip_reason"] and "non-finite loss" in stats1["skip_reason"]
