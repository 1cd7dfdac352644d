"""The fingerprint: a refactor must not change what the code computes.

On a fixed seed and a tiny random model, a sampled rollout gives the same tokens, and one GRPO
update and one SFT step give the same loss, gradient norm and update, as at the commit the
expected values were recorded from (EXPECTED says which, and why they last changed). A failure
here means behaviour changed: find out why before touching the numbers.

Tolerances follow from fp32 and the reductions, not from one CPU: a loss or a gradient sums
about a thousand fp32 terms, and kernels (AVX2, AVX-512, AMX) add them in other orders, which
moves the sum by up to n * 2**-24 of its terms' size, about 1e-4 relative for n = 1,000 in the
worst case (1e-6 typical). The update is plain SGD, so it is the gradient times the learning
rate, and takes the gradient's tolerance (AdamW's first step, g / (|g| + eps), would turn a
last-digit change of a near-zero gradient into a change of lr).
"""
import hashlib
import json
from functools import partial

import pytest
import torch

import agentrl
import engine
import grpo
import lora
import report
from bench.common import scripted_policy
from conftest import build_tiny_model

LIMITS = agentrl.Limits(max_turns=3, max_new_tokens=96, max_context=2048)
N = 4


RTOL = 1e-4      # the module docstring says why


def update_fingerprint(params, before):
    """(sum, sum of squares) of every LoRA parameter's change in the step, in float64."""
    deltas = [p.detach().double() - b.double() for p, b in zip(params, before)]
    return sum(d.sum().item() for d in deltas), sum(d.pow(2).sum().item() for d in deltas)


def token_hash(groups):
    tokens = [t.token_ids for g in groups for t in g.trajectories]
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def rollout(splits, smol_tokenizer):
    """Two train tasks, four sampled rows each; two rows scripted through tool calls (scripted_policy),
    so the groups hold multi-turn trajectories with tool results (mask 0) between sampled turns."""
    tasks = splits["train"][:2]
    torch.manual_seed(0)
    model = build_tiny_model("llama", seed=0)
    lora.apply_lora(model, r=4, alpha=8, targets=("q_proj", "v_proj"))
    list_tables = agentrl.tool_call_text("list_tables", {})
    scripted = [[list_tables, agentrl.tool_call_text("submit_answer", {"query": tasks[0].gold_sql})],
                [list_tables]] + [[]] * (2 * N - 2)
    with scripted_policy(scripted):
        groups = engine.rollout_groups(model, smol_tokenizer, tasks, N, engine.Sampling(seed=0), LIMITS)
    return model, groups


def test_sampled_rollouts_give_the_recorded_tokens(rollout):
    """Sampling, tool turns and the cache reuse: the same tokens as recorded."""
    _, groups = rollout
    assert [t.stop_reason for g in groups for t in g.trajectories][:2] == ["submitted", "max_new_tokens"]
    assert token_hash(groups) == EXPECTED["rollout_tokens"]


def grpo_update(model, batch):
    """One GRPO step on `batch` from the fixture's adapter, perturbed the same way every time, which it
    restores after: (stats, update_fingerprint)."""
    params = lora.lora_parameters(model)
    initial = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    before = [p.detach().clone() for p in params]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    config = grpo.GRPOConfig(micro_batch_size=4, gradient_checkpointing=True, max_grad_norm=1e9,
                             max_tokens=LIMITS.max_turns * LIMITS.max_new_tokens)
    stats = grpo.grpo_step(model, torch.optim.SGD(params, lr=1e-2), batch, config, scaler)
    after = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, p0 in zip(params, initial):
            p.copy_(p0)
    return stats, update_fingerprint(after, before)


REWARDS = [[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2]]


@pytest.mark.parametrize("step_credit", [0.0, 1.0])
def test_one_grpo_update_gives_the_recorded_loss_gradient_and_adapter(rollout, step_credit):
    """One GRPO step on those groups (scripted rewards, each group's tree forwarded once); w = 0 is
    GRPO, w = 1 adds the step advantage at the state rows 0 and 1 share (after list_tables)."""
    model, groups = rollout
    estimator = partial(grpo.step_credit_advantages, weight=step_credit) if step_credit else grpo.grpo_advantages
    batch, counts = grpo.make_batch(groups, REWARDS, estimator)
    assert counts["trainable_groups"] == 2 and len(report.shared_states(groups)[0]) == 1
    stats, fingerprint = grpo_update(model, batch)
    assert not stats["skipped"]
    expected = EXPECTED["grpo" if step_credit == 0 else "grpo_step_credit"]
    assert stats["loss"] == pytest.approx(expected["loss"], rel=RTOL, abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(expected["grad_norm"], rel=RTOL)
    assert fingerprint == pytest.approx(expected["update"], rel=RTOL)


def test_one_sft_step_gives_the_recorded_loss_gradient_and_adapter(splits, smol_tokenizer):
    """One warm-start step on two gold demonstrations (the default `look` kind)."""
    model = build_tiny_model("llama", seed=0)
    torch.manual_seed(0)
    params = lora.apply_lora(model, r=4, alpha=8, targets=("q_proj", "v_proj"))
    limits = agentrl.Limits(max_turns=4, max_new_tokens=128, max_context=2048)
    demos = [agentrl.demonstration(smol_tokenizer, task, limits) for task in splits["train"][:2]]
    before = [p.detach().clone() for p in params]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    config = grpo.GRPOConfig(micro_batch_size=2, gradient_checkpointing=True, max_grad_norm=1e9)
    stats = grpo.sft_step(model, torch.optim.SGD(params, lr=1e-3), demos, config, scaler)
    assert not stats["skipped"]
    expected = EXPECTED["sft"]
    assert stats["sft_loss"] == pytest.approx(expected["loss"], rel=RTOL)
    assert stats["grad_norm"] == pytest.approx(expected["grad_norm"], rel=RTOL)
    assert update_fingerprint(params, before) == pytest.approx(expected["update"], rel=RTOL)


EXPECTED = {   # the tokens, losses and gradient norms recorded at levers-v1 (d6ae198), which the tree-packed
               # forward still gives; the SGD updates recorded at "The group is a tree", which made them SGD
    "rollout_tokens": "edf825bc143bee50",
    "grpo": {"loss": 0.17016447614878416, "grad_norm": 0.3739856779575348,
             "update": (0.003313128753688943, 1.3986523338142919e-05)},
    "grpo_step_credit": {"loss": 0.35725995898246765, "grad_norm": 0.7338762283325195,   # recorded when
             "update": (0.006720302738358441, 5.385746214426073e-05)},   # step credit (--step-credit) came
    "sft": {"loss": 12.099386215209961, "grad_norm": 0.6502889394760132,
            "update": (0.0015856163757727373, 4.228756238143175e-07)},
}
