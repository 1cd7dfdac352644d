"""The learning rule: GRPO on a LoRA, written as small pure functions.

    batch, counts = batch_from_groups(groups, rewards)             # 1) better or worse than the group?
    batch, counts = batch_from_groups(groups, rewards, step_credit=1.0)  #  and each turn than its state's?
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)       #    (disabled: a pass-through)
    stats = grpo_step(model, optimizer, batch, GRPOConfig(), scaler,  # 2) one optimizer step
                      reference_context=lora.lora_disabled(model))

GRPO (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300) drops PPO's value network: the n
trajectories of a group answer the same task, so the group mean reward is the baseline, and
every trained token of a trajectory shares its advantage. Step credit (GiGPO, step_advantages)
adds to each turn's tokens a second advantage, taken among the trajectories that reached the
state the turn starts from: the group's tree knows those states exactly. The update is PPO's clipped surrogate
on those advantages, token by token, over the tokens the model sampled (prompts and tool
results carry mask 0). One step (grpo_step): each group's tree is forwarded once
(forward.tree_logprobs), policy_loss gives its loss, normalized over the whole step, and its
backward adds into the gradient; the gradient norm is clipped and the optimizer steps. A
non-finite loss or gradient skips the step. Beside it, the control GRPO is measured against:
sft_step on a step's correct rollouts (rejection-sampling fine-tuning).

Simplifications, and why they are safe:
- The PPO "old" policy is the rollout policy itself (its `sampled_logprobs`): no extra forward.
  With one optimizer step per batch the ratio is 1 up to the numerical gap between the
  KV-cached sampler and this forward, and the clip has little to do (clip_frac_*, kl_old say
  how much). Several steps on one batch were measured to collapse the policy (RESULTS.md).
- The KL reference is a context manager under which the model is the reference
  (lora.lora_weights: the adapter RL started from; lora.lora_disabled: the base model): no
  second model in memory.
- Entropy is the mean of -log p(sampled token) over trained tokens, read from the rollouts: the
  policy's entropy in expectation at temperature 1, a trend indicator otherwise.

Letters in shape comments: B sequences in a micro-batch, T tokens (right-padded).
"""
import math
from dataclasses import dataclass

import torch

import agentrl
import forward

AGGREGATIONS = ("token", "sequence", "constant")


@dataclass
class GRPOConfig:
    micro_batch_size: int = 8         # a group's trajectories per forward (their tree once); gradients add up
    chunk_size: int | None = 512      # positions per lm_head chunk (forward.tree_logprobs); None: all at once
    clip_low: float = 0.2             # PPO epsilon below ratio 1 (Schulman et al. 2017)
    clip_high: float = 0.28           # above ratio 1: DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476)
    aggregation: str = "token"        # "token" (DAPO), "sequence" (GRPO), "constant" (Dr. GRPO): policy_loss
    max_tokens: int | None = None     # Dr. GRPO's constant, the generation budget; None = the step's longest
    kl_coef: float = 0.0              # beta of the k3 KL to the reference policy; 0: none, no forward (DAPO)
    max_grad_norm: float = 1.0        # global gradient-norm clip
    gradient_checkpointing: bool = False  # recompute layers in the backward: less memory, more time
    amp_dtype: torch.dtype | None = None  # autocast dtype (float16 + GradScaler on a T4); None: the weights'


# ---------------------------------------------------------------- 1) advantages
def group_advantages(rewards, scale_by_std=True, eps=1e-6):
    """Per-trajectory advantages from per-group rewards: A_i = (r_i - mean(r)) / std(r).

    rewards: one list of floats per group, or None for a group without rewards. Returns
    (advantages, counts): advantages[g] is one float per trajectory, or None for a group without
    signal: unscored, or zero variance (every advantage would be 0); counts counts each kind.
    std is the sample std (n - 1), as TRL's. scale_by_std=False is Dr. GRPO (Liu et al. 2025,
    arXiv:2503.20783): the std up-weights groups nearly all right or all wrong, a difficulty bias.

    Four trajectories of one task, two right (reward 1) and two wrong (0): the mean is 0.5, the
    sample std is sqrt(4 * 0.25 / 3) = 0.577, so the advantages are +-0.5 / 0.577 = +-0.866.
    A second group, all right, carries no signal:

    >>> advantages, counts = group_advantages([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    >>> [round(a, 3) for a in advantages[0]], advantages[1], counts["zero_variance_groups"]
    ([0.866, -0.866, 0.866, -0.866], None, 1)
    >>> group_advantages([[1.0, 0.0, 1.0, 0.0]], scale_by_std=False)[0][0]     # Dr. GRPO
    [0.5, -0.5, 0.5, -0.5]
    """
    advantages = []
    counts = {"groups": len(rewards), "trainable_groups": 0, "zero_variance_groups": 0, "unscored_groups": 0}
    for group in rewards:
        if group is None:
            counts["unscored_groups"] += 1
            advantages.append(None)
            continue
        assert len(group) >= 2, f"a group needs at least 2 trajectories to have a baseline, got {len(group)}"
        r = torch.tensor(group, dtype=torch.float64)  # (n,)
        assert torch.isfinite(r).all(), f"non-finite reward in group {group}"
        std = r.std()
        if std <= eps:
            counts["zero_variance_groups"] += 1
            advantages.append(None)
            continue
        a = r - r.mean()  # GRPO: the group mean is the baseline
        if scale_by_std:
            a = a / std
        counts["trainable_groups"] += 1
        advantages.append(a.tolist())
    return advantages, counts


def step_advantages(tree, returns, scale_by_std=True):
    """Per-turn step advantages read off a group's tree (GiGPO's A^S, Feng et al. 2025, arXiv:2505.10978):
    returns (steps, anchors). A node's end is a state (the same tokens up to the start of an
    assistant turn: the same calls, the same tool results) and its children the turns taken from
    it. At a state two or more trajectories share, each one's step advantage for the turn it takes
    there is its return minus the mean return through the state (over their std unless
    scale_by_std=False); at a state seen once it is 0. returns: one float per trajectory, None for
    one left out. steps[i]: one float per turn of trajectory i; anchors: the sizes of the shared
    states past the prompt that a turn is taken from. The return is the episode's reward,
    undiscounted: the reward comes once, at the end, and a discount would favour short episodes,
    which correctness does not ask for.
    The prompt is a state every trajectory shares, so the first turn's A^S is GRPO's A^E.

    Four trajectories, rewards 1, 0, 1, 0 (no std scaling): all four share the prompt (mean 0.5),
    three of them the state after list_tables (mean 2/3), two the state after describe (0.5):

        prompt {0,1,2,3} -> list_tables {0,1,2} -> describe {0,1} -> submit A {0}    r = 1
                                                                  -> submit B {1}    r = 0
                                                -> submit C {2}                      r = 1
                         -> submit D {3}                                             r = 0

    >>> from tree import build_tree
    >>> turns = {0: ["list", "describe", "A"], 1: ["list", "describe", "B"], 2: ["list", "C"], 3: ["D"]}
    >>> paths = [[(0, [0], [])] + [(0, [], [{"content": c}]) for c in turns[i]] for i in range(4)]
    >>> steps, anchors = step_advantages(build_tree(paths), [1.0, 0.0, 1.0, 0.0], scale_by_std=False)
    >>> [[round(a, 3) for a in s] for s in steps], anchors
    ([[0.5, 0.333, 0.5], [-0.5, -0.667, -0.5], [0.5, 0.333], [-0.5]], [3, 2])
    """
    steps, anchors = {i: [] for i in range(len(returns))}, []

    def visit(state, past_prompt):
        through = [i for i in state.rows if returns[i] is not None]
        # the group's rule among the trajectories through the state (None: seen once, or all equal)
        [a], _ = group_advantages([[returns[i] for i in through] if len(through) >= 2 else None],
                                  scale_by_std)
        anchors.extend([len(through)] * (past_prompt and len(through) >= 2 and bool(state.children)))
        advantage = dict(zip(through, a or []))
        for turn in state.children:
            for i in turn.rows:
                steps[i].append(advantage.get(i, 0.0))
            visit(turn, True)

    for prompt in tree.children:
        visit(prompt, False)
    return [steps[i] for i in range(len(returns))], anchors


def batch_from_groups(groups, rewards, scale_by_std=True, step_credit=0.0):
    """From a step's groups and their rewards to what grpo_step takes: (batch, counts).

    groups: agentrl.TrajectoryGroup; rewards: one list per group. batch: [(group, advantages)] for
    the groups with signal; advantages[i] is trajectory i's A^E (one float every token shares), or,
    with step_credit w != 0, one float per token: A^E + w * A^S on each turn's tokens
    (step_advantages); None for a trajectory left out. A trajectory cut on non-finite logits (fp16
    overflow) is a numeric failure, not an outcome of the policy: it leaves its group before the
    baseline is taken (a group left with under 2 is unscored). counts: group_advantages' +
    non_finite_trajectories; the anchor states of the trained groups (step_advantages) and the
    trajectories through them; their trained tokens past the first turn (whose A^S is A^E), and
    those whose step advantage is not 0.
    """
    assert len(groups) == len(rewards), "one list of rewards per group"
    kept = [[i for i, t in enumerate(g.trajectories) if t.stop_reason != "non_finite_logits"] for g in groups]
    kept_rewards = [[rs[i] for i in ks] if len(ks) >= 2 else None for rs, ks in zip(rewards, kept)]
    advantages, counts = group_advantages(kept_rewards, scale_by_std=scale_by_std)
    batch, anchors, tokens, credited = [], [], 0, 0
    for group, ks, rs, adv in zip(groups, kept, rewards, advantages):
        if adv is None:
            continue
        episode = dict(zip(ks, adv))
        steps, sizes = step_advantages(group.tree, [rs[i] if i in episode else None
                                                    for i in range(len(rs))], scale_by_std)
        anchors += sizes
        per_token = []
        for i, t in enumerate(group.trajectories):
            bounds = [start for start, _ in t.turns] + [len(t.token_ids)]   # turn k: bounds[k]:bounds[k+1]
            step = [0.0] * bounds[0] + [a for k, a in enumerate(steps[i])
                                        for _ in range(bounds[k + 1] - bounds[k])]
            assert len(steps[i]) == len(t.turns) and len(step) == len(t.token_ids), "a value a turn, a token"
            later = bounds[min(1, len(bounds) - 1)]   # where the second turn starts (the first's A^S is A^E)
            if i in episode:
                tokens += sum(t.assistant_mask[later:])
                credited += sum(m and a != 0 for m, a in zip(t.assistant_mask[later:], step[later:]))
            per_token.append(None if i not in episode else [episode[i] + step_credit * a for a in step]
                             if step_credit else episode[i])
        batch.append((group, per_token))
    counts["non_finite_trajectories"] = sum(len(g.trajectories) - len(ks) for g, ks in zip(groups, kept))
    counts.update(anchor_states=len(anchors), anchor_trajectories=sum(anchors), credited_tokens=credited,
                  trained_tokens=tokens)
    return batch, counts


# ---------------------------------------------------------------- 2) the loss
def masked_mean(x, mask):
    """The mean of x over the positions where mask is 1 (0 where there are none)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.28,
                aggregation="token", num_sequences=None, num_tokens=None, max_tokens=None,
                kl_coef=0.0, ref_logprobs=None):
    """Clipped policy-gradient loss over the trained tokens of a batch; returns (loss, stats).

    logprobs (B, T) current policy (with grad); old_logprobs (B, T) rollout policy; advantages
    (B,), one a trajectory, or (B, T), one a token (step credit); mask (B, T) 1 on trained tokens;
    ref_logprobs (B, T) reference policy, for the KL.
    num_sequences / num_tokens: the WHOLE step's counts (default: this batch's), so micro-batch
    losses and gradients add up to the step's. stats: means over the trained tokens.

    Four trajectories of one trained token each, advantages +1, +1, -1, -1, and a policy that has
    moved since the rollout: ratios pi/pi_old of 1, 1.5, 1 and 0.5. Per token, -min(r A, clip(r) A)
    with clip to [0.8, 1.28] gives -1, -1.28 (clipped: 1.5 A would push further), +1, and +0.8
    (clipped: 0.5 < 0.8 with A < 0). The token mean is (-1 - 1.28 + 1 + 0.8) / 4 = -0.12:

    >>> old = torch.zeros(4, 1)                                       # log pi_old of each token
    >>> new = torch.tensor([[1.0], [1.5], [1.0], [0.5]]).log()         # log pi: ratios 1, 1.5, 1, 0.5
    >>> loss, stats = policy_loss(new, old, torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.ones(4, 1))
    >>> round(loss.item(), 4), stats["clip_frac_high"], stats["clip_frac_low"]
    (-0.12, 0.25, 0.25)
    """
    assert aggregation in AGGREGATIONS, f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}"
    assert logprobs.shape == old_logprobs.shape == mask.shape, "shape mismatch"
    assert advantages.shape in (mask.shape[:1], mask.shape), "one advantage per sequence, or per token"
    assert kl_coef == 0 or ref_logprobs is not None, "kl_coef > 0 needs ref_logprobs"
    mask = mask.float()
    adv = advantages.float()  # (B, T), or (B,) when every token of a trajectory shares its advantage:
    adv = adv[:, None] if adv.dim() == 1 else adv  # (B, 1), broadcast over the tokens
    # Masked positions get log-ratio 0 before exp: prompt tokens have old logprob 0, and exp of a
    # large difference would overflow to inf, and inf * 0 is nan.
    log_ratio = (logprobs - old_logprobs) * mask  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T) pi_theta / pi_old per token
    # PPO's pessimistic bound (Schulman et al. 2017, arXiv:1707.06347), with DAPO's asymmetric
    # range: maximize min(r A, clip(r, 1 - eps_low, 1 + eps_high) A). The clip only bites when it
    # lowers the objective: r > 1 + eps_high for A > 0, r < 1 - eps_low for A < 0; there the
    # gradient is 0. A wider eps_high lets unlikely tokens with A > 0 grow (less entropy collapse).
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)  # (B, T)
    kl = None
    if ref_logprobs is not None:
        # k3 estimator of KL(pi_theta || pi_ref) from samples of pi_theta: with log_r = ref - logp,
        # exp(log_r) - log_r - 1 is unbiased and never negative (Schulman, "Approximating KL
        # divergence", http://joschu.net/blog/kl-approx.html); GRPO uses it as a loss term.
        log_r = (ref_logprobs - logprobs) * mask
        kl = torch.exp(log_r) - log_r - 1  # (B, T)
        per_token = per_token + kl_coef * kl

    # Aggregation: the one normalizer choice, loss = sum over trained tokens of weight * per_token.
    num_sequences = num_sequences or mask.shape[0]
    num_tokens = num_tokens or mask.sum()
    if aggregation == "token":  # DAPO: every trained token of the step weighs the same
        weights = mask / num_tokens
    elif aggregation == "sequence":  # original GRPO: mean over each sequence, then over sequences
        weights = mask / (mask.sum(-1, keepdim=True).clamp(min=1) * num_sequences)
    else:  # "constant", Dr. GRPO: no length-dependent normalizer, so no bias toward long wrong answers
        assert max_tokens, "aggregation='constant' needs max_tokens"
        weights = mask / (num_sequences * max_tokens)
    loss = (per_token * weights).sum()

    with torch.no_grad():
        stats = {
            "clip_frac_low": masked_mean(((ratio < 1 - clip_low) & (adv < 0)).float(), mask).item(),
            "clip_frac_high": masked_mean(((ratio > 1 + clip_high) & (adv > 0)).float(), mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            # k3 estimate of KL(pi_old || pi_theta) from pi_old's own samples: (r - 1) - log r >= 0
            "kl_old": masked_mean((ratio - 1) - log_ratio, mask).item(),
            "kl": None if kl is None else masked_mean(kl, mask).item(),
            "tokens": int(mask.sum().item()),
        }
    return loss, stats


def sampled_entropy(trajectories):
    """The policy's entropy, estimated as the mean of -log p(sampled token) over trained tokens
    (read from the rollouts: no full-vocabulary pass; see the module docstring)."""
    tokens = sum(sum(t.assistant_mask) for t in trajectories)
    total = sum(sum(lp * m for lp, m in zip(t.sampled_logprobs, t.assistant_mask)) for t in trajectories)
    return -total / max(1, tokens)


def normalizer_counts(batch, config):
    """The counts the loss normalizer divides by (policy_loss): sequences and trained tokens of
    the whole step, forwarded or not, and Dr. GRPO's constant (the step's longest if not set)."""
    masks = [sum(t.assistant_mask) for group, advantages in batch
             for t, a in zip(group.trajectories, advantages) if a is not None]
    return {"num_sequences": len(masks), "num_tokens": sum(masks),
            "max_tokens": config.max_tokens or max(masks, default=0)}


# ---------------------------------------------------------------- 3) one optimizer step
def _values(advantages):
    """The advantages of a group's trajectories as numbers: a trajectory's one, or each of its tokens'."""
    return [v for a in advantages if a is not None for v in (a if isinstance(a, list) else [a])]


def _clip_and_step(optimizer, max_grad_norm, scaler) -> float:
    """Clip the gradient norm and step, unless it is not finite; returns the norm (before clipping).
    The gradients are unscaled first; on an inf/nan nothing is stepped, and an enabled scaler's
    update() lowers its scale (a disabled one does nothing). The caller reports the skip."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    if math.isfinite(grad_norm):
        scaler.step(optimizer)
    scaler.update()
    return grad_norm


def grpo_step(model, optimizer, batch, config, scaler, reference_context=None, counts=None,
              sum_processes=None):
    """One optimizer step on `batch` (batch_from_groups) for the LoRA parameters in `optimizer`.
    reference_context: under it `model` is the KL reference (kl_coef > 0); scaler: a GradScaler,
    a pass-through unless fp16. Returns floats for logging. Data parallel (parallel.grpo_step):
    `counts` are the whole step's, and `sum_processes(optimizer, numbers)` sums the gradients and
    the numbers over the processes, so that all take the same decision."""
    assert all(math.isfinite(v) for _, adv in batch for v in _values(adv)), "non-finite advantage"
    assert config.kl_coef == 0 or reference_context is not None, "kl_coef > 0 needs a reference_context"
    device = next(model.parameters()).device
    norm = counts or normalizer_counts(batch, config)  # over the WHOLE step (see policy_loss)
    trained = [t for group, adv in batch for t, a in zip(group.trajectories, adv) if a is not None]
    stats = {"loss": 0.0, "kl": None, "grad_norm": 0.0, "skipped": False, "skip_reason": "",
             "sequences": len(trained), "tokens": sum(sum(t.assistant_mask) for t in trained),
             "forwarded_sequences": 0, "forwarded_tokens": 0, "entropy": sampled_entropy(trained)}
    averaged = ["clip_frac_low", "clip_frac_high", "ratio_mean", "kl_old"] + ["kl"] * (config.kl_coef > 0)
    sums = dict.fromkeys(averaged, 0.0)    # token-weighted sums over the micro-batches
    mbs = config.micro_batch_size

    def logprobs_of(group, part):    # (B, T): the trajectories `part` of a group, one forward over their tree
        return forward.tree_logprobs(model, group.tree, group.trajectories, part, config.chunk_size)

    autocast = torch.autocast(device.type, dtype=config.amp_dtype, enabled=config.amp_dtype is not None)
    optimizer.zero_grad(set_to_none=True)
    try:
        with forward.training(model, config.gradient_checkpointing):
            for group, advantages in batch:
                # A zero-advantage trajectory has per-token loss -min(r * 0, clip(r) * 0) = 0 and no
                # gradient, and is in the normalizer already: not forwarded, unless a KL term pulls it.
                rows = [i for i, (t, a) in enumerate(zip(group.trajectories, advantages)) if a is not None
                        and sum(t.assistant_mask) and (any(_values([a])) or config.kl_coef > 0)]
                for part in [rows[k:k + mbs] for k in range(0, len(rows), mbs)]:
                    picked = [group.trajectories[i] for i in part]
                    b = forward.collate(picked, [advantages[i] for i in part], device)
                    ref_logprobs = None
                    if config.kl_coef > 0:   # the reference first: its context may swap weights in place
                        with torch.no_grad(), reference_context, autocast:
                            ref_logprobs = logprobs_of(group, part)
                    with autocast:
                        logprobs = logprobs_of(group, part)
                    loss, s = policy_loss(logprobs, b["old_logprobs"], b["advantages"], b["mask"],
                                          clip_low=config.clip_low, clip_high=config.clip_high,
                                          aggregation=config.aggregation, kl_coef=config.kl_coef,
                                          ref_logprobs=ref_logprobs, **norm)
                    if not torch.isfinite(loss):  # fp16 overflow or a bad rollout log-prob: no update
                        stats.update(skipped=True, skip_reason=f"non-finite loss ({loss.item()})")
                        break
                    scaler.scale(loss).backward()   # a disabled scaler returns the loss as it is
                    stats["loss"] += loss.item()
                    stats["forwarded_sequences"] += len(part)
                    stats["forwarded_tokens"] += s["tokens"]
                    sums = {k: sums[k] + s[k] * s["tokens"] for k in sums}
                if stats["skipped"]:
                    break
        stats.update({k: v / max(1, stats["forwarded_tokens"]) for k, v in sums.items()})
        # (under data parallelism the others wait for this one's gradients, even after a skip)
        skipped, forwarded = (sum_processes or (lambda _, numbers: numbers))(
            optimizer, [stats["skipped"], stats["forwarded_sequences"]])
        if skipped or not forwarded:
            return {**stats, "skipped": True, "skip_reason": stats["skip_reason"] or (
                "a non-finite loss in another process" if skipped
                else "no trained token with a nonzero advantage")}
        stats["grad_norm"] = _clip_and_step(optimizer, config.max_grad_norm, scaler)
        if not math.isfinite(stats["grad_norm"]):
            stats.update(skipped=True, skip_reason=f"non-finite gradient norm ({stats['grad_norm']})")
        return stats
    finally:
        optimizer.zero_grad(set_to_none=True)  # a skipped step leaves no stale gradient behind


# ---------------------------------------------------------------- 4) supervised steps
def sft_step(model, optimizer, trajectories, config, scaler):
    """One supervised step: maximize log p of the assistant tokens of demonstration trajectories,
    with the RL step's tokens, masks, forward and precision, so a warm start teaches exactly the
    format rollouts produce; the turns the trajectories of one task share (agentrl.make_group) are
    forwarded once. Loss = -(sum of masked log-probs) / (trained tokens of the whole step), so
    micro-batches accumulate to the full-batch gradient. A non-finite loss or gradient skips the step. Returns
    {sft_loss, grad_norm, tokens, skipped} or {sft_loss, skipped, skip_reason}.
    """
    num_tokens = sum(sum(t.assistant_mask) for t in trajectories)
    assert num_tokens > 0, "SFT needs trajectories with trained (assistant) tokens"
    device, tree = next(model.parameters()).device, agentrl.make_group(None, trajectories).tree
    autocast = torch.autocast(device.type, dtype=config.amp_dtype, enabled=config.amp_dtype is not None)
    mbs, sft_loss = config.micro_batch_size, 0.0
    optimizer.zero_grad(set_to_none=True)
    try:
        with forward.training(model, config.gradient_checkpointing):
            # the trajectories of one prompt (one task) are packed together, mbs at a time; those of
            # different tasks share only the system prompt, so each goes alone, the causal way
            parts = [node.rows[k:k + mbs] for node in tree.children for k in range(0, len(node.rows), mbs)]
            for part in parts:
                with autocast:
                    logprobs = forward.tree_logprobs(model, tree, trajectories, part, config.chunk_size)
                mask = forward.collate([trajectories[i] for i in part], [0.0] * len(part), device)["mask"]
                loss = -(logprobs * mask).sum() / num_tokens
                if not torch.isfinite(loss):
                    return {"sft_loss": loss.item(), "skipped": True, "skip_reason": "non-finite loss"}
                scaler.scale(loss).backward()
                sft_loss += loss.item()
        grad_norm = _clip_and_step(optimizer, config.max_grad_norm, scaler)
        if not math.isfinite(grad_norm):
            return {"sft_loss": sft_loss, "skipped": True,
                    "skip_reason": f"non-finite gradient norm ({grad_norm})"}
        return {"sft_loss": sft_loss, "grad_norm": grad_norm, "tokens": num_tokens, "skipped": False}
    finally:
        optimizer.zero_grad(set_to_none=True)

