"""The training forward: the token log-probs of a group's trajectories, each node of its tree forwarded once.

    logprobs = tree_logprobs(model, group.tree, group.trajectories, rows)   # (B, T) fp32, with grad
    batch = collate([group.trajectories[i] for i in rows], advantages, device)   # mask, old log-probs, A

A group's trajectories share their prompt, and often their first turns and tool results: the
group's tree (tree.Node). `pack` lays the nodes that the wanted trajectories pass through side
by side in one sequence, and the model runs once over it with a tree attention mask: a token
attends to the tokens before it in its node and to every token of its node's ancestors, and its
position is its index in its trajectory. So each token gets the hidden state a forward over its
own trajectory gives it, whichever trajectories share it, and autograd adds up, on each shared
token, the gradients of all the trajectories that pass through it. Every row's (B, T) log-probs
are then gathered from the one copy, and the loss is written as if every trajectory had been
forwarded whole (tests/test_forward.py compares the two).

The lm_head runs in chunks and only where a log-prob is wanted, so full-vocabulary fp32 logits
never exist for a whole sequence. It takes logits = lm_head(final hidden state), true for Llama,
Qwen2 and SmolLM2; logit soft-capping or scaling would need adding in _head_logprobs.

Simplifications, and why they are safe:
- The mask is a dense (U, U) boolean: U is the tokens of one pack (a group's distinct tokens, a
  few thousand), so it is a few MB; SDPA reads it as it is.
- Nodes end at turn boundaries, so two turns that share their first tokens and part later are two
  nodes: a little sharing left on the table, and nodes that line up with the judge's messages.

Letters in shape comments: U tokens in a pack, B trajectories, T tokens (right-padded), H hidden
size, V vocabulary, N positions whose log-prob is wanted.
"""
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint


# ---------------------------------------------------------------- 1) a tree as one sequence
def pack(tree, rows):
    """The nodes of `tree` that the trajectories `rows` (indices) pass through, depth first, as one
    sequence. Returns ids (U,), positions (U,), visible (U, U) bool (u attends to v), before (U,)
    (the token before u in its trajectories, -1 for a first token), and for each row the index in
    the sequence of each of its tokens (a list of T_row ints)."""
    wanted = set(rows)
    ids, positions, before, visible_runs, index = [], [], [], [], {r: [] for r in rows}

    def visit(node, path):      # path: the sequence indices of the node's ancestors' tokens, in order
        first = len(ids)
        here = list(range(first, first + len(node.tokens)))
        ids.extend(node.tokens)
        positions.extend(range(node.start, node.start + len(node.tokens)))
        before.extend([path[-1] if path else -1] + here[:-1] if here else [])
        visible_runs.append((here, path))
        for r in node.through:
            if r in wanted:
                index[r].extend(here)
        for child in node.children:
            if wanted.intersection(child.through):
                visit(child, path + here)

    visit(tree, [])
    U = len(ids)
    visible = torch.zeros(U, U, dtype=torch.bool)
    for here, path in visible_runs:
        if here:
            visible[here[0]:here[-1] + 1, path] = True                                  # every ancestor token
            causal = torch.ones(len(here), len(here)).tril().bool()
            visible[here[0]:here[-1] + 1, here[0]:here[-1] + 1] = causal
    return torch.tensor(ids), torch.tensor(positions), visible, torch.tensor(before), [index[r] for r in rows]


# ---------------------------------------------------------------- 2) token log-probs, chunked
def _head_logprobs(head, hidden, targets, temperature):
    """log p_T(target), p_T = softmax(logits / T), at n positions: (n, H) hidden, (n,) targets -> (n,)."""
    logits = head(hidden).float() / temperature  # (n, V): the only full-vocabulary tensor, a chunk at a time
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def tree_logprobs(model, tree, trajectories, rows, chunk_size=512, temperature=1.0):
    """(B, T) fp32 log p_T(token_t | tokens_<t), p_T = softmax(logits / temperature) (the policy a
    rollout at that temperature sampled), of trajectories[r] for r in rows, right-padded with 0, at
    the tokens some row trains, 0 elsewhere; one forward over the nodes of `tree` they pass through
    (pack). The lm_head runs over chunks of `chunk_size` wanted positions (None: all at once), each
    checkpointed: one chunk's (n, V) fp32 logits alive at a time, recomputed in the backward."""
    device = next(model.parameters()).device
    ids, positions, visible, before, index = pack(tree, rows)
    # one trajectory is a chain, its mask the causal one: passing none lets SDPA take its causal path,
    # which skips the masked half instead of computing every (U, U) entry
    mask = None if len(rows) == 1 else visible[None, None].to(device)
    hidden = model.base_model(input_ids=ids[None].to(device), position_ids=positions[None].to(device),
                              attention_mask=mask, use_cache=False).last_hidden_state[0]  # (U, H)
    # token u is predicted by the hidden state of the token before it (before[u]); a log-prob is
    # wanted where some row trains the token
    trained = torch.zeros(len(ids), dtype=torch.bool)
    for r, where in zip(rows, index):
        mask = trajectories[r].assistant_mask
        trained[[u for u, m in zip(where, mask) if m]] = True
    assert (before[trained] >= 0).all(), "a trained token needs a token before it to predict it"
    wanted = trained.nonzero().squeeze(1)                                               # (N,)
    h, targets = hidden[before[wanted].to(device)], ids[wanted].to(device)             # (N, H), (N,)
    head, n = model.get_output_embeddings(), chunk_size or max(1, len(wanted))
    pieces = zip(h.split(n), targets.split(n))
    if chunk_size and torch.is_grad_enabled():
        logps = [checkpoint(_head_logprobs, head, hc, yc, temperature, use_reentrant=False)
                 for hc, yc in pieces]
    else:       # all at once, or no autograd: nothing is kept for a backward anyway
        logps = [_head_logprobs(head, hc, yc, temperature) for hc, yc in pieces]
    packed = torch.zeros(len(ids), dtype=torch.float32, device=device)                 # (U,)
    packed = packed.index_put((wanted.to(device),), torch.cat(logps)) if logps else packed
    # each row's tokens, gathered from the one copy: (B, T), 0 on the padding
    T = max(map(len, index))
    where = torch.tensor([w + [0] * (T - len(w)) for w in index], device=device)       # (B, T)
    real = torch.tensor([[1] * len(w) + [0] * (T - len(w)) for w in index], device=device)
    return packed[where] * real


def collate(trajectories, advantages, device):
    """Right-pad trajectories into a batch: mask (B, T) 1.0 on trained tokens; old_logprobs (B, T)
    the rollout's; advantages (B, T) from one list of floats per trajectory (None: no advantages)."""
    T = max(len(t.token_ids) for t in trajectories)
    for t, a in zip(trajectories, advantages or [t.token_ids for t in trajectories]):
        assert len(t.token_ids) == len(t.assistant_mask) == len(t.sampled_logprobs) == len(a), \
            "a trajectory's fields and advantages (one a token) differ in length"
        assert t.assistant_mask[0] == 0, "the first token is never predicted, so it cannot be trained"

    def pad(rows):
        return torch.tensor([list(r) + [0] * (T - len(r)) for r in rows], dtype=torch.float32,
                            device=device)  # (B, T)

    return {"mask": pad([t.assistant_mask for t in trajectories]),
            "old_logprobs": pad([t.sampled_logprobs for t in trajectories]),
            "advantages": None if advantages is None else pad(advantages)}


# ---------------------------------------------------------------- 3) train mode and memory
@contextmanager
def training(model, gradient_checkpointing):
    """The model in train mode, each decoder layer recomputed in the backward instead of storing its
    activations (gradient_checkpointing) or not; given back in its own mode. Checkpointing is
    non-reentrant (it needs no input that requires grad: a frozen base with LoRA layers gets
    gradients) and acts in train mode with grad enabled only, so rollouts are unaffected."""
    was_training = model.training
    model.train()
    # "activation": transformers 5.x's name
    kind = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if gradient_checkpointing and not getattr(model, f"is_{kind}_checkpointing"):
        getattr(model, f"{kind}_checkpointing_enable")({"use_reentrant": False})
    elif not gradient_checkpointing and getattr(model, f"is_{kind}_checkpointing"):
        getattr(model, f"{kind}_checkpointing_disable")()
    try:
        yield
    finally:
        model.train(was_training)
