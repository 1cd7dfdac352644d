"""The reference cut's fingerprint: a refactor must not change what the code computes.

On a fixed seed and a tiny random model, a sampled rollout gives the same tokens, and one GRPO
update and one SFT step give the same loss, gradient norm and adapter values, as at the commit
the expected values were recorded from (levers-v1, d6ae198, before the cut moved any code).
A failure here means behaviour changed: find out why before touching the numbers.
"""
import hashlib
import json

import pytest
import torch

import agentrl
import grpo
import lora
from conftest import build_tiny_model

LIMITS = agentrl.Limits(max_turns=3, max_new_tokens=96, max_context=2048)
N = 4


def adapter_fingerprint(model):
    """(sum, sum of squares) over every LoRA parameter, in float64."""
    params = lora.lora_parameters(model)
    return (sum(p.detach().double().sum().item() for p in params),
            sum(p.detach().double().pow(2).sum().item() for p in params))


def token_hash(groups):
    tokens = [t.token_ids for g in groups for t in g.trajectories]
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def rollout(splits, smol_tokenizer):
    """Two train tasks, four sampled rows each; two rows forced through tool calls, so the groups
    hold multi-turn trajectories with tool results (mask 0) between sampled turns."""
    tasks = splits["train"][:2]
    torch.manual_seed(0)
    model = build_tiny_model("llama", seed=0)
    lora.apply_lora(model, r=4, alpha=8, targets=("q_proj", "v_proj"))
    list_tables = agentrl.tool_call_text("list_tables", {})
    forced = [[list_tables, agentrl.tool_call_text("submit_answer", {"query": tasks[0].gold_sql})],
              [list_tables]] + [[]] * (2 * N - 2)
    groups = agentrl.rollout_groups(model, smol_tokenizer, tasks, N, agentrl.Sampling(seed=0, draft=2), LIMITS,
                                    forced_turns=forced)
    return model, groups


def test_sampled_rollouts_give_the_recorded_tokens(rollout):
    """Sampling, drafts, tool turns and the cache reuse: the same tokens as before the cut."""
    _, groups = rollout
    assert [t.stop_reason for g in groups for t in g.trajectories][:2] == ["submitted", "max_new_tokens"]
    assert token_hash(groups) == EXPECTED["rollout_tokens"]


def test_one_grpo_update_gives_the_recorded_loss_gradient_and_adapter(rollout):
    """One GRPO update on those groups (scripted rewards, group segments and the shared prompt on)."""
    model, groups = rollout
    params = lora.lora_parameters(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    rewards = [[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2]]
    batch, advantages, counts = grpo.batch_from_groups(groups, rewards)
    assert counts["trainable_groups"] == 2
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    config = grpo.GRPOConfig(micro_batch_size=2, gradient_checkpointing=True, max_tokens=LIMITS.max_turns * LIMITS.max_new_tokens)
    stats = grpo.grpo_update(model, optimizer, batch, advantages, config, scaler, seed=3)
    assert not stats["skipped"]
    expected = EXPECTED["grpo"]
    assert stats["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    assert adapter_fingerprint(model) == pytest.approx(expected["adapter"], rel=1e-5)


def test_one_sft_step_gives_the_recorded_loss_gradient_and_adapter(splits, smol_tokenizer):
    """One warm-start step on two gold demonstrations (the default `look` kind)."""
    model = build_tiny_model("llama", seed=0)
    torch.manual_seed(0)
    params = lora.apply_lora(model, r=4, alpha=8, targets=("q_proj", "v_proj"))
    limits = agentrl.Limits(max_turns=4, max_new_tokens=128, max_context=2048)
    demos = [agentrl.demonstration(smol_tokenizer, task, limits) for task in splits["train"][:2]]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    stats = grpo.sft_step(model, optimizer, demos, grpo.GRPOConfig(micro_batch_size=1, gradient_checkpointing=True),
                          scaler)
    assert not stats["skipped"]
    expected = EXPECTED["sft"]
    assert stats["sft_loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert stats["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    assert adapter_fingerprint(model) == pytest.approx(expected["adapter"], rel=1e-5)


EXPECTED = {   # recorded at levers-v1 (d6ae198) by running the tests above there
    "rollout_tokens": "edf825bc143bee50",
    "grpo": {"loss": 0.17016447614878416, "grad_norm": 0.3739856779575348,
             "adapter": (4.602697195019573, 10.068966220287292)},
    "sft": {"loss": 12.099386215209961, "grad_norm": 0.6502889394760132,
            "adapter": (0.2678501205518842, 5.377727010069265)},
}
