"""The agent: the chat/tool-call format and a multi-turn rollout engine that reuses the KV cache.

    model, tokenizer = lora.load_model()                # the policy (lora.py: loading and the LoRA)
    group = rollout_group(model, tokenizer, task, n=8, sampling=Sampling(seed=0), limits=Limits())
    group.trajectories[0].token_ids                     # exactly what GRPO will train on
    group.tree                                          # the turns its trajectories share (Node)
    group = branch_groups(model, tokenizer, [group], 16, Sampling(seed=1), Limits())[0]  # 8 more, branched
    demo = demonstration(tokenizer, task)               # a gold SFT demonstration, as a rollout records it

An episode: the system prompt (with the tools), a worked example, the question; then turns in which
the model writes one `<tool_call>{json}</tool_call>` and the environment answers, until it calls
`submit_answer`. A Trajectory records every token the model saw or sampled, in order, with a mask
(1 on sampled tokens) and their log-probs: what the update trains on, never a re-tokenization.

A group is a tree (tree.py, `make_group`): its trajectories share the prompt, and often their first
turns and the tool's answers. The root's child is the prompt, each node below it one turn (the
sampled call, the tool's answer, the next turn's header); a trajectory is the path to its leaf.
The judge prints that tree (judge.py), the update forwards each of its nodes once (forward.py), and
the step advantages are read off it (grpo.step_advantages). A group can also grow as a tree on
purpose (`branch_groups`): rows that start from a state another row reached after a tool result.

How `rollout_groups` turns G tasks into G groups of N trajectories (B = G*N rows):
  1) the prompts' common prefix is encoded once, into a one-row cache every row starts from;
  2) every row mid-turn takes its next token, recorded with its log-prob under the raw model
     (temperature 1: the policy GRPO trains);
  3) a turn ending in a tool call runs the tool, and the template's new text is queued for the row;
     a row stops on submit_answer, no call, a limit, or non-finite logits (`Trajectory.stop_reason`);
  4) finished rows leave the batch;
  5) once no row is mid-turn (the flush), the cache is packed, waiting rows join (`max_rows`), and
     every row's queue is fed at once, rows with the same tokens so far (one node) fed once;
  6) one forward feeds every row what it was given (kvcache.py: the cache and that forward);
  7) each group's tree, from the turn boundaries the rows recorded (`make_group`).
Shapes: B rows, S cache columns, W tokens fed in one forward, V vocabulary. ask.py asks a trained
agent: the same engine on one row, greedy.

Simplifications, and why they are safe:
- Appends are turn-synchronous: a row that called a tool waits (fed holes) until no row is
  mid-turn, so the cache stays as wide as the longest row.
- One tool call per turn: generation stops at `</tool_call>`, so a second call is never made.
- A waiting row still samples a token each step, ignored: cheaper than gathering the rows that need one.
"""
import json
import random
import re
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

import lora
from files import common_prefix_length
from kvcache import CachedForward, KVCache, pack_left, right_aligned
from sql_env import SQLEnv, tables_read
from tree import Node, build_tree

# ----------------------------------------------------------------------------- chat and tools

SYSTEM_PROMPT = ("You are a SQL agent. Answer the user's question about a SQLite database with tool calls "
                 "only, one per turn, never with prose.\n"
                 'A tool call is one line: <tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call>')


def tool_call_text(name, arguments) -> str:
    """One tool call as the agent writes it: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# One worked exchange before the real question. A small model like SmolLM2-135M answers in prose
# whatever the system prompt says, but copies the format of a demonstration. Its tokens have mask 0.
DEMONSTRATION = [
    {"role": "user", "content": "How many orders are there?"},
    {"role": "assistant", "content": tool_call_text("run_sql", {"query": "SELECT COUNT(*) FROM orders"})},
    {"role": "tool", "content": "COUNT(*)\n1520"},
    {"role": "assistant",
     "content": tool_call_text("submit_answer", {"query": "SELECT COUNT(*) FROM orders"})},
    {"role": "tool", "content": "Answer submitted."},
]


class ToolCallError(ValueError):
    """The generated text holds no usable tool call; the message becomes the agent's observation."""


def template_takes_tools(tokenizer) -> bool:
    """Does the chat template render `tools=` itself (Qwen2.5, Llama 3.1), or ignore it (SmolLM2)?"""
    return "tools" in (tokenizer.chat_template or "")


def describe_tools(tools: list[dict]) -> str:
    """One line per tool for templates without tool support: `- run_sql(sql: string): ...`."""
    lines = []
    for tool in tools:
        fn = tool["function"]
        properties = fn.get("parameters", {}).get("properties", {})
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in properties.items())
        lines.append(f"- {fn['name']}({args}): {fn.get('description', '')}")
    return "Tools:\n" + "\n".join(lines)


def build_messages(task, tools, inline_tools=True) -> list[dict]:
    """System prompt, the demonstration, then the question. inline_tools: describe the tools in the
    system prompt (for templates that ignore `tools=`; rollout_groups decides with template_takes_tools)."""
    system = SYSTEM_PROMPT + ("\n\n" + describe_tools(tools) if inline_tools else "")
    question = task.question + (f"\nHint: {task.evidence}" if task.evidence else "")
    return [{"role": "system", "content": system}, *DEMONSTRATION, {"role": "user", "content": question}]


def render(tokenizer, messages, tools, add_generation_prompt) -> str:
    """The conversation as text through the chat template (tools= only where the template uses it)."""
    return tokenizer.apply_chat_template(messages, tools=tools if template_takes_tools(tokenizer) else None,
                                         tokenize=False, add_generation_prompt=add_generation_prompt)


TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_tool_call(text) -> tuple[str, dict]:
    """(name, arguments) of the first `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
    Raises ToolCallError, whose message tells the model what was wrong."""
    match = TOOL_CALL_RE.search(text)
    if match is None:
        raise ToolCallError("no <tool_call> found")
    try:
        call = json.loads(match.group(1).strip())
    except json.JSONDecodeError as e:
        raise ToolCallError(f"the tool call is not valid JSON ({e.msg})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('a tool call must be a JSON object with a "name" string')
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):                        # some models double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        raise ToolCallError('"arguments" must be a JSON object')
    return call["name"], args


# ----------------------------------------------------------------------------- rollouts

@dataclass
class Sampling:
    temperature: float = 1.0
    greedy: bool = False       # argmax decoding, for evaluation
    seed: int = 0              # seeds the torch.Generator: same seed, same trajectories
    weight_dtype: torch.dtype | None = None   # the merged layers' and the lm_head's weights while generating
                               #   (None: fp32 merged, the head as it is); the log-probs are that policy's


@dataclass
class Limits:
    max_turns: int = 3         # assistant turns per trajectory
    max_new_tokens: int = 128  # sampled tokens per turn
    max_context: int = 2048    # tokens per trajectory, prompt included


@dataclass
class Trajectory:
    task_id: str
    messages: list[dict]            # the full conversation; decode(token_ids) == its chat-template rendering
    token_ids: list[int]            # (T,) exact tokens the model saw or sampled, in order
    assistant_mask: list[int]       # (T,) 1 only on sampled tokens
    sampled_logprobs: list[float]   # (T,) log p(token_t | tokens_<t) under the raw model (temperature 1),
                                    #      0.0 where the mask is 0
    submitted_sql: str | None
    correct: bool
    stop_reason: str                # submitted | no_tool_call | max_turns | max_new_tokens | max_context
                                    #   | non_finite_logits
    num_turns: int
    num_tool_calls: int
    num_tool_errors: int            # malformed calls + calls the environment answered with an error
    num_describe_calls: int = 0     # describe_table calls (SQLEnv counts them; 0 from an env that does not)
    failed_submission: bool = False # the submitted query failed to run (no such table, syntax, timeout)
    turns: list[tuple[int, int]] = field(default_factory=list)   # where each turn after the prompt starts:
                                    #   (index in token_ids, index in messages)


@dataclass
class TrajectoryGroup:
    task: object
    trajectories: list[Trajectory]
    tree: Node                      # an empty root; its child, the prompt; below it, one node a turn


def make_group(task, trajectories) -> TrajectoryGroup:
    """The trajectories with their tree (tree.py): each trajectory cut at its recorded turns (the
    prompt; a turn and the tool's answer; ...) into runs. A trajectory without turns is one run."""
    paths = []
    for t in trajectories:
        bounds = [(0, 0), *t.turns, (len(t.token_ids), len(t.messages))]
        paths.append([(start, t.token_ids[start:end], t.messages[first:last])
                      for (start, first), (end, last) in zip(bounds, bounds[1:])])
    return TrajectoryGroup(task, trajectories, build_tree(paths))


@dataclass
class _Row:
    """One trajectory being generated (engine-internal)."""
    task: object
    env: object
    tools: list[dict]
    messages: list[dict]
    token_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    forced: list[list[int]]                         # per turn: tokens to emit instead of sampling
    turn_start: int = 0                             # index in token_ids where this turn's tokens begin
    text_len: int = 0                               # len(decode(token_ids[:turn_start]))
    pending: list[int] = field(default_factory=list)  # tokens to append, waiting for the next flush
    turns: list[tuple[int, int]] = field(default_factory=list)  # Trajectory.turns
    stop_reason: str = ""
    num_turns: int = 0
    num_tool_calls: int = 0
    num_parse_errors: int = 0


def decode(tokenizer, ids) -> str:
    """Tokens to text, exactly: special tokens kept, no clean-up of spaces."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encode(tokenizer, text) -> list[int]:
    """Text to tokens, no special tokens added (the chat template writes them)."""
    return tokenizer(text, add_special_tokens=False).input_ids


def stop_token_ids(tokenizer) -> set[int]:
    """The token that ends an assistant turn: the one the chat template writes right after an
    assistant message (<|im_end|>, <|eot_id|>, ...). Another end token (Qwen2.5's <|endoftext|>, say)
    would leave a turn that the template re-renders differently; sampled mid-turn, it is text."""
    probe = "The answer is 42."
    rendered = render(tokenizer, [{"role": "user", "content": "Question?"},
                                  {"role": "assistant", "content": probe}], [], add_generation_prompt=False)
    closing = encode(tokenizer, rendered[rendered.rindex(probe) + len(probe):])
    assert closing, "the chat template writes nothing after an assistant message: no token ends a turn"
    return {closing[0]}


def _sample(logits, sampling: Sampling, generator) -> torch.Tensor:
    """Next tokens (B,) from logits (B, V): greedy, or sampled at the temperature."""
    if sampling.greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)     # (B, V)
    # the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is a sample from p (the Gumbel-max
    # trick in another guise), cheaper than torch.multinomial over a large V
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)     # (B, V)
    return (probs / race).argmax(-1)


def rollout_group(model, tokenizer, task, n, sampling=Sampling(), limits=Limits(), **kw) -> TrajectoryGroup:
    """N trajectories for one task (see rollout_groups)."""
    return rollout_groups(model, tokenizer, [task], n, sampling, limits, **kw)[0]


@torch.no_grad()
def rollout_groups(model, tokenizer, tasks, n, sampling=Sampling(), limits=Limits(),
                   make_env=None, forced_turns=None, max_rows=None, rows=None) -> list[TrajectoryGroup]:
    """N trajectories for each task, decoded in one batch (the steps in the module docstring): one
    TrajectoryGroup per task, in task order, with its tree. The same seed gives the same trajectories.

    make_env: task -> environment (default sql_env.SQLEnv) with .tools, .call(name, args), .done,
        .submitted_sql, .correct, .num_tool_errors.
    forced_turns: a test hook: forced_turns[i][k] is a text row i (task-major: task g, sample j is
        row g*n + j) emits at the start of turn k instead of sampling; its log-probs are the model's.
    max_rows: at most this many rows decode at once (default: all G*N); the others join at flushes,
        in task order, in the places of finished rows (continuous batching).
    rows: the rows to go on from, _start_rows' (branch_groups moves some on first); default, the prompts."""
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
        rows = rows or _start_rows(tasks, n, tokenizer, limits, make_env or SQLEnv, forced_turns)
        prompts = [row.token_ids for row in rows]
        prefix = KVCache(model.config)
        prefix_len = common_prefix_length(prompts, limit=min(map(len, prompts)) - 1)
        forward(torch.tensor([prompts[0][:prefix_len]], device=device),
                torch.ones((1, prefix_len), dtype=torch.long, device=device), prefix)
        for row in rows:
            row.pending = row.token_ids[prefix_len:]     # the first feed: at least one token of its own

        cache = KVCache(model.config, capacity=max(map(len, prompts)) + limits.max_new_tokens)
        mask = torch.zeros((0, 0), dtype=torch.long, device=device)       # (B, S): 1 real token, 0 hole
        waiting = list(range(len(rows)))[::-1]   # rows not started yet, the next one last
        active, logits = [], None                # active[b] = index into rows of cache row b; logits (B, V)
        max_rows = max_rows or len(rows)

        while active or waiting:
            # 2) every active row that is mid-turn takes its next token: forced, greedy or sampled
            feed = {}                       # r -> tokens to feed in the next forward
            if active:
                chosen, chosen_logprobs, finite = _next_tokens(logits, [rows[r] for r in active], sampling,
                                                               generator)
            # 3) end turns: run tools, queue the appended tokens, close finished rows
            for b, r in enumerate(active):
                row = rows[r]
                if row.pending:             # waiting for the flush: not mid-turn, fed a hole
                    continue
                if not finite[b]:           # an overflow upstream: no token to take, the row ends here
                    _end_turn(row, limits, tokenizer, truncated="non_finite_logits")
                    continue
                _take_token(row, chosen[b], chosen_logprobs[b], stop_ids, limits, tokenizer)
                if row.pending:
                    row.pending.insert(0, chosen[b])      # the call's last token is not in the cache yet
                elif not row.stop_reason:
                    feed[r] = [chosen[b]]

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
    trajectories = [_trajectory(row) for row in rows]
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


def _start_rows(tasks, n, tokenizer, limits, make_env, forced_turns=None):
    """The rows of a rollout, task-major (task g, sample j is row g*n + j), each with its own
    environment and the task's prompt: system prompt with the tools, the demonstration, the
    question, through the chat template."""
    rows = []
    inline_tools = not template_takes_tools(tokenizer)
    for task in tasks:
        envs = [make_env(task) for _ in range(n)]
        messages = build_messages(task, envs[0].tools, inline_tools=inline_tools)
        prompt = encode(tokenizer, render(tokenizer, messages, envs[0].tools, add_generation_prompt=True))
        assert len(prompt) < limits.max_context, \
            f"prompt of {len(prompt)} tokens exceeds max_context={limits.max_context}"
        for env in envs:
            forced = [encode(tokenizer, text) for text in forced_turns[len(rows)]] if forced_turns else []
            row = _Row(task, env, envs[0].tools, [dict(m) for m in messages], list(prompt),
                       [0] * len(prompt), [0.0] * len(prompt), forced, turn_start=len(prompt),
                       text_len=len(decode(tokenizer, prompt)), turns=[(len(prompt), len(messages))])
            rows.append(row)
    return rows


def _go_to(row, trajectory, k, tokenizer):
    """Put a fresh row in the state `trajectory` reached after k turns: its tokens, with mask 0 (the
    trajectory sampled them and is credited for them; this row trains only on what it samples), its
    messages, and the environment, brought there by making the trajectory's k tool calls again (its
    counters; the messages stay the trajectory's, should a query answer differently, a timeout say)."""
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
    (`_go_to`), sampled from there; a group with no such state gets rows from the prompt. The state is
    drawn uniformly over the trajectories' turn boundaries (a state m of them share, m times as
    often), or (rule "entropy", after ARPO, arXiv:2507.19849) in proportion to the entropy of the
    turn the trajectory sampled there (-log p of its first 8 tokens over 8; a shorter turn's tool
    tokens count 0): where the policy was unsure. The copied part is fed once per distinct state in
    one forward, never decoded again. Returns the groups with their new trees."""
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
        if k:
            _go_to(row, trajectory, k, tokenizer)
    sampling = replace(sampling, seed=sampling.seed + 2**32)      # a stream no other rollout's seed gives
    branched = rollout_groups(model, tokenizer, tasks, more, sampling, limits, max_rows=max_rows, rows=rows)
    return [make_group(g.task, g.trajectories + b.trajectories) for g, b in zip(groups, branched)]


def _next_tokens(logits, rows, sampling, generator):
    """A token for each row from its logits (B, V): greedy or sampled, or the row's forced token.
    Log-probs under the raw distribution (temperature 1). Returns (tokens, log-probs,
    finite), B each."""
    logprobs = torch.log_softmax(logits, dim=-1)                                      # (B, V)
    chosen = _sample(logits, sampling, generator)                                     # (B,)
    for b, row in enumerate(rows):
        if (forced := _forced_token(row)) is not None:
            chosen[b] = forced
    chosen_logprobs = logprobs.gather(1, chosen[:, None])[:, 0]                       # (B,)
    return chosen.tolist(), chosen_logprobs.tolist(), torch.isfinite(logits).all(-1).tolist()


def _forced_token(row) -> int | None:
    """The row's next token where it is scripted (forced_turns, a test hook), else None."""
    turn, done = row.num_turns, len(row.token_ids) - row.turn_start
    return row.forced[turn][done] if turn < len(row.forced) and done < len(row.forced[turn]) else None


def _take_token(row, token, logprob, stop_ids, limits, tokenizer):
    """Append a sampled token to a mid-turn row; end the turn on a stop token, a closed tool call
    (looked for in this turn's tokens only), or a limit."""
    row.token_ids.append(token)
    row.mask.append(1)
    row.logprobs.append(logprob)
    eos = token in stop_ids
    recent = row.token_ids[max(row.turn_start, len(row.token_ids) - 12):]
    if eos or "</tool_call>" in decode(tokenizer, recent):
        _end_turn(row, limits, tokenizer, truncated=None, eos=eos)
    elif len(row.token_ids) - row.turn_start >= limits.max_new_tokens:
        _end_turn(row, limits, tokenizer, truncated="max_new_tokens")
    elif len(row.token_ids) >= limits.max_context:
        _end_turn(row, limits, tokenizer, truncated="max_context")


def _trajectory(row) -> Trajectory:
    return Trajectory(row.task.id, row.messages, row.token_ids, row.mask, row.logprobs, row.env.submitted_sql,
                      bool(row.env.correct), row.stop_reason, row.num_turns, row.num_tool_calls,
                      row.num_parse_errors + row.env.num_tool_errors,
                      # behaviour counters of sql_env.SQLEnv; an environment without them reports none
                      num_describe_calls=getattr(row.env, "num_describe_calls", 0),
                      failed_submission=getattr(row.env, "submit_error", None) is not None, turns=row.turns)


def _end_turn(row: _Row, limits: Limits, tokenizer, truncated: str | None, eos: bool = False):
    """Close the assistant turn that just ended: record the message, run the tool, then either
    queue the next turn's tokens in row.pending or finish the row (row.stop_reason)."""
    # the turn's text, decoded in context (exact for any tokenizer), minus a sampled stop token
    sampled_end = len(row.token_ids) - 1 if eos else len(row.token_ids)
    content = decode(tokenizer, row.token_ids[:sampled_end])[row.text_len:]
    row.messages.append({"role": "assistant", "content": content})
    row.num_turns += 1
    if truncated:
        return _finish(row, truncated, tokenizer)
    if "<tool_call>" not in content:                # a final answer without submission: scores wrong
        return _finish(row, "no_tool_call", tokenizer)
    row.num_tool_calls += 1
    try:
        name, args = parse_tool_call(content)
        observation = row.env.call(name, args)
    except ToolCallError as e:
        row.num_parse_errors += 1
        observation = f'Error: {e}. Write <tool_call>{{"name": "...", "arguments": {{...}}}}</tool_call>'
    row.messages.append({"role": "tool", "content": observation})
    if row.env.done:
        return _finish(row, "submitted", tokenizer)
    if row.num_turns >= limits.max_turns:
        return _finish(row, "max_turns", tokenizer)
    # the new tokens: end of turn + tool message + next assistant header, as the template renders them
    text = decode(tokenizer, row.token_ids)
    rendered = render(tokenizer, row.messages, row.tools, add_generation_prompt=True)
    assert rendered.startswith(text), "the chat template re-renders earlier turns differently; cannot append"
    suffix = encode(tokenizer, rendered[len(text):])
    if len(row.token_ids) + len(suffix) + 1 > limits.max_context:
        row.messages.pop()                          # no room for the tool result and one more token
        return _finish(row, "max_context", tokenizer)
    row.pending = suffix
    row.token_ids += suffix
    row.mask += [0] * len(suffix)
    row.logprobs += [0.0] * len(suffix)
    row.turn_start, row.text_len = len(row.token_ids), len(decode(tokenizer, row.token_ids))
    row.turns.append((row.turn_start, len(row.messages)))


def _finish(row: _Row, reason: str, tokenizer):
    """Stop the row; append the closing tokens (end of turn, last tool message) the template
    renders, so decode(token_ids) equals the rendering of messages. They are never fed to the model."""
    row.stop_reason = reason
    text = decode(tokenizer, row.token_ids)
    rendered = render(tokenizer, row.messages, row.tools, add_generation_prompt=False)
    assert rendered.startswith(text), "the chat template re-renders earlier turns differently"
    closing = encode(tokenizer, rendered[len(text):])
    row.token_ids += closing
    row.mask += [0] * len(closing)
    row.logprobs += [0.0] * len(closing)


# ----------------------------------------------------------------------------- demonstrations (SFT)
DEMO_TURNS = 4     # the assistant turns a demonstration needs: list, describe (a table or more), run, submit


def scripted_trajectory(tokenizer, task, turns, limits=Limits(), make_env=None) -> Trajectory:
    """The trajectory a rollout records when the model emits exactly `turns` (one text per
    assistant turn, each ending in </tool_call>), built with the tokenizer alone: the same
    prompt, the same appended tool tokens and masks as rollout_groups(forced_turns=[turns]),
    with no forward pass. sampled_logprobs are 0.0 (unknown without the model). For SFT."""
    env = (make_env or SQLEnv)(task)
    messages = build_messages(task, env.tools, inline_tools=not template_takes_tools(tokenizer))
    prompt = encode(tokenizer, render(tokenizer, messages, env.tools, add_generation_prompt=True))
    row = _Row(task, env, env.tools, messages, list(prompt), [0] * len(prompt), [0.0] * len(prompt), [],
               turn_start=len(prompt), text_len=len(decode(tokenizer, prompt)),
               turns=[(len(prompt), len(messages))])
    for text in turns:
        assert not row.stop_reason, f"turn {text!r} comes after the episode ended ({row.stop_reason})"
        ids = encode(tokenizer, text)
        assert len(ids) < limits.max_new_tokens, f"turn of {len(ids)} tokens exceeds max_new_tokens"
        row.token_ids += ids
        row.mask += [1] * len(ids)
        row.logprobs += [0.0] * len(ids)
        _end_turn(row, limits, tokenizer, truncated=None)
        row.pending = []            # the engine would feed these; here they are already in token_ids
    if not row.stop_reason:
        _finish(row, "max_turns", tokenizer)
    return _trajectory(row)


def gold_turns(task, max_turns=None) -> list[str]:
    """The demonstration an SFT warm start imitates, one text per assistant turn: list the tables,
    describe the tables the gold query reads (sql_env.tables_read, in the order the query names
    them; as many as max_turns leaves room for), run the gold query, submit it. The gold query is
    assumed to run (the embedded set checks every one)."""
    assert max_turns is None or max_turns >= DEMO_TURNS, f"a demonstration needs {DEMO_TURNS} turns"
    tables = tables_read(task.db_path, task.gold_sql)
    room = len(tables) if max_turns is None else max_turns - 3
    return ([tool_call_text("list_tables", {})]
            + [tool_call_text("describe_table", {"table": t}) for t in tables[:room]]
            + [tool_call_text(name, {"query": task.gold_sql}) for name in ("run_sql", "submit_answer")])


def demonstration(tokenizer, task, limits=Limits()) -> Trajectory:
    """A gold demonstration as a rollout records it (scripted_trajectory of gold_turns), with the
    mask cleared on each turn the environment answered with an error (a gold query too slow or
    too large for the tool): the warm start never imitates a turn that failed."""
    trajectory = scripted_trajectory(tokenizer, task, gold_turns(task, limits.max_turns), limits)
    first = len(build_messages(task, [])) + 1        # the first tool message: prompt, then assistant, tool
    failed = [m["content"].startswith("Error:") for m in trajectory.messages[first::2]]
    turn, sampled = -1, list(trajectory.assistant_mask)
    for i, m in enumerate(sampled):
        turn += m and (i == 0 or not sampled[i - 1])    # the first token of the next sampled turn
        if m and turn < len(failed) and failed[turn]:
            trajectory.assistant_mask[i] = 0
    return trajectory
