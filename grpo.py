"""The learning rule: GRPO on a LoRA, written as small pure functions.

    batch, advantages, counts = batch_from_groups(groups, rewards)   # 1) better or worse than the group?
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)         #    (disabled: a pass-through)
    stats = grpo_update(model, optimizer, batch, advantages, GRPOConfig(), scaler,  # 2) K optimizer steps
                        reference_context=lora.lora_disabled(model))

GRPO (DeepSeekMath, Shao et al. 2024, https://arxiv.org/abs/2402.03300) drops PPO's value
network: the n trajectories of a group answer the same task, so the group mean reward is the
baseline, and every trained token of a trajectory shares its advantage. The update is PPO's
clipped surrogate on those advantages, token by token, over the tokens the model sampled
(tool results and prompts carry mask 0 and teach nothing).

What one step does: forward the prompt all trajectories start with once (SharedPrefix), then
each group's run of shared tokens once (a segment: prefix_families), then the trajectories' own
tokens in micro-batches (gradients accumulate), compute token log-probs in chunks over the
sequence, the clipped loss with one normalizer for the whole step, carry the gradient back
through the segments and the shared prompt, clip the gradient norm, step the optimizer; a
non-finite loss or gradient skips the step.

Letters in shape comments: B sequences in a micro-batch, T tokens (right-padded), H hidden
size, V vocabulary, N = B * (T - 1) positions flattened.

Simplifications, and why they are safe:
- The PPO "old" policy is the rollout policy itself (its `sampled_logprobs`), so there is no
  extra forward pass before the update. With one optimizer step per batch of rollouts the ratio
  is 1 up to the numerical gap between the KV-cached sampler and this forward, and the clip has
  nothing to do; grpo_update takes several steps on the same rollouts (epochs, minibatches), and
  from the second on the policy has moved, the ratio leaves 1, and the clip keeps each step near
  the policy that sampled (the stats report how often it acted, and the KL to that policy).
  Rollouts sampled with bf16 weights (train.py --rollout-dtype bf16) record the bf16 policy's
  log-probs: the first step's ratio is then pi_fp32 / pi_bf16, the importance weight for having
  sampled from a policy a rounding away from the one trained, and its kl_old measures that gap.
- The KL reference is a context manager the caller passes, under which the model is the
  reference: train.py swaps in the adapter RL started from (lora.lora_weights), or the LoRA can
  be switched off for the base model (lora.lora_disabled); no second model in memory.
- Entropy is estimated as the mean of -log p(sampled token) over trained tokens (read from the
  rollout, no full-vocabulary pass). It is the policy entropy in expectation when sampling at
  temperature 1 without top-p, and a trend indicator otherwise.
- Log-probs assume logits = lm_head(final hidden state), true for Llama, Qwen2 and SmolLM2;
  a model with logit soft-capping or scaling would need it added in `_head_logprobs`.
- Learning-rate schedules and which tasks to roll out are the caller's business (train.py); this
  file only turns rollouts into optimizer steps. The control GRPO is measured against lives here
  too: rft_update, supervised steps on a step's correct rollouts, as many as grpo_update takes.
"""
import math
import random
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer

import lora

AGGREGATIONS = ("token", "sequence", "constant")


@dataclass
class GRPOConfig:
    micro_batch_size: int = 8         # sequences per forward/backward; gradients accumulate over the step
    chunk_size: int | None = 512      # positions per lm_head chunk in token_logprobs; None = all at once
    clip_low: float = 0.2             # PPO epsilon below ratio 1 (Schulman et al. 2017)
    clip_high: float = 0.28           # above ratio 1: DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476)
    aggregation: str = "token"        # "token" (DAPO), "sequence" (GRPO), "constant" (Dr. GRPO): policy_loss
    max_tokens: int | None = None     # Dr. GRPO's constant, the generation budget; None = the step's longest
    kl_coef: float = 0.0              # beta of the k3 KL to the reference policy; 0 = no reference forward (DAPO)
    max_grad_norm: float = 1.0        # global gradient-norm clip
    gradient_checkpointing: bool = False  # recompute layers in the backward: less memory, more time (train.py: on; bench.py allocator)
    shared_prefix: bool = True        # forward the prompt all sequences start with once per step (SharedPrefix)
    group_segments: bool = True       # and each group's run of shared tokens after it once (prefix_families)
    amp_dtype: torch.dtype | None = None  # autocast dtype (float16 + GradScaler on a T4); None = weights' dtype
    epochs: int = 1                   # passes over one batch of rollouts (grpo_update)
    minibatches: int = 1              # optimizer steps per pass: epochs * minibatches steps per batch


# ---------------------------------------------------------------- 1) advantages
def group_advantages(rewards, scale_by_std=True, eps=1e-6):
    """Per-trajectory advantages from per-group rewards: A_i = (r_i - mean(r)) / std(r).

    rewards: one list of floats per group, or None for a group that has no rewards at all.
    Returns (advantages, counts): advantages[g] is a list (one float per trajectory) or None for
    a group that carries no signal: unscored (None in), or zero variance (every trajectory got
    the same reward, so every advantage would be 0). counts says how many of each, for logging.
    scale_by_std=False is Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): dividing by the std
    up-weights groups that are nearly all right or all wrong, a difficulty bias they remove.
    std is the sample std (n - 1), as TRL computes it.

    Four trajectories of one task, two right (reward 1) and two wrong (0): the mean is 0.5, the
    sample std is sqrt(4 * 0.25 / 3) = 0.577, so the advantages are +-0.5 / 0.577 = +-0.866.
    A second group, all right, carries no signal:

    >>> advantages, counts = group_advantages([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    >>> [round(a, 3) for a in advantages[0]], advantages[1]
    ([0.866, -0.866, 0.866, -0.866], None)
    >>> counts["trainable_groups"], counts["zero_variance_groups"]
    (1, 1)
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


def batch_from_groups(groups, rewards, scale_by_std=True):
    """From a step's groups and their rewards to what grpo_step takes: (batch, advantages, counts).

    groups: objects with .trajectories (each with .stop_reason); rewards: one list per group, in
    trajectory order. A trajectory the rollout cut on non-finite logits (fp16 overflow) is a
    numeric failure, not an outcome of the policy: it leaves its group before the baseline is
    taken, and a group left with fewer than 2 trajectories is unscored. Groups that carry no
    signal (group_advantages) add nothing to the batch. counts: group_advantages' counts plus
    `non_finite_trajectories`.
    """
    assert len(groups) == len(rewards), "one list of rewards per group"
    kept = [[i for i, t in enumerate(g.trajectories) if t.stop_reason != "non_finite_logits"] for g in groups]
    kept_rewards = [[rs[i] for i in ks] if len(ks) >= 2 else None for rs, ks in zip(rewards, kept)]
    advantages, counts = group_advantages(kept_rewards, scale_by_std=scale_by_std)
    batch, batch_advantages = [], []
    for group, ks, adv in zip(groups, kept, advantages):
        if adv is not None:
            batch += [group.trajectories[i] for i in ks]
            batch_advantages += adv
    counts["non_finite_trajectories"] = sum(len(g.trajectories) - len(ks) for g, ks in zip(groups, kept))
    return batch, batch_advantages, counts


# ---------------------------------------------------------------- 2) token log-probs, chunked
def _head_logprobs(head, hidden, targets):
    """log p(target) for n positions: (n, H) hidden, (n,) targets -> (n,) fp32."""
    logits = head(hidden).float()  # (n, V): the only full-vocabulary tensor, one chunk at a time
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def token_logprobs(model, input_ids, attention_mask, chunk_size=512, positions=None, prefix=None):
    """(B, T) fp32 log p(x_t | x_<t) under `model`, 0 at t = 0 (nothing predicts the first token).

    One forward of the decoder gives the last hidden states; the lm_head and log-softmax then run
    over chunks of `chunk_size` positions. Each chunk runs under activation checkpointing, so
    autograd keeps only the (n, H) hidden chunk and recomputes the chunk's (n, V) logits in the
    backward: at most one chunk of fp32 logits is alive at a time instead of B * T * V floats
    (8 x 1024 x 49152 x 4 bytes = 1.6 GB per copy for SmolLM2, 5 GB for Qwen2.5). The price is
    a second lm_head matmul in the backward. chunk_size=None computes everything at once (the
    baseline that bench.py measures against). Right padding; positions come from the mask.

    positions: (B, T), nonzero where a log-prob is wanted (the trained tokens); elsewhere the
    result is 0 and the lm_head never runs. The head is the largest matmul per token (576 x 49152
    for SmolLM2), run three times with checkpointing; a trajectory trains only the tokens it
    sampled (a fifth of a demonstration: prompt, tool results and padding are the rest).

    prefix: a SharedPrefix every row continues; input_ids and attention_mask are then what comes
    after it, and the result is over those tokens (its first column, predicted from the prefix's
    last position, is 0 like any t = 0).
    """
    assert input_ids.shape == attention_mask.shape and input_ids.dim() == 2, "input_ids and mask must be (B, T)"
    assert input_ids.shape[1] >= 2, "need at least 2 tokens: one to condition on, one to predict"
    B, T = input_ids.shape
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T): 0, 1, ... over real tokens
    past = {}
    if prefix is not None:  # the rows go on from the prefix's P cached columns: positions P, P + 1, ...
        position_ids = position_ids + prefix.length
        attention_mask = torch.cat([attention_mask.new_ones(B, prefix.length), attention_mask], dim=1)  # (B, P + T)
        past = {prefix.keyword: prefix.cache(B)}
    # a checkpointed layer may keep the prefix's cache: it only reads (SharedPrefix says why)
    with checkpointing_keeps_cache(model) if prefix is not None else nullcontext():
        # use_cache=False: the prefix's cache, when there is one, is passed as it is; use_cache only
        # asks the model to make a new one (and makes a checkpointed layer warn that it cannot)
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=False, **past).last_hidden_state  # (B, T, H)
    return _wanted_logprobs(model, hidden, input_ids, positions, chunk_size)


def _wanted_logprobs(model, hidden, input_ids, positions, chunk_size):
    """token_logprobs from the decoder's (B, T, H) last hidden states: the lm_head in chunks."""
    B, T = input_ids.shape
    # position t - 1 predicts token t: keep the (N, H) rows whose target is wanted, N <= B * (T - 1)
    wanted = torch.ones(B, T - 1, dtype=torch.bool, device=input_ids.device) if positions is None else positions[:, 1:] != 0
    hidden, targets = hidden[:, :-1][wanted], input_ids[:, 1:][wanted]  # (N, H), (N,)
    head = model.get_output_embeddings()
    n = chunk_size or max(1, len(targets))
    pieces = zip(hidden.split(n), targets.split(n))
    if chunk_size and torch.is_grad_enabled():
        logps = [checkpoint(_head_logprobs, head, h, y, use_reentrant=False) for h, y in pieces]
    else:  # the unchunked baseline, or no autograd: nothing is kept for a backward anyway
        logps = [_head_logprobs(head, h, y) for h, y in pieces]
    out = torch.zeros(B, T - 1, dtype=torch.float32, device=input_ids.device)
    out = out.masked_scatter(wanted, torch.cat(logps)) if logps else out  # back to (B, T - 1), 0 where not wanted
    return F.pad(out, (1, 0))  # (B, T)


class SharedPrefix:
    """The tokens every sequence of a step starts with, forwarded once for the step instead of
    once per sequence: the system prompt, the tools and the worked example are ~275 of a GRPO
    trajectory's ~870 tokens here, so each sequence's forward and backward shrink by about a third.

    The prefix's keys and values (one row; per layer (1, KV heads, P, head dim)) enter every
    micro-batch's forward as its cache, expanded to the micro-batch's rows. They enter as detached
    copies that require grad, so each micro-batch's backward stops there and adds its gradient
    into them (an expanded view's gradient is the sum over its rows); `backward` then carries the
    summed gradient once through the prefix's own forward into the LoRA weights. The gradient is
    the one of forwarding the prefix with every sequence, exactly: the same sum, added up in
    another order. Under no_grad (the KL reference) there is nothing to carry back.

    With gradient checkpointing, layers are recomputed in the backward, and a recomputed layer
    updates its cache a second time: a cache that appends would hand the recompute the prefix
    twice. So neither cache here appends. The prefix's forward records each layer's keys and
    values (PrefixRecorder, by assignment), the micro-batches read them (PrefixCache: the
    prefix's columns, then the new ones, nothing stored), and transformers is told that a
    checkpointed layer may keep such a cache (checkpointing_keeps_cache).

    A group's segment (`after`: the step's prompt, which it continues). The rollouts of one task
    share much more than the prompt: near-deterministic after SFT, they make the same first tool
    calls and read the same results (about 700 of ~850 tokens in each group of 8 here, against
    ~275 shared by the whole step). A segment forwards those tokens once for its group. Unlike the
    prompt they hold trained tokens, so the segment also computes their log-probs, once (`mask`:
    which of its tokens are trained), and grpo_step takes each row's loss terms there (its own
    advantage and rollout log-prob) on that one copy. Its token_ids hold one token more than it
    keeps: the token where the rows part is predicted here, and fed again by each row, whose
    position predicts the row's own next token. Its backward carries the micro-batches' gradient
    and the segment's loss through its forward, into the LoRA weights and the prompt's keys and
    values (the prompt's own backward comes after).
    """

    def __init__(self, model, token_ids, after=None, mask=None, chunk_size=512):
        assert (after is None) == (mask is None), "a segment (after) comes with its trained mask, the prompt without"
        self.after, self.config, offset = after, model.config, after.length if after else 0
        self.keyword = lora.cache_keyword(model.base_model)
        recorder = PrefixRecorder(model.config, after.columns() if after else None)
        ids = torch.tensor([token_ids], device=next(model.parameters()).device)  # (1, n)
        with checkpointing_keeps_cache(model):
            hidden = model.base_model(input_ids=ids, position_ids=torch.arange(offset, offset + ids.shape[1], device=ids.device)[None],
                                      use_cache=False, **{self.keyword: recorder}).last_hidden_state   # the recorder as given
        kept = ids.shape[1] - (after is not None)      # a segment's last token is each row's first
        self.length = offset + kept                    # the columns a row continues from
        self.outputs = [(k[:, :, :kept], v[:, :, :kept]) for k, v in (recorder.recorded[i] for i in range(len(recorder.recorded)))]
        self.leaves = [(k.detach().requires_grad_(k.requires_grad), v.detach().requires_grad_(v.requires_grad))
                       for k, v in self.outputs]       # where the micro-batches stop: in the prefix's autograd graph above
        self.logprobs = None if mask is None else _wanted_logprobs(     # (1, n): a segment's trained tokens
            model, hidden, ids, torch.tensor([mask], device=ids.device), chunk_size)

    def columns(self):
        """Keys and values per layer, one row: every column a row continues from (the prompt's, then a segment's)."""
        if self.after is None:
            return self.leaves
        return [(torch.cat([ak, k], dim=-2), torch.cat([av, v], dim=-2)) for (ak, av), (k, v) in zip(self.after.columns(), self.leaves)]

    def cache(self, rows):
        """A cache holding the prefix in `rows` rows (views of its columns), for one forward."""
        return PrefixCache([(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in self.columns()],
                           config=self.config)

    def backward(self, loss=None):
        """After every micro-batch's backward: the gradient they left on the prefix's keys and
        values (and a segment's own loss, unless it holds no trained token), through the prefix's forward."""
        pairs = [(out, leaf.grad) for outs, leaves in zip(self.outputs, self.leaves)
                 for out, leaf in zip(outs, leaves) if leaf.grad is not None]
        pairs += [(loss, None)] if loss is not None and loss.requires_grad else []
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


class PrefixCache(DynamicCache):
    """A cache that only reads: each layer attends to the prefix's columns followed by the new
    ones, and nothing is stored, so running a layer twice (a checkpointed layer's recompute) sees
    the same cache both times. Lengths and mask sizes are the prefix's (DynamicCache's layers)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)


class PrefixRecorder(DynamicCache):
    """The prefix's own forward: each layer's keys and values are recorded (a recompute records
    them again, in the same place) and attended after `past`, the columns it continues (a
    segment's: the prompt's; the prompt has none)."""

    def __init__(self, config, past=None):
        super().__init__(past, config=config)
        self.recorded, self.continues = {}, past is not None   # layer index -> (keys, values), each (1, KV heads, n, head dim)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.recorded[layer_idx] = key_states, value_states
        if not self.continues:
            return key_states, value_states
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)


@contextmanager
def checkpointing_keeps_cache(model):
    """transformers drops the cache of a checkpointed decoder layer (its recompute in the backward
    would update the cache a second time) unless the layer says it may keep it. PrefixRecorder and
    PrefixCache are left by two runs as by one: let every decoder layer keep them, for a block."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for m in layers:
        m._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for m in layers:
            m.__dict__.pop("_can_checkpoint_with_cache", None)     # back to the class's own value


def shared_prefix_length(trajectories) -> int:
    """How many leading tokens a SharedPrefix can take for these trajectories: the tokens all of
    them start with, stopping before the position that predicts the first trained token (that
    position's output is a log-prob, so it must be in each sequence's own forward)."""
    first_trained = min(t.assistant_mask.index(1) if 1 in t.assistant_mask else len(t.token_ids) for t in trajectories)
    length = first_trained - 1
    for t in trajectories[1:]:
        length = next((i for i in range(length) if t.token_ids[i] != trajectories[0].token_ids[i]), length)
    return max(length, 0)


def _prefix_length(trajectories, config):
    """How many tokens the step's SharedPrefix takes: 0 when it is turned off, with under 2 tokens
    to share, or under gradient checkpointing in a transformers that would drop its cache."""
    length = shared_prefix_length(trajectories) if trajectories and config.shared_prefix else 0
    keeps_cache = hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")
    return length if length >= 2 and (keeps_cache or not config.gradient_checkpointing) else 0


def _shared_prefix(model, trajectories, length):
    return SharedPrefix(model, trajectories[0].token_ids[:length]) if length else None


MIN_SEGMENT = 16    # tokens: a run shared after the prompt that is shorter is not worth a forward of its own


def prefix_families(trajectories, start, min_segment=MIN_SEGMENT):
    """The trajectories that go on sharing tokens after the step's prompt (`start` tokens), most
    often one group's: [(end, indices)], each family's tokens start..end forwarded once, as one
    segment (SharedPrefix with `after`), and its rows from token `end` on; the trajectories that
    share nothing more come last, as one family with end = start. Ordered by their tokens,
    trajectories that share a run sit side by side; a row that would cut its family's run to under
    half goes on to a family of its own instead (one row of 8 that parts early leaves the other 7
    theirs). A family's end stops one token before its rows' tokens (or masks) first differ, since
    each row feeds that token again to predict its own next one, and leaves every row 2 tokens to
    forward. A segment may hold no trained token (rows that part at their first sampled one), and
    a row none after its segment (rows the same to the end): grpo_step forwards what trains."""
    families = []   # [common length, the first row's (token, mask) pairs, indices]
    for i in sorted(range(len(trajectories)), key=lambda i: trajectories[i].token_ids):
        pairs = list(zip(trajectories[i].token_ids, trajectories[i].assistant_mask))
        if families:
            common, first, members = families[-1]
            shared = next((k for k in range(min(common, len(pairs))) if pairs[k] != first[k]), min(common, len(pairs)))
            if shared - 1 - start >= max(min_segment, (common - start) / 2):
                families[-1] = [shared, first, members + [i]]
                continue
        families.append([len(pairs), pairs, [i]])
    out, alone = [], []
    for common, _, members in families:
        end = min(common - 1, min(len(trajectories[i].token_ids) for i in members) - 2)
        if len(members) > 1 and end - start >= min_segment:
            out.append((end, members))
        else:
            alone += members
    return out + ([(start, alone)] if alone else [])


def _families(trajectories, start, segments):
    """prefix_families (segments) or one family from the prompt on, each family's indices in order
    of length: similar lengths share a micro-batch, so less padding."""
    families = prefix_families(trajectories, start) if start and segments else [(start, list(range(len(trajectories))))]
    return [(end, sorted(members, key=lambda i: len(trajectories[i].token_ids))) for end, members in families]


def _segment(model, rows, prefix, start, end, config):
    """The run rows share from token `start` to `end` after the prompt (`prefix`), forwarded once,
    its trained tokens' log-probs with it; None where they share nothing more (end = start)."""
    if end == start:
        return None
    return SharedPrefix(model, rows[0].token_ids[start:end + 1], after=prefix, mask=rows[0].assistant_mask[start:end + 1],
                        chunk_size=config.chunk_size)


# ---------------------------------------------------------------- 3) the loss
def policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.28,
                aggregation="token", num_sequences=None, num_tokens=None, max_tokens=None,
                kl_coef=0.0, ref_logprobs=None, sequence_tokens=None):
    """Clipped policy-gradient loss over the trained tokens of a batch; returns (loss, stats).

    logprobs (B, T) current policy (with grad); old_logprobs (B, T) rollout policy; advantages
    (B,); mask (B, T) 1 on trained tokens; ref_logprobs (B, T) reference policy, for the KL.
    num_sequences / num_tokens are the WHOLE step's counts (default: this batch's). A caller that
    splits a step into micro-batches passes them, so the micro-batch losses add up to the loss,
    and the accumulated gradient to the gradient, of the step as one batch.
    sequence_tokens (B,): each whole sequence's trained tokens, the "sequence" normalizer, for a
    batch that holds only part of each (a segment, or the rows after it); default: the mask's.
    stats (floats, means over this batch's trained tokens): clip_frac_low, clip_frac_high,
    ratio_mean, kl_old (how far the policy has moved from the one that sampled), kl (to the
    reference; None without ref_logprobs), tokens.

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
    assert logprobs.shape == old_logprobs.shape == mask.shape and advantages.shape == mask.shape[:1], "shape mismatch"
    assert kl_coef == 0 or ref_logprobs is not None, "kl_coef > 0 needs ref_logprobs"
    mask = mask.float()
    adv = advantages.float()[:, None]  # (B, 1): every token of a trajectory shares its advantage
    # Masked positions get log-ratio 0 before exp: prompt tokens have old logprob 0, and exp of a
    # large difference would overflow to inf, and inf * 0 is nan.
    ratio = torch.exp((logprobs - old_logprobs) * mask)  # (B, T) pi_theta / pi_old per token
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
        lengths = mask.sum(-1) if sequence_tokens is None else sequence_tokens.float()
        weights = mask / (lengths[:, None].clamp(min=1) * num_sequences)
    else:  # "constant", Dr. GRPO: no length-dependent normalizer, so no bias toward long wrong answers
        assert max_tokens, "aggregation='constant' needs max_tokens"
        weights = mask / (num_sequences * max_tokens)
    loss = (per_token * weights).sum()

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        stats = {
            "clip_frac_low": (((ratio < 1 - clip_low) & (adv < 0)).float() * mask).sum().div(n).item(),
            "clip_frac_high": (((ratio > 1 + clip_high) & (adv > 0)).float() * mask).sum().div(n).item(),
            "ratio_mean": (ratio * mask).sum().div(n).item(),
            # k3 estimate of KL(pi_old || pi_theta) from pi_old's own samples: (r - 1) - log r >= 0
            "kl_old": (((ratio - 1) - (logprobs - old_logprobs) * mask) * mask).sum().div(n).item(),
            "kl": None if kl is None else (kl * mask).sum().div(n).item(),
            "tokens": int(mask.sum().item()),
        }
    return loss, stats


# ---------------------------------------------------------------- 4) one optimizer step
def set_gradient_checkpointing(model, enabled):
    """Recompute each decoder layer in the backward instead of storing its activations.

    Non-reentrant checkpointing, which needs no input that requires grad; transformers also makes
    the embedding output require grad, so a frozen base with LoRA layers gets gradients either way.
    It acts only in train mode with grad enabled, so rollouts (eval, no grad) are unaffected.
    """
    # transformers 5.x is renaming gradient_checkpointing_* to activation_checkpointing_*: take this version's
    kind = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if enabled and not getattr(model, f"is_{kind}_checkpointing"):
        getattr(model, f"{kind}_checkpointing_enable")({"use_reentrant": False})
    elif not enabled and getattr(model, f"is_{kind}_checkpointing"):
        getattr(model, f"{kind}_checkpointing_disable")()


def sampled_entropy(trajectories):
    """The policy's entropy, estimated as the mean of -log p(sampled token) over trained tokens
    (read from the rollouts: no full-vocabulary pass; see the module docstring)."""
    tokens = sum(sum(t.assistant_mask) for t in trajectories)
    return -sum(sum(lp * m for lp, m in zip(t.sampled_logprobs, t.assistant_mask)) for t in trajectories) / max(1, tokens)


def _collate(trajectories, advantages, device, start=0, stop=None, after_segment=False):
    """Right-pad a list of trajectories, from token `start` on (after a SharedPrefix of that
    length) up to token `stop` (default: their ends), into (B, T) tensors. The first column is
    never predicted in its batch's forward: a trained token there is one a segment predicted
    (after_segment, or the segment's own batch, which begins with an untrained token)."""
    T = (stop or max(len(t.token_ids) for t in trajectories)) - start
    for t in trajectories:
        assert len(t.token_ids) == len(t.assistant_mask) == len(t.sampled_logprobs), "trajectory fields differ in length"
        assert t.assistant_mask[start] == 0 or after_segment, "the first token is never predicted, so it cannot be trained"

    def pad(rows, dtype):
        return torch.tensor([list(r[start:stop]) + [0] * (T - len(r[start:stop])) for r in rows], dtype=dtype, device=device)  # (B, T)

    mask = pad([t.assistant_mask for t in trajectories], torch.float32)
    mask[:, 0] = 0      # after a segment: its log-prob is the segment's, and so is its loss term
    return {
        "input_ids": pad([t.token_ids for t in trajectories], torch.long),
        "attention_mask": pad([[1] * len(t.token_ids) for t in trajectories], torch.long),
        "mask": mask,
        "old_logprobs": pad([t.sampled_logprobs for t in trajectories], torch.float32),
        "advantages": torch.tensor(advantages, dtype=torch.float32, device=device),  # (B,)
        "sequence_tokens": torch.tensor([sum(t.assistant_mask) for t in trajectories], device=device),  # (B,)
    }


def sum_gradients(params, all_reduce, counts):
    """Data parallel: replace each parameter's gradient by its sum over the processes, and sum
    `counts` (numbers) with them; returns the summed counts.

    One all-reduce of one flat tensor: LoRA gradients are small, so one message beats one per
    tensor, and the counts riding along let every process take the same decision after it. A
    parameter without a gradient (a process that forwarded nothing) contributes zeros. This is
    what DistributedDataParallel would do in its backward hooks; written out here because a step
    runs a different number of micro-batches on each process (DDP synchronizes every backward, and
    all processes must make the same number) and the loss goes through model.base_model and the LM
    head, around a DDP wrapper's forward. A sum of floats is the same on every process, so the
    processes step with identical gradients and keep identical weights.
    """
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor(counts, dtype=grads[0].dtype, device=grads[0].device)])
    all_reduce(flat)                                              # (P + len(counts),), summed in place
    for p, g in zip(params, flat[:-len(counts)].split([g.numel() for g in grads])):
        p.grad = g.view_as(p)
    return flat[-len(counts):].tolist()


def _clip_and_step(optimizer, max_grad_norm, scaler) -> float:
    """Clip the gradient norm and step, unless it is not finite; returns the norm (before clipping).

    The scaler's gradients are unscaled first (true values for clipping and the check). On an
    inf/nan nothing is stepped, and an enabled scaler's update() lowers its scale (it recorded
    the inf while unscaling); a disabled one does nothing. Either way the caller reports the
    step as skipped.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    if math.isfinite(grad_norm):
        scaler.step(optimizer)
    scaler.update()
    return grad_norm


def normalizer_counts(trajectories, config):
    """The counts the loss normalizer divides by (policy_loss): sequences and trained tokens of
    the whole step, forwarded or not, and Dr. GRPO's constant (the step's longest if not set)."""
    masks = [sum(t.assistant_mask) for t in trajectories]
    return {"num_sequences": len(trajectories), "num_tokens": sum(masks),
            "max_tokens": config.max_tokens or max(masks, default=0)}


def grpo_step(model, optimizer, trajectories, advantages, config, scaler, reference_context=None,
              counts=None, all_reduce=None):
    """One optimizer step on `trajectories` (objects with token_ids, assistant_mask,
    sampled_logprobs) with one advantage each. `optimizer` holds the trainable (LoRA) parameters.
    reference_context: a context manager under which `model` is the KL reference (e.g.
    lora.lora_disabled(model)); needed only when config.kl_coef > 0. scaler: a torch.amp.GradScaler,
    enabled for the fp16 path, disabled (a pass-through) otherwise. Returns a dict of floats for logging.

    Data parallel (train.py under torchrun; parallel.py): each process passes its own share of the
    step, `counts` = normalizer_counts of the whole step over all processes, and `all_reduce`, a
    function summing a tensor in place across them. Losses normalized by the whole step's counts
    add up over processes to the one-process loss, so the summed gradients are its gradient
    (sum_gradients). Every process takes part, even one with nothing to forward, and all take the
    same decision: step, or skip if any had a non-finite loss.
    """
    assert len(trajectories) == len(advantages), "one advantage per trajectory"
    assert all(math.isfinite(a) for a in advantages), "non-finite advantage"
    assert config.kl_coef == 0 or reference_context is not None, "kl_coef > 0 needs a reference_context"
    device = next(model.parameters()).device
    masks = [sum(t.assistant_mask) for t in trajectories]  # trained tokens per trajectory
    norm = counts or normalizer_counts(trajectories, config)  # over the WHOLE step (see policy_loss)
    stats = {"loss": 0.0, "clip_frac_low": 0.0, "clip_frac_high": 0.0, "ratio_mean": 0.0, "kl_old": 0.0,
             "kl": None, "grad_norm": 0.0, "skipped": False, "skip_reason": "",
             "sequences": len(trajectories), "tokens": sum(masks), "forwarded_sequences": 0,
             "entropy": sampled_entropy(trajectories)}

    # A zero-advantage trajectory has per-token loss -min(r * 0, clip(r) * 0) = 0 and no gradient;
    # its tokens are already in the normalizer above, so skipping its forward changes nothing.
    # With a KL term its tokens are still pulled toward the reference, so then it must be forwarded.
    # A trajectory without trained tokens (cut off before sampling anything) has nothing to forward.
    keep = [i for i, a in enumerate(advantages) if masks[i] > 0 and (a != 0 or config.kl_coef > 0)]
    if not keep and all_reduce is None:
        stats.update(skipped=True, skip_reason="no trained token with a nonzero advantage or a KL term")
        return stats
    kept, mbs = [trajectories[i] for i in keep], config.micro_batch_size
    autocast = torch.autocast(device.type, dtype=config.amp_dtype, enabled=config.amp_dtype is not None)
    was_training = model.training
    model.train()  # checkpointing (and LoRA dropout) act in train mode only
    set_gradient_checkpointing(model, config.gradient_checkpointing)
    optimizer.zero_grad(set_to_none=True)
    try:
        start = _prefix_length(kept, config)   # the prompt every trajectory starts with, forwarded once
        # then each family's run of shared tokens (most often a group's), once too, as a segment; with a
        # KL term (a reference forward per micro-batch) every row goes on from the prompt
        plan = []       # per family: its segment's end (start: none), its rows and advantages, their micro-batches
        for end, members in _families(kept, start, config.group_segments and config.kl_coef == 0):
            rows, advs = [kept[i] for i in members], [advantages[keep[i]] for i in members]
            plan.append((end, rows, advs, [_collate(rows[s:s + mbs], advs[s:s + mbs], device, end, after_segment=end > start)
                                           for s in range(0, len(rows), mbs)]))
        if config.kl_coef > 0:   # before any forward with grad: a reference context may swap weights in place
            with torch.no_grad(), reference_context, autocast:
                ref_prefix = _shared_prefix(model, kept, start)   # the reference's own, under its weights
                for *_, batches in plan:
                    for b in batches:
                        b["ref_logprobs"] = token_logprobs(model, b["input_ids"], b["attention_mask"], config.chunk_size,
                                                           b["mask"], ref_prefix)
        with autocast:
            prefix = _shared_prefix(model, kept, start)

        averaged = ["clip_frac_low", "clip_frac_high", "ratio_mean", "kl_old"] + (["kl"] if config.kl_coef > 0 else [])
        sums, forwarded_tokens = dict.fromkeys(averaged, 0.0), 0

        def loss_of(logprobs, b):
            """The batch's loss, its stats counted into the step's; None if it is not finite."""
            nonlocal forwarded_tokens
            loss, s = policy_loss(logprobs, b["old_logprobs"], b["advantages"], b["mask"], clip_low=config.clip_low,
                                  clip_high=config.clip_high, aggregation=config.aggregation, kl_coef=config.kl_coef,
                                  ref_logprobs=b.get("ref_logprobs"), sequence_tokens=b["sequence_tokens"], **norm)
            if not torch.isfinite(loss):  # fp16 overflow or a bad rollout log-prob: no update from this step
                stats.update(skipped=True, skip_reason=f"non-finite loss ({loss.item()})")
                return None
            stats["loss"] += loss.item()
            forwarded_tokens += s["tokens"]
            for k in averaged:  # token-weighted means over the micro-batches
                sums[k] += s[k] * s["tokens"]
            return scaler.scale(loss)   # a disabled scaler returns the loss as it is

        for end, rows, advs, batches in plan:
            with autocast:      # the family's shared run: its tokens' log-probs once, each row's terms on them
                segment = _segment(model, rows, prefix, start, end, config)
            segment_loss = None
            if segment is not None:
                b = _collate(rows, advs, device, start, end + 1)
                segment_loss = loss_of(segment.logprobs.expand(len(rows), -1), b)   # (rows, n): one copy, read by all
                if segment_loss is None:
                    break
            for b in batches:
                if not b["mask"].any():     # every trained token of these rows was the segment's
                    continue
                with autocast:
                    logprobs = token_logprobs(model, b["input_ids"], b["attention_mask"], config.chunk_size, b["mask"],
                                              segment or prefix)
                loss = loss_of(logprobs, b)
                if loss is None:
                    break
                loss.backward()
            if stats["skipped"]:
                break
            stats["forwarded_sequences"] += len(rows)       # in part (after a segment) or whole
            if segment is not None:
                segment.backward(segment_loss)   # the rows' gradient and the segment's loss, through its forward
        if stats["skipped"] and all_reduce is None:
            return stats          # (under all_reduce, the other processes wait for this one's gradients)
        stats.update({k: v / max(1, forwarded_tokens) for k, v in sums.items()}, forwarded_tokens=forwarded_tokens)
        if prefix is not None and not stats["skipped"]:
            prefix.backward()     # the micro-batches' gradient on the shared prefix, into the LoRA weights

        if all_reduce is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            failed, forwarded = sum_gradients(params, all_reduce, [stats["skipped"], stats["forwarded_sequences"]])
            if failed or not forwarded:
                stats.update(skipped=True, skip_reason=stats["skip_reason"] or (
                    "a non-finite loss in another process" if failed else "no trained token with a nonzero advantage"))
                return stats
        stats["grad_norm"] = _clip_and_step(optimizer, config.max_grad_norm, scaler)
        if not math.isfinite(stats["grad_norm"]):
            stats.update(skipped=True, skip_reason=f"non-finite gradient norm ({stats['grad_norm']})")
        return stats
    finally:
        optimizer.zero_grad(set_to_none=True)  # a skipped step leaves no stale gradient behind
        model.train(was_training)


def minibatch_passes(n, config, seed=0):
    """The optimizer steps one batch of n rollouts gets: config.epochs passes, each split into
    config.minibatches parts, as lists of indices. One epoch of one minibatch is the batch in its
    order; otherwise each pass shuffles it (seeded by `seed`, so a resumed run repeats it)."""
    order, rng, parts = list(range(n)), random.Random(seed), []
    size = math.ceil(n / config.minibatches)
    for _ in range(config.epochs):
        if config.epochs * config.minibatches > 1:
            rng.shuffle(order)
        parts += [order[i:i + size] for i in range(0, n, size)]
    return parts


def _several_steps(steps, keys):
    """The stats of several optimizer steps on one batch as one record: each of `keys` averaged
    over the steps applied (0.0 if none), `updates` (steps applied), `skipped` only when every
    step was, and the first skipped step's reason."""
    applied = [s for s in steps if not s["skipped"]]
    first_skip = next((s["skip_reason"] for s in steps if s["skipped"]), "")
    return {**{k: sum(s[k] for s in applied) / len(applied) if applied else 0.0 for k in keys},
            "updates": len(applied), "skipped": not applied, "skip_reason": first_skip}


def grpo_update(model, optimizer, trajectories, advantages, config, scaler, reference_context=None, seed=0):
    """config.epochs passes over one batch of rollouts, each split into config.minibatches optimizer
    steps (grpo_step), all against the rollout's log-probs: PPO's reuse of a costly batch.

    Rollouts are most of a step's time; a single optimizer step uses them once, with the ratio
    stuck at 1. Every step after the first sees a policy that has moved, so the ratio and the
    clip do their job (clip_frac_*, kl_old). epochs = minibatches = 1 is exactly one grpo_step on
    the batch as given (minibatch_passes); every minibatch is normalized over its own tokens.
    Returns grpo_step's stats averaged over the steps taken, with `updates` (steps applied) and
    `skipped` only when every step was.
    """
    steps = [grpo_step(model, optimizer, [trajectories[i] for i in part], [advantages[i] for i in part],
                       config, scaler, reference_context) for part in minibatch_passes(len(trajectories), config, seed)]
    if len(steps) == 1:
        return {**steps[0], "updates": int(not steps[0]["skipped"])}
    stats = _several_steps(steps, ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "kl_old", "grad_norm"))
    applied = [s for s in steps if not s["skipped"]]
    stats["kl"] = sum(s["kl"] for s in applied) / len(applied) if applied and config.kl_coef > 0 else None
    stats["kl_old_last"] = applied[-1]["kl_old"] if applied else 0.0   # the farthest the policy got from the sampler
    return {**stats, "sequences": len(trajectories), "tokens": sum(s["tokens"] for s in steps[:len(steps) // config.epochs]),   # one pass
            "forwarded_sequences": sum(s["forwarded_sequences"] for s in steps), "entropy": sampled_entropy(trajectories)}


# ---------------------------------------------------------------- 5) supervised warm start
def sft_step(model, optimizer, trajectories, config, scaler):
    """One supervised step: maximize log p of the assistant tokens of demonstration trajectories.

    The same tokens, masks, chunked log-probs, LoRA and precision (autocast, GradScaler) as the
    RL step, so a warm start teaches exactly the format rollouts produce. Loss = -(sum of masked
    log-probs) / (trained tokens of the whole step), so micro-batches accumulate to the
    full-batch gradient. The prompt is forwarded once (SharedPrefix) and so is the run the
    trajectories of a group share after it (a segment, as in grpo_step: rejection sampling's
    correct rollouts of one task). A non-finite loss or gradient skips the step. Returns stats.
    """
    device = next(model.parameters()).device
    num_tokens = sum(sum(t.assistant_mask) for t in trajectories)
    assert num_tokens > 0, "SFT needs trajectories with trained (assistant) tokens"
    mbs = config.micro_batch_size
    autocast = torch.autocast(device.type, dtype=config.amp_dtype, enabled=config.amp_dtype is not None)
    was_training = model.training
    model.train()
    set_gradient_checkpointing(model, config.gradient_checkpointing)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    try:
        start = _prefix_length(trajectories, config)
        with autocast:
            prefix = _shared_prefix(model, trajectories, start)   # the prompt, forwarded once (SharedPrefix)
        for end, members in _families(trajectories, start, config.group_segments):
            rows = [trajectories[i] for i in members]
            with autocast:      # the family's shared run, once: each row's tokens there counted on one copy
                segment = _segment(model, rows, prefix, start, end, config)
            segment_loss = None
            if segment is not None:
                mask = _collate(rows, [0.0] * len(rows), device, start, end + 1)["mask"]
                segment_loss = -(segment.logprobs * mask).sum() / num_tokens
                if not torch.isfinite(segment_loss):
                    return {"sft_loss": segment_loss.item(), "skipped": True, "skip_reason": "non-finite loss"}
                total += segment_loss.item()
            for s in range(0, len(rows), mbs):
                b = _collate(rows[s:s + mbs], [0.0] * len(rows[s:s + mbs]), device, end, after_segment=end > start)
                if not b["mask"].any():     # every trained token of these rows was the segment's
                    continue
                with autocast:
                    logprobs = token_logprobs(model, b["input_ids"], b["attention_mask"], config.chunk_size, b["mask"],
                                              segment or prefix)
                loss = -(logprobs * b["mask"]).sum() / num_tokens
                if not torch.isfinite(loss):
                    return {"sft_loss": loss.item(), "skipped": True, "skip_reason": "non-finite loss"}
                scaler.scale(loss).backward()   # a disabled scaler returns the loss as it is
                total += loss.item()
            if segment is not None:
                segment.backward(scaler.scale(segment_loss))
        if prefix is not None:
            prefix.backward()
        grad_norm = _clip_and_step(optimizer, config.max_grad_norm, scaler)
        if not math.isfinite(grad_norm):
            return {"sft_loss": total, "skipped": True, "skip_reason": f"non-finite gradient norm ({grad_norm})"}
        return {"sft_loss": total, "grad_norm": grad_norm, "tokens": num_tokens, "skipped": False}
    finally:
        optimizer.zero_grad(set_to_none=True)
        model.train(was_training)


def rft_update(model, optimizer, correct, config, scaler, seed=0):
    """Rejection-sampling fine-tuning, the control GRPO is measured against: supervised steps
    (sft_step) on a step's correct rollouts, as many as grpo_update takes on its batch
    (config.epochs x config.minibatches, split by minibatch_passes), so that the two differ in
    what they learn from, not in how often they step. One epoch of one minibatch is one sft_step.
    Returns sft_step's stats averaged over the steps applied, with `updates` (steps applied)."""
    steps = [sft_step(model, optimizer, [correct[i] for i in part], config, scaler)
             for part in minibatch_passes(len(correct), config, seed)]
    if len(steps) == 1:
        return {**steps[0], "updates": int(not steps[0]["skipped"])}
    return {**_several_steps(steps, ("sft_loss", "grad_norm")), "tokens": sum(sum(t.assistant_mask) for t in correct)}
