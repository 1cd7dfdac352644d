"""The learning rule: GRPO on a LoRA, written as small pure functions.

    batch, counts = make_batch(groups, rewards, grpo_advantages)    # 1) better or worse than the group?
    batch, counts = make_batch(groups, rewards, partial(step_credit_advantages, weight=1.0))  # each turn too
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)       #    (disabled: a pass-through)
    stats = grpo_step(model, optimizer, batch, GRPOConfig(), scaler,  # 2) one optimizer step
                      reference=lora.lora_disabled(model))

GRPO (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300) drops PPO's value network: the n
trajectories of a group answer the same task, so the group mean reward is the baseline, and
every trained token of a trajectory shares its advantage. An advantage is always one float per
token: an estimator is a function (group, rewards) -> one list per trajectory, and a fork adds
one as a function (tests/test_grpo.py plugs in RLOO's leave-one-out baseline). Step credit (GiGPO,
step_credit_advantages) adds to each turn's tokens a second advantage, taken among the trajectories
that reached the state the turn starts from: the group's tree knows those states exactly. The
update is PPO's clipped surrogate on those advantages, token by token, over the tokens the model
sampled (prompts and tool results carry mask 0). One step (grpo_step): each group's tree is
forwarded once (forward.tree_logprobs), policy_loss gives its loss, normalized over the whole step,
and its backward adds into the gradient; the gradient norm is clipped and the optimizer steps. A
non-finite loss or gradient skips the step. Beside it, the control GRPO is measured against:
rft_step, a supervised step on the batch's correct rollouts (rejection-sampling fine-tuning).

Simplifications, and why they are safe:
- The policy trained is the policy sampled, pi_T = softmax(logits / T) at the rollouts' temperature
  T: the rollout records log pi_T of each token and the update divides the logits by the same T
  (GRPOConfig.temperature), as TRL and verl do. The model at temperature 1 is then never trained
  directly, and need not be: every rollout samples from pi_T, and greedy evaluation is the same
  argmax at any T. Recording log pi_1 instead would make the ratio compare a policy nobody sampled
  (RESULTS.md, "The policy sampled is the policy trained": the two, paired, from one start).
- The PPO "old" policy is the rollout policy itself (its `sampled_logprobs`): no extra forward.
  With one optimizer step per batch the ratio is 1 up to the numerical gap between the
  KV-cached sampler and this forward, and the clip has little to do (clip_frac_*, kl_old say
  how much). Several steps on one batch were measured to collapse the policy (RESULTS.md).
- The KL reference is a context manager under which the model is the reference
  (lora.lora_weights: the adapter RL started from; lora.lora_disabled: the base model): no
  second model in memory.
- Entropy is the mean of -log p(sampled token) over trained tokens, read from the rollouts: an
  unbiased estimate of the sampled policy's entropy, with no full-vocabulary pass.

Letters in shape comments: B sequences in a micro-batch, T tokens (right-padded).
"""
import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

import agentrl
import forward

Aggregation = Literal["token", "sequence", "constant"]      # the loss normalizers (aggregate)
AGGREGATIONS = get_args(Aggregation)


@dataclass
class GRPOConfig:
    micro_batch_size: int = 8         # a group's trajectories per forward (their tree once); gradients add up
    chunk_size: int | None = 512      # positions per lm_head chunk (forward.tree_logprobs); None: all at once
    temperature: float = 1.0          # the sampling temperature: logits / T, the policy sampled (see above)
    clip_low: float = 0.2             # PPO epsilon below ratio 1 (Schulman et al. 2017)
    clip_high: float = 0.28           # above ratio 1: DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476)
    aggregation: Aggregation = "token"  # "token" (DAPO), "sequence" (GRPO), "constant" (Dr. GRPO): aggregate
    max_tokens: int | None = None     # Dr. GRPO's constant, the generation budget; None = the step's longest
    kl_coef: float = 0.0              # beta of the k3 KL to the reference policy; 0: none, no forward (DAPO)
    max_grad_norm: float = 1.0        # global gradient-norm clip
    gradient_checkpointing: bool = False  # recompute layers in the backward: less memory, more time
    amp_dtype: torch.dtype | None = None  # autocast dtype (float16 + GradScaler on a T4); None: the weights'


# ---------------------------------------------------------------- 1) advantages
def normalized(rewards, scale_by_std=True, eps=1e-6):
    """GRPO's rule on one set of returns: (r_i - mean r) / std r, std the sample std (n - 1), as
    TRL's; all zeros when the returns are all equal (no signal). scale_by_std=False is Dr. GRPO
    (Liu et al. 2025, arXiv:2503.20783): the std up-weights groups nearly all right or all wrong.
    Four trajectories, two right (reward 1) and two wrong (0): the mean is 0.5, the sample std
    sqrt(4 * 0.25 / 3) = 0.577, so the advantages are +-0.5 / 0.577 = +-0.866:
    >>> [round(a, 3) for a in normalized([1.0, 0.0, 1.0, 0.0])]
    [0.866, -0.866, 0.866, -0.866]
    >>> normalized([1.0, 0.0, 1.0, 0.0], scale_by_std=False), normalized([1.0, 1.0])
    ([0.5, -0.5, 0.5, -0.5], [0.0, 0.0])
    """
    assert len(rewards) >= 2, f"a baseline needs at least 2 returns, got {len(rewards)}"
    r = torch.tensor(rewards, dtype=torch.float64)  # (n,)
    assert torch.isfinite(r).all(), f"non-finite reward in {rewards}"
    if r.std() <= eps:
        return [0.0] * len(rewards)
    a = r - r.mean()  # GRPO: the group mean is the baseline
    return (a / r.std() if scale_by_std else a).tolist()


def grpo_advantages(group, rewards, scale_by_std=True):
    """The estimator GRPO uses: trajectory i's every token gets normalized(rewards)[i]. rewards: one
    float per trajectory, None for one left out (its advantages are None too)."""
    kept = [i for i, r in enumerate(rewards) if r is not None]
    episode = dict(zip(kept, normalized([rewards[i] for i in kept], scale_by_std)))
    return [[episode[i]] * len(t.token_ids) if i in episode else None
            for i, t in enumerate(group.trajectories)]


def step_advantages(tree, returns, scale_by_std=True):
    """Per-turn step advantages read off a group's tree (GiGPO's A^S, Feng et al. 2025, arXiv:2505.10978):
    steps[i], one float per turn of trajectory i. A node's end is a state (the same tokens up to the
    start of an assistant turn: the same calls, the same tool results) and its children the turns
    taken from it. At a state two or more trajectories share, each one's step advantage for the turn
    it takes there is its return minus the mean return through the state (normalized); at a state
    seen once it is 0. returns: one float per trajectory, None for one left out. The return is the
    episode's reward, undiscounted: the reward comes once, at the end, and a discount would favour
    short episodes, which correctness does not ask for. The prompt is a state every trajectory
    shares, so the first turn's A^S is GRPO's A^E.

    Four trajectories, rewards 1, 0, 1, 0 (no std scaling): all four share the prompt (mean 0.5),
    three of them the state after list_tables (mean 2/3), two the state after describe (0.5):

        prompt {0,1,2,3} -> list_tables {0,1,2} -> describe {0,1} -> submit A {0}    r = 1
                                                                  -> submit B {1}    r = 0
                                                -> submit C {2}                      r = 1
                         -> submit D {3}                                             r = 0

    >>> from tree import build_tree
    >>> turns = {0: ["list", "describe", "A"], 1: ["list", "describe", "B"], 2: ["list", "C"], 3: ["D"]}
    >>> paths = [[(0, [0], [])] + [(0, [], [{"content": c}]) for c in turns[i]] for i in range(4)]
    >>> steps = step_advantages(build_tree(paths), [1.0, 0.0, 1.0, 0.0], scale_by_std=False)
    >>> [[round(a, 3) for a in s] for s in steps]
    [[0.5, 0.333, 0.5], [-0.5, -0.667, -0.5], [0.5, 0.333], [-0.5]]
    """
    steps = {i: [] for i in range(len(returns))}

    def visit(state):
        through = [i for i in state.through if returns[i] is not None]
        # the group's rule among the trajectories through the state (0 where one reaches it)
        advantage = dict(zip(through, normalized([returns[i] for i in through], scale_by_std)
                             if len(through) >= 2 else [0.0]))
        for turn in state.children:
            for i in turn.through:
                steps[i].append(advantage.get(i, 0.0))
            visit(turn)

    for prompt in tree.children:
        visit(prompt)
    return [steps[i] for i in range(len(returns))]


def step_credit_advantages(group, rewards, weight=1.0, scale_by_std=True):
    """GiGPO's estimator: the tokens of trajectory i's turn k get A^E_i + weight * A^S_i,k
    (grpo_advantages, step_advantages); the prompt's tokens (mask 0) keep A^E. rewards as
    grpo_advantages'."""
    episode = grpo_advantages(group, rewards, scale_by_std)
    steps = step_advantages(group.tree, rewards, scale_by_std)
    advantages = []
    for t, a, step in zip(group.trajectories, episode, steps):
        bounds = [start for start, _ in t.turns] + [len(t.token_ids)]   # turn k: tokens bounds[k]:bounds[k+1]
        advantages.append(None if a is None else a[:bounds[0]] + [
            a[0] + weight * s for k, s in enumerate(step) for _ in range(bounds[k + 1] - bounds[k])])
    return advantages


@dataclass
class Batch:
    """What one update takes: a step's groups, each trajectory's advantages, the normalizer's counts."""
    groups: list                 # agentrl.TrajectoryGroup: the step's kept groups, each tree forwarded once
    advantages: list             # advantages[g][i]: (T,) floats, trajectory i of group g; None: not trained
    num_sequences: int           # the WHOLE step's trained trajectories (all processes: parallel.grpo_step)
    num_tokens: int              # and their trained tokens (policy_loss's normalizers divide by these)
    max_tokens: int              # Dr. GRPO's constant: the generation budget, or the step's longest


def make_batch(groups, rewards, estimator=grpo_advantages, max_tokens=None):
    """A step's groups and rewards as grpo_step's Batch, and counts of each kind of group.
    estimator(group, rewards) -> one (T,) list per trajectory, None for one left out: grpo_advantages,
    step_credit_advantages (functools.partial), or a fork's. A trajectory cut on non-finite logits
    (fp16 overflow) failed numerically, not as a policy: its reward is None before the estimator sees
    it; a group left with under 2 (too_small_groups) or all advantages 0 (no_signal_groups): untrained."""
    assert len(groups) == len(rewards), "one list of rewards per group"
    counts = {"groups": len(groups), "trainable_groups": 0, "no_signal_groups": 0, "too_small_groups": 0,
              "non_finite_trajectories": 0}
    advantages = []
    for group, group_rewards in zip(groups, rewards):
        kept = [None if t.stop_reason == "non_finite_logits" else r
                for t, r in zip(group.trajectories, group_rewards)]
        counts["non_finite_trajectories"] += kept.count(None)
        given = estimator(group, kept) if len(kept) - kept.count(None) >= 2 else None
        signal = given is not None and any(v for a in given if a is not None for v in a)
        counts["trainable_groups" if signal else "no_signal_groups" if given else "too_small_groups"] += 1
        advantages.append(given if signal else [None] * len(group.trajectories))
    assert all(math.isfinite(v) for advs in advantages for a in advs if a for v in a), "non-finite advantage"
    masks = [sum(g.trajectories[i].assistant_mask) for g, advs in zip(groups, advantages)
             for i, a in enumerate(advs) if a]
    return Batch(groups, advantages, len(masks), sum(masks), max_tokens or max(masks, default=0)), counts


# ---------------------------------------------------------------- 2) the loss, in parts
def masked_mean(x, mask):
    """The mean of x over the positions where mask is 1 (0 where there are none)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.28):
    """PPO's per-token loss -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = pi / pi_old:
    returns (loss (B, T), ratio (B, T), log_ratio (B, T)), all 0 / 1 / 0 where mask is 0."""
    # Masked positions get log-ratio 0 before exp: prompt tokens have old logprob 0, and exp of a
    # large difference would overflow to inf, and inf * 0 is nan.
    log_ratio = (logprobs - old_logprobs) * mask  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T) pi_theta / pi_old per token
    # PPO's pessimistic bound (Schulman et al. 2017, arXiv:1707.06347), with DAPO's asymmetric
    # range. The clip only bites when it lowers the objective: r > 1 + eps_high for A > 0,
    # r < 1 - eps_low for A < 0; there the gradient is 0. A wider eps_high lets unlikely tokens with
    # A > 0 grow (less entropy collapse).
    loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)
    return loss * mask, ratio, log_ratio


def k3_kl(logprobs, ref_logprobs, mask):
    """(B, T) k3 estimate of KL(pi_theta || pi_ref) from samples of pi_theta: with log_r = ref - logp,
    exp(log_r) - log_r - 1 is unbiased and never negative (Schulman, "Approximating KL divergence",
    http://joschu.net/blog/kl-approx.html); GRPO adds it to the loss."""
    log_r = (ref_logprobs - logprobs) * mask
    return torch.exp(log_r) - log_r - 1


def aggregate(per_token, mask, aggregation, num_sequences, num_tokens, max_tokens):
    """The one normalizer choice: loss = sum over trained tokens of weight * per_token, the counts
    those of the WHOLE step, so micro-batches' losses and gradients add up to the step's."""
    if aggregation == "token":      # DAPO: every trained token of the step weighs the same
        weights = mask / num_tokens
    elif aggregation == "sequence":  # original GRPO: mean over each sequence, then over sequences
        weights = mask / (mask.sum(-1, keepdim=True).clamp(min=1) * num_sequences)
    else:   # "constant", Dr. GRPO: no length-dependent normalizer, so no bias toward long wrong answers
        weights = mask / (num_sequences * max_tokens)
    return (per_token * weights).sum()


def policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.28,
                aggregation="token", num_sequences=None, num_tokens=None, max_tokens=None,
                kl_coef=0.0, ref_logprobs=None):
    """Clipped policy-gradient loss over the trained tokens of a batch; returns (loss, stats), the
    stats means over trained tokens. All (B, T): logprobs the current policy's (with grad),
    old_logprobs the rollout's, advantages, mask (1: trained), ref_logprobs the reference's (for
    kl_coef > 0). num_*, max_tokens: the WHOLE step's counts (Batch; default: this batch's).

    Four trajectories of one trained token each, advantages +1, +1, -1, -1, and a policy that has
    moved since the rollout: ratios pi/pi_old of 1, 1.5, 1 and 0.5. Per token, -min(r A, clip(r) A)
    with clip to [0.8, 1.28] gives -1, -1.28 (clipped: 1.5 A would push further), +1, and +0.8
    (clipped: 0.5 < 0.8 with A < 0). The token mean is (-1 - 1.28 + 1 + 0.8) / 4 = -0.12:

    >>> old = torch.zeros(4, 1)                                       # log pi_old of each token
    >>> new = torch.tensor([[1.0], [1.5], [1.0], [0.5]]).log()         # log pi: ratios 1, 1.5, 1, 0.5
    >>> loss, stats = policy_loss(new, old, torch.tensor([[1.0], [1.0], [-1.0], [-1.0]]), torch.ones(4, 1))
    >>> round(loss.item(), 4), stats["clip_frac_high"], stats["clip_frac_low"]
    (-0.12, 0.25, 0.25)
    """
    assert logprobs.shape == old_logprobs.shape == advantages.shape == mask.shape, "shape mismatch"
    assert aggregation != "constant" or max_tokens, "aggregation='constant' needs max_tokens"
    mask, adv = mask.float(), advantages.float()
    per_token, ratio, log_ratio = clipped_surrogate(logprobs, old_logprobs, adv, mask, clip_low, clip_high)
    kl = k3_kl(logprobs, ref_logprobs, mask) if kl_coef else None   # (B, T)
    if kl is not None:
        per_token = per_token + kl_coef * kl
    loss = aggregate(per_token, mask, aggregation, num_sequences or mask.shape[0], num_tokens or mask.sum(),
                     max_tokens)
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
    """The sampled policy's entropy, estimated as the mean of -log p(sampled token) over trained
    tokens (read from the rollouts: no full-vocabulary pass)."""
    tokens = sum(sum(t.assistant_mask) for t in trajectories)
    total = sum(sum(lp * m for lp, m in zip(t.sampled_logprobs, t.assistant_mask)) for t in trajectories)
    return -total / max(1, tokens)


# ---------------------------------------------------------------- 3) one optimizer step
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


def grpo_step(model, optimizer, batch, config, scaler, reference=None, sum_processes=None):
    """One optimizer step on `batch` (make_batch) for the LoRA parameters in `optimizer`; returns floats
    for logging. reference: a context under which `model` is the KL reference (kl_coef > 0); scaler:
    a GradScaler, a pass-through unless fp16. sum_processes(optimizer, numbers) (parallel.grpo_step):
    sums the gradients and the numbers over the processes, so that all decide alike."""
    assert config.kl_coef == 0 or reference is not None, "kl_coef > 0 needs a reference"
    device = next(model.parameters()).device
    trained = [t for group, advantages in zip(batch.groups, batch.advantages)
               for t, a in zip(group.trajectories, advantages) if a]
    stats = {"loss": 0.0, "kl": None, "grad_norm": 0.0, "skipped": False, "skip_reason": "",
             "sequences": len(trained), "tokens": sum(sum(t.assistant_mask) for t in trained),
             "forwarded_sequences": 0, "forwarded_tokens": 0, "entropy": sampled_entropy(trained)}
    averaged = ["clip_frac_low", "clip_frac_high", "ratio_mean", "kl_old"] + ["kl"] * (config.kl_coef > 0)
    sums = dict.fromkeys(averaged, 0.0)    # token-weighted sums over the micro-batches
    autocast = torch.autocast(device.type, dtype=config.amp_dtype, enabled=config.amp_dtype is not None)
    optimizer.zero_grad(set_to_none=True)
    try:
        with forward.training(model, config.gradient_checkpointing):
            for group, advantages in zip(batch.groups, batch.advantages):
                # A = 0: loss -min(r 0, clip(r) 0) = 0, no gradient (counted): not forwarded, unless for KL
                picked = [i for i, a in enumerate(advantages)
                          if a and sum(group.trajectories[i].assistant_mask) and (any(a) or config.kl_coef)]
                mbs = config.micro_batch_size
                for part in [picked[k:k + mbs] for k in range(0, len(picked), mbs)]:
                    b = forward.collate([group.trajectories[i] for i in part], [advantages[i] for i in part],
                                        device)
                    args = model, group.tree, group.trajectories, part, config.chunk_size, config.temperature
                    with autocast:
                        ref_logprobs = None
                        if config.kl_coef > 0:   # the reference first: its context may swap weights in place
                            with torch.no_grad(), reference:
                                ref_logprobs = forward.tree_logprobs(*args)
                        logprobs = forward.tree_logprobs(*args)       # (B, T)
                    loss, s = policy_loss(logprobs, b["old_logprobs"], b["advantages"], b["mask"],
                                          clip_low=config.clip_low, clip_high=config.clip_high,
                                          aggregation=config.aggregation, kl_coef=config.kl_coef,
                                          ref_logprobs=ref_logprobs, num_sequences=batch.num_sequences,
                                          num_tokens=batch.num_tokens, max_tokens=batch.max_tokens)
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
        stats.update({k: v / stats["forwarded_tokens"] if stats["forwarded_tokens"] else None
                      for k, v in sums.items()})    # None where nothing was forwarded
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
    """One supervised step: maximize log p of the assistant tokens of demonstration trajectories
    (at temperature 1: the model itself), with the RL step's tokens, masks, forward and precision,
    so a warm start teaches exactly the format rollouts produce; the turns the trajectories of one
    task share (agentrl.make_group) are forwarded once. Loss = -(sum of masked log-probs) / (trained
    tokens of the whole step), so micro-batches accumulate to the full-batch gradient. A non-finite
    loss or gradient skips the step. Returns {sft_loss, grad_norm, tokens, skipped} or
    {sft_loss, skipped, skip_reason}.
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
            parts = [node.through[k:k + mbs] for node in tree.children
                     for k in range(0, len(node.through), mbs)]
            for part in parts:
                with autocast:
                    logprobs = forward.tree_logprobs(model, tree, trajectories, part, config.chunk_size)
                mask = forward.collate([trajectories[i] for i in part], None, device)["mask"]
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


def rft_step(model, optimizer, batch, config, scaler, reference=None, sum_processes=None):
    """The control GRPO is measured against, in grpo_step's place (train.py --update rft):
    rejection-sampling fine-tuning, sft_step on the batch's correct rollouts, right or not alone in
    their group. reference and sum_processes: grpo_step's, unused (one process, no KL)."""
    correct = [t for g in batch.groups for t in g.trajectories if t.correct and sum(t.assistant_mask)]
    if not correct:
        return {"skipped": True, "skip_reason": "no correct rollout"}
    return sft_step(model, optimizer, correct, config, scaler)
