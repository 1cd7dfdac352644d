"""The training forward: token log-probs of a batch of trajectories and their gradient, every
token that several trajectories share forwarded once.

    optimizer.zero_grad()
    forwarded = accumulate_gradients(model, rows, config, scaler, loss_of)   # loss_of(logprobs, batch)
    optimizer.step()

accumulate_gradients is the one loop behind the GRPO update and the SFT warm start (grpo.py):
1) plan: the prompt all rows start with, the families of rows that go on sharing tokens after it
(prefix_families: most often one group's rollouts), their micro-batches; 2) the KL reference's
log-probs, if asked; 3) the prompt forwarded once (SharedPrefix); 4) per family, its shared run
once (a segment), then its rows' own tokens by micro-batch, each batch's loss from the caller and
its backward; 5) the prompt's backward. The gradient is the one of forwarding every sequence
whole, added up in another order (tests/test_forward.py compares the two).

token_logprobs runs the lm_head in chunks and only where a log-prob is wanted, so the (B, T, V)
fp32 logits never exist at once. It takes logits = lm_head(final hidden state), true for Llama,
Qwen2 and SmolLM2; logit soft-capping or scaling would need adding in _head_logprobs.

Letters in shape comments: B rows in a micro-batch, T tokens (right-padded), P tokens of a
shared prefix, H hidden size, V vocabulary, N positions whose log-prob is wanted.
"""
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer

import files
import lora

MIN_SEGMENT = 16    # tokens: a run shared after the prompt that is shorter is not worth a forward of its own


# ---------------------------------------------------------------- 1) token log-probs, chunked
def _head_logprobs(head, hidden, targets):
    """log p(target) for n positions: (n, H) hidden, (n,) targets -> (n,) fp32."""
    logits = head(hidden).float()  # (n, V): the only full-vocabulary tensor, one chunk at a time
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def token_logprobs(model, input_ids, attention_mask, chunk_size=512, positions=None, prefix=None):
    """(B, T) fp32 log p(x_t | x_<t) under `model`, 0 at t = 0 (nothing predicts the first token).
    Right padding; positions come from the mask.

    One decoder forward gives the (B, T, H) last hidden states; the lm_head and log-softmax then
    run over chunks of `chunk_size` positions, each under activation checkpointing: autograd keeps
    the (n, H) hidden chunk and recomputes its (n, V) logits in the backward, so one chunk of fp32
    logits is alive at a time instead of B * T * V floats (8 x 1024 x 49152 x 4 bytes = 1.6 GB
    for SmolLM2), for a second lm_head matmul. chunk_size=None: all positions at once.
    positions: (B, T), nonzero where a log-prob is wanted (the trained tokens); elsewhere the
    result is 0 and the lm_head, the largest matmul per token, never runs.
    prefix: a SharedPrefix every row continues; input_ids and attention_mask are what comes after
    it, and the result is over those tokens.
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
    else:  # all at once, or no autograd: nothing is kept for a backward anyway
        logps = [_head_logprobs(head, h, y) for h, y in pieces]
    out = torch.zeros(B, T - 1, dtype=torch.float32, device=input_ids.device)
    out = out.masked_scatter(wanted, torch.cat(logps)) if logps else out  # back to (B, T - 1), 0 where not wanted
    return F.pad(out, (1, 0))  # (B, T)


# ---------------------------------------------------------------- 2) shared prefixes
class SharedPrefix:
    """Tokens every row of a forward starts with, forwarded once instead of once per row.

    The prompt (after=None): what every trajectory of a step starts with (system prompt, tools,
    worked example). A segment (after: the prompt, mask: which of its tokens are trained): the
    run one family of rows shares after the prompt. Unlike the prompt it holds trained tokens, so
    it computes their log-probs once (`logprobs`, (1, n)), and each row's loss terms are taken on
    that one copy. Its token_ids hold one token more than it keeps: the token where its rows
    part, predicted here and fed again by each row to predict the row's own next token.

    The gradient: the prefix's keys and values (per layer (1, KV heads, P, head dim)) enter each
    micro-batch's forward as its cache, expanded to the batch's rows, as detached copies that
    require grad (`leaves`): each micro-batch's backward stops there and adds its gradient into
    them (an expanded view's gradient is the sum over its rows). `backward` then carries the sum
    once through the prefix's own forward, into the LoRA weights (and a segment's into the
    prompt's leaves): the gradient of forwarding the prefix with every row, added in another order.

    Gradient checkpointing recomputes a layer in the backward, and the recompute updates its cache
    a second time, so neither cache here appends: the prefix's forward records each layer's keys
    and values (PrefixRecorder), the micro-batches only read them (PrefixCache), and
    checkpointing_keeps_cache lets a checkpointed layer keep such a cache.
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


# ---------------------------------------------------------------- 3) the plan: prompt, families, micro-batches
def shared_prefix_length(trajectories) -> int:
    """How many leading tokens a SharedPrefix can take for these trajectories: the tokens all of
    them start with, stopping before the position that predicts the first trained token (that
    position's output is a log-prob, so it must be in each sequence's own forward)."""
    first_trained = min(t.assistant_mask.index(1) if 1 in t.assistant_mask else len(t.token_ids) for t in trajectories)
    return max(files.common_prefix_length([t.token_ids for t in trajectories], limit=first_trained - 1), 0)


def _prefix_length(trajectories, config):
    """How many tokens the step's SharedPrefix takes: 0 when it is turned off, with under 2 tokens
    to share, or under gradient checkpointing in a transformers that would drop its cache."""
    length = shared_prefix_length(trajectories) if trajectories and config.shared_prefix else 0
    keeps_cache = hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")
    return length if length >= 2 and (keeps_cache or not config.gradient_checkpointing) else 0


def _shared_prefix(model, trajectories, length):
    return SharedPrefix(model, trajectories[0].token_ids[:length]) if length else None


def prefix_families(trajectories, start, min_segment=MIN_SEGMENT):
    """The trajectories that go on sharing tokens after the step's prompt (`start` tokens), most
    often one group's: [(end, indices)], each family's tokens start..end forwarded once (a
    segment), its rows from token `end` on; those that share nothing more come last, as one family
    with end = start. Sorted by their tokens, trajectories that share a run sit side by side; a row
    that would cut its family's run to under half starts a family of its own instead. A family's
    end stops one token before its rows' tokens (or masks) first differ, since each row feeds that
    token again, and leaves every row 2 tokens to forward. A segment may hold no trained token,
    and a row none after its segment: only what trains is forwarded."""
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


def collate(trajectories, advantages, device, start=0, stop=None, after_segment=False):
    """Right-pad trajectories, from token `start` on (after a SharedPrefix of that length) up to
    token `stop` (default: their ends), into a batch: input_ids, attention_mask (B, T) long;
    mask (B, T) 1.0 on trained tokens; old_logprobs (B, T) the rollout's; advantages (B,);
    sequence_tokens (B,) each whole trajectory's trained tokens. The first column is never
    predicted in its batch's forward: a trained token there is one a segment predicted
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


# ---------------------------------------------------------------- 4) the forward and backward of a step
def accumulate_gradients(model, rows, config, scaler, loss_of, advantages=None, reference_context=None) -> int:
    """Forward `rows` (trajectories: token_ids, assistant_mask, sampled_logprobs) and add the
    gradient of the sum of their losses into the parameters' .grad; the caller zeroes the
    gradients before and steps the optimizer after. Returns how many rows were forwarded.

    loss_of(logprobs, batch) -> a scalar loss, or None to stop (a non-finite loss). logprobs
    (B, T) fp32 with grad at batch["mask"]'s positions, batch collate's dict for the same rows and
    columns. Losses are normalized by the whole step's counts, so their gradients add up to the
    step's. Each goes through scaler.scale before its backward. After a None nothing more is
    forwarded or carried back: the gradient is partial, and the caller must not step on it.
    advantages: one per row, into batch["advantages"] (default 0.0).
    reference_context: a context manager under which `model` is the KL reference. Every
    micro-batch then gets batch["ref_logprobs"] (B, T), taken under it with no grad before any
    forward with grad (the context may swap weights in place), and there are no segments: every
    row goes on from the prompt (a reference forward per micro-batch already reads each token).
    config (grpo.GRPOConfig): micro_batch_size, chunk_size, shared_prefix, group_segments,
    gradient_checkpointing, amp_dtype. The model runs in train mode and is given back in its own.
    """
    device = next(model.parameters()).device
    advantages = [0.0] * len(rows) if advantages is None else advantages
    mbs = config.micro_batch_size
    autocast = torch.autocast(device.type, dtype=config.amp_dtype, enabled=config.amp_dtype is not None)
    was_training = model.training
    model.train()  # checkpointing (and LoRA dropout) act in train mode only
    set_gradient_checkpointing(model, config.gradient_checkpointing)
    try:
        # 1) plan: the prompt all rows start with (`start` tokens), then families of rows that share a
        #    run after it (a segment: tokens start..end), each family's rows in micro-batches from `end` on
        start = _prefix_length(rows, config)
        plan = []   # per family: its segment's end (start: none), its rows and advantages, their micro-batches
        for end, members in _families(rows, start, config.group_segments and reference_context is None):
            family, advs = [rows[i] for i in members], [advantages[i] for i in members]
            plan.append((end, family, advs, [collate(family[s:s + mbs], advs[s:s + mbs], device, end, after_segment=end > start)
                                             for s in range(0, len(family), mbs)]))

        # 2) the reference's log-probs, before any forward with grad: the context may swap weights in place
        if reference_context is not None:
            with torch.no_grad(), reference_context, autocast:
                ref_prefix = _shared_prefix(model, rows, start)   # the reference's own prompt, under its weights
                for *_, batches in plan:
                    for b in batches:
                        b["ref_logprobs"] = token_logprobs(model, b["input_ids"], b["attention_mask"], config.chunk_size,
                                                           b["mask"], ref_prefix)   # (B, T)

        # 3) the prompt, forwarded once
        with autocast:
            prefix = _shared_prefix(model, rows, start)

        # 4) per family: its shared run once, each row's loss terms there on its one copy of the log-probs;
        #    then the rows' own tokens by micro-batch; then the segment's backward
        forwarded = 0
        for end, family, advs, batches in plan:
            with autocast:
                segment = _segment(model, family, prefix, start, end, config)
            if segment is not None:
                segment_loss = loss_of(segment.logprobs.expand(len(family), -1),       # (rows, end + 1 - start)
                                       collate(family, advs, device, start, end + 1))
                if segment_loss is None:
                    return forwarded
            for b in batches:
                if not b["mask"].any():     # every trained token of these rows was the segment's
                    continue
                with autocast:
                    logprobs = token_logprobs(model, b["input_ids"], b["attention_mask"], config.chunk_size, b["mask"],
                                              segment or prefix)   # (B, T)
                loss = loss_of(logprobs, b)
                if loss is None:
                    return forwarded
                scaler.scale(loss).backward()   # a disabled scaler returns the loss as it is
            forwarded += len(family)            # in part (after a segment) or whole
            if segment is not None:   # the rows' gradient on its keys and values, and its own loss, through its forward
                segment.backward(scaler.scale(segment_loss))

        # 5) every batch's gradient on the prompt's keys and values, through the prompt's forward
        if prefix is not None:
            prefix.backward()
        return forwarded
    finally:
        model.train(was_training)
