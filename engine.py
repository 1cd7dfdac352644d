"""The rollout engine: many episodes decoded in one batch, tool turns, the KV cache reused by hand.

    groups = rollout_groups(model, tokenizer, tasks, n=8, sampling=Sampling(seed=0), limits=Limits())
    groups[0].trajectories[0].token_ids                 # exactly what GRPO will train on
    groups = branch_groups(model, tokenizer, groups, 16, Sampling(seed=1), Limits())  # 8 more, branched

How `rollout_groups` turns G tasks into G groups of N trajectories (B = G*N rows, each an
agentrl.Episode with a queue of tokens to feed):
  1) the prompts' common prefix is encoded once, into a one-row cache every row starts from (a row
     that joins mid-rollout, an evaluation's next task, then feeds its question alone, not a
     whole prompt padded across every row of the batch);
  2) every row mid-turn takes its next token, recorded with its log-prob under the policy sampled
     (the logits over the temperature: the policy GRPO trains, grpo.py);
  3) a turn ending in a tool call runs the tool (agentrl.end_turn), and the template's new tokens
     are queued for the row; a row stops on submit_answer, no call, a limit, or non-finite logits;
  4) finished rows leave the batch;
  5) once no row is mid-turn (the flush), the cache is packed, waiting rows join (`max_rows`), and
     every row's queue is fed at once, rows with the same tokens so far (one node) fed once;
  6) one forward feeds every row what it was given (kvcache.py: the cache and that forward);
  7) each group's tree, from the turn boundaries the rows recorded (agentrl.make_group).
A group can also grow as a tree on purpose (`branch_groups`): rows that start from a state another
row reached after a tool result. ask.py asks a trained agent: the same engine on one row, greedy.
Nothing here counts or times: the benchmarks wrap these functions from outside.

Shapes: B rows, S cache columns, W tokens fed in one forward, V vocabulary.

Simplifications, and why they are safe:
- Appends are turn-synchronous: a row that called a tool waits (fed holes) until no row is
  mid-turn, so the cache stays as wide as the longest row.
- A waiting row still samples a token each step, ignored: cheaper than gathering the rows that need one.
"""
import random
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

import lora
from agentrl import (Episode, Limits, ToolCallError, TrajectoryGroup, decode, end_turn, make_group,
                     parse_tool_call, stop_token_ids, to_trajectory)
from files import common_prefix_length
from kvcache import CachedForward, KVCache, pack_left, right_aligned
from sql_env import SQLEnv


@dataclass
class Sampling:
    temperature: float = 1.0
    greedy: bool = False       # argmax decoding, for evaluation
    seed: int = 0              # seeds the torch.Generator: same seed, same trajectories
    weight_dtype: torch.dtype | None = None   # merged layers' and lm_head's weights; log-probs: that policy's
    cache_dtype: torch.dtype | None = None    # the KV cache's, attended in it (None: the keys' own)


@dataclass
class Row(Episode):
    """An episode in the engine's batch. The rule the engine keeps: between two forwards, a row's
    token_ids are the tokens in its cache row, then `pending`, then (mid-turn) the token just sampled,
    which the next forward feeds. A turn ended in a tool call leaves its last token, the tool's answer
    and the next header in `pending` for the flush; a row unfinished with `pending` empty is mid-turn."""
    pending: list[int] = field(default_factory=list)


def rollout_group(model, tokenizer, task, n, sampling=Sampling(), limits=Limits(), **kw) -> TrajectoryGroup:
    """N trajectories for one task (see rollout_groups)."""
    return rollout_groups(model, tokenizer, [task], n, sampling, limits, **kw)[0]


@torch.no_grad()
def rollout_groups(model, tokenizer, tasks, n, sampling=Sampling(), limits=Limits(),
                   make_env=None, max_rows=None, rows=None) -> list[TrajectoryGroup]:
    """N trajectories for each task, decoded in one batch (the module docstring's steps): a
    TrajectoryGroup per task, in task order; the same seed, the same trajectories. make_env: task ->
    an environment like sql_env.SQLEnv (the default). max_rows: rows decoding at once (default all);
    the others join at flushes, in order (continuous batching). rows: _start_rows' rows, some moved on
    by branch_groups; default, fresh ones."""
    if not tasks:       # a process whose share of a step or an evaluation is empty (torchrun, few tasks)
        return []
    was_training, device = model.training, model.device
    model.eval()
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    stop_ids, pad_id = stop_token_ids(tokenizer), tokenizer.pad_token_id or 0
    forward = CachedForward(model, sampling.weight_dtype)

    with lora.lora_merged(model, sampling.weight_dtype):   # one weight a layer while generating (lora.py)
        # 1) the prompts' common prefix (system prompt, tools, worked example) is encoded ONCE, into a
        #    one-row cache every row starts from; each row's own rest of the prompt waits to be fed
        rows = rows or _start_rows(tasks, n, tokenizer, limits, make_env or SQLEnv)
        prompts = [row.token_ids for row in rows]
        prefix = KVCache(model.config, dtype=sampling.cache_dtype)
        prefix_len = common_prefix_length(prompts, limit=min(map(len, prompts)) - 1)
        forward(torch.tensor([prompts[0][:prefix_len]], device=device),
                torch.ones((1, prefix_len), dtype=torch.long, device=device), prefix)
        for row in rows:
            row.pending = row.token_ids[prefix_len:]     # the first feed: at least one token of its own

        cache = KVCache(model.config, max(map(len, prompts)) + limits.max_new_tokens, sampling.cache_dtype)
        mask = torch.zeros((0, 0), dtype=torch.long, device=device)       # (B, S): 1 real token, 0 hole
        waiting = list(range(len(rows)))[::-1]   # rows not started yet, the next one last
        active, logits = [], None                # active[b] = index into rows of cache row b; logits (B, V)
        max_rows = max_rows or len(rows)

        while active or waiting:
            # 2) every active row that is mid-turn takes its next token: greedy or sampled
            feed = {}                       # r -> tokens to feed in the next forward
            if active:
                chosen, chosen_logprobs, finite = _next_tokens(logits, sampling, generator)
            # 3) end turns: run tools, queue the appended tokens, close finished rows
            for b, r in enumerate(active):
                row = rows[r]
                if row.pending:             # waiting for the flush: not mid-turn, fed a hole
                    continue
                if not finite[b]:           # an overflow upstream: no token to take, the row ends here
                    end_turn(row, limits, tokenizer, truncated="non_finite_logits")
                    continue
                _take_token(row, chosen[b], chosen_logprobs[b], stop_ids, limits, tokenizer)
                if not row.pending and not row.stop_reason:
                    feed[r] = row.token_ids[-1:]          # the token just sampled

            # 4) drop finished rows from the batch (cache, mask and their bookkeeping)
            keep = [b for b, r in enumerate(active) if not rows[r].stop_reason]
            if len(keep) < len(active):
                index = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(index)
                mask = mask[index]
                active = [active[b] for b in keep]

            # 5) the turn-synchronous flush: once no row is mid-turn, pack the cache (drop hole columns),
            #    let waiting rows join with the prefix, and feed every row its queued tokens at once
            flush = not feed
            if flush:
                mask = pack_left(cache, mask)
                joining = [waiting.pop() for _ in range(min(len(waiting), max_rows - len(active)))]
                if joining:
                    cache.add_rows(prefix, len(joining))    # the prefix, then holes up to the cache's width
                    width = cache.get_seq_length()
                    new_mask = (torch.arange(width, device=device) < prefix_len).long()
                    new_mask = new_mask.expand(len(joining), -1)
                    mask = torch.cat([nn.functional.pad(mask, (0, width - mask.shape[1])), new_mask])
                    active += joining
                for r in active:
                    feed[r], rows[r].pending = rows[r].pending, []
            if not active:
                break

            # 6) one forward for all rows over what they were fed; logits for each row's last token. At a
            #    flush, rows with the same tokens so far (one node of their group's tree) get the same
            #    cache row and logits: one of each is fed (`firsts`), then copied (`which`)
            firsts, which = (_distinct_histories([rows[r] for r in active]) if flush
                             else (range(len(active)), None))
            shared = len(firsts) < len(active)
            if shared:
                cache.batch_select_indices(torch.tensor(firsts, device=device))
                mask = mask[firsts]
            ids, new_mask = right_aligned([feed.get(active[b], []) for b in firsts], pad_id, device)  # (B, W)
            mask = torch.cat([mask, new_mask], dim=1)                                            # (B, S+W)
            logits = forward(ids, mask, cache)                    # (B, V); a waiting row's are unused
            if shared:
                index = torch.tensor(which, device=device)
                cache.batch_select_indices(index)
                mask, logits = mask[index], logits[index]

    model.train(was_training)
    trajectories = [to_trajectory(row) for row in rows]
    return [make_group(task, trajectories[g * n:(g + 1) * n]) for g, task in enumerate(tasks)]


def _distinct_histories(rows):
    """([the first row of each distinct token history], [for each row, its history's place in
    that list]). The cache depends on the tokens alone; each row keeps its own environment."""
    places, firsts, which = {}, [], []
    for b, row in enumerate(rows):
        key = tuple(row.token_ids)
        if key not in places:
            places[key] = len(firsts)
            firsts.append(b)
        which.append(places[key])
    return firsts, which


def _start_rows(tasks, n, tokenizer, limits, make_env):
    """The rows of a rollout, task-major (task g, sample j is row g*n + j), each a fresh episode in
    an environment of its own."""
    return [Row.start(task, make_env(task), tokenizer, limits) for task in tasks for _ in range(n)]


def _go_to(row, trajectory, k, tokenizer):
    """Put a fresh row in the state `trajectory` reached after k turns: its tokens, mask 0 (credited to
    the trajectory that sampled them), its messages, and the environment, brought there by making its
    k tool calls again (the messages stay the trajectory's, should a query answer differently)."""
    end, last = trajectory.turns[k]
    for message in trajectory.messages[len(row.messages):last:2]:       # its assistant turns
        row.num_turns += 1
        row.num_tool_calls += "<tool_call>" in message["content"]
        try:
            row.env.call(*parse_tool_call(message["content"]))
        except ToolCallError:
            row.num_parse_errors += 1
    row.messages = [dict(m) for m in trajectory.messages[:last]]
    row.token_ids, row.mask, row.logprobs = trajectory.token_ids[:end], [0] * end, [0.0] * end
    row.turn_start, row.text_len = end, len(decode(tokenizer, row.token_ids))
    row.turns = list(trajectory.turns[:k + 1])


def branch_groups(model, tokenizer, groups, n, sampling, limits, rule="uniform", max_rows=None,
                  make_env=None):
    """Groups that branch at turn boundaries (Tree-GRPO, arXiv:2509.21240): each group, rolled out
    whole, gets new rows up to n that go on from one of its states right after a tool result
    (`_go_to`; none: from the prompt), the copied part fed once per distinct state, never decoded.
    The state is drawn uniformly over the trajectories' turn boundaries (a state m share, m times as
    often), or (rule "entropy", after ARPO, arXiv:2507.19849) by the entropy of the turn sampled there
    (-log p of its first 8 tokens over 8): where the policy was unsure. Returns the grown groups."""
    if not groups:
        return []
    rng, starts, more = random.Random(f"branch {sampling.seed}"), [], n - len(groups[0].trajectories)
    assert more > 0 and all(len(g.trajectories) == n - more for g in groups), "groups of one size, under n"
    assert rule in ("uniform", "entropy"), f"rule: uniform or entropy, got {rule!r}"
    for group in groups:
        states = [(t, k) for t in group.trajectories for k in range(1, len(t.turns))]
        if not states:
            starts += [(group.trajectories[0], 0)] * more
            continue
        entropy = [-sum(t.sampled_logprobs[t.turns[k][0]:][:8]) / 8 + 1e-6 for t, k in states]
        starts += rng.choices(states, weights=entropy if rule == "entropy" else None, k=more)
    tasks = [g.task for g in groups]
    rows = _start_rows(tasks, more, tokenizer, limits, make_env or SQLEnv)
    for row, (trajectory, k) in zip(rows, starts):
        _go_to(row, trajectory, k, tokenizer)             # k = 0: the prompt, as the row starts
    sampling = replace(sampling, seed=sampling.seed + 2**32)      # a stream no other rollout's seed gives
    branched = rollout_groups(model, tokenizer, tasks, more, sampling, limits, max_rows=max_rows, rows=rows)
    return [make_group(g.task, g.trajectories + b.trajectories) for g, b in zip(groups, branched)]


def _next_tokens(logits, sampling, generator):
    """A token for each row from its logits (B, V): greedy, or sampled from softmax(logits / T).
    Log-probs under the policy sampled, log softmax(logits / T) (greedy: T = 1, the model itself).
    Returns (tokens, log-probs, finite), B each."""
    logprobs = torch.log_softmax(logits / (1.0 if sampling.greedy else sampling.temperature), dim=-1)
    if sampling.greedy:
        chosen = logits.argmax(-1)                                                      # (B,)
    else:
        # the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is a sample from p (the Gumbel-max
        # trick in another guise), cheaper than torch.multinomial over a large V
        race = torch.empty_like(logprobs).exponential_(1.0, generator=generator)        # (B, V)
        chosen = (logprobs.exp() / race).argmax(-1)                                     # (B,)
    chosen_logprobs = logprobs.gather(1, chosen[:, None])[:, 0]                         # (B,)
    return chosen.tolist(), chosen_logprobs.tolist(), torch.isfinite(logits).all(-1).tolist()


def _take_token(row, token, logprob, stop_ids, limits, tokenizer):
    """Append a sampled token to a mid-turn row; end the turn on a stop token, a closed tool call
    (looked for in this turn's tokens only), or a limit. A turn that ends in a tool call queues the
    call's last token (not in the cache yet) and the appended tokens in row.pending."""
    row.token_ids.append(token)
    row.mask.append(1)
    row.logprobs.append(logprob)
    eos = token in stop_ids
    recent = row.token_ids[max(row.turn_start, len(row.token_ids) - 12):]
    truncated = ("max_new_tokens" if len(row.token_ids) - row.turn_start >= limits.max_new_tokens
                 else "max_context" if len(row.token_ids) >= limits.max_context else None)
    if eos or "</tool_call>" in decode(tokenizer, recent):
        appended = end_turn(row, limits, tokenizer, eos=eos)
        row.pending = [token] + appended if appended else []
    elif truncated:
        end_turn(row, limits, tokenizer, truncated=truncated)
