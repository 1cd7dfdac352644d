"""The agent: the chat/tool-call format and a multi-turn rollout engine that reuses the KV cache by hand.

    model, tokenizer = lora.load_model()                # the policy (lora.py: loading and the LoRA)
    group = rollout_group(model, tokenizer, task, n=8, sampling=Sampling(seed=0), limits=Limits())
    group.trajectories[0].token_ids                     # exactly what GRPO will train on
    demo = demonstration(tokenizer, task, kind="look")  # a gold demonstration for SFT, as a rollout records it

    python agentrl.py --db shop.sqlite --adapter runs/default "How many orders were placed in May?"
    python agentrl.py --db shop.sqlite --adapter runs/default  # questions from standard input, one a line

An episode is a conversation: the system prompt (with the tools), a worked example, the question;
then turns in which the model writes one `<tool_call>{json}</tool_call>` and the environment
answers with a tool message, until it calls `submit_answer`. A trajectory records every token
the model saw or sampled, in order, with a mask (1 on sampled tokens) and each sampled token's
log-prob: what the update trains on, never a re-tokenization of the messages.

How `rollout_groups` turns G tasks into G groups of N trajectories (B = G*N rows):
  1) the prompts' common prefix (system prompt with the tools, the worked example: all but the
     question) is encoded ONCE, into a one-row cache every row starts from; the rest of each
     prompt is the row's first feed;
  2) all rows decode together, one token per forward, or (Sampling.draft) one and the drafts it
     confirms, guessed from the row's own context (`_draft`); each sampled token is recorded with
     its log-prob under the raw model distribution (temperature 1, no top-p: the policy GRPO trains);
  3) a row whose turn ends with `<tool_call>{json}</tool_call>` runs the tool; the new text
     (end of turn + tool message + next assistant header) is taken from the chat template as a
     suffix of what is already rendered, tokenized, and queued for that row;
  4) a row stops on `submit_answer`, a missing call, max turns, max tokens per turn, the
     context limit, or non-finite logits (fp16 overflow: there is no distribution to sample
     from) (`Trajectory.stop_reason`); finished rows leave the batch;
  5) once no row is mid-turn (the flush), the cache is packed (each row's real columns moved
     left, columns that are holes in every row cut), rows still waiting join in the places of
     finished ones (with `max_rows`, continuous batching), and every row's queue is fed at once;
  6) one forward feeds every row what it was given: a sampled token (and its drafts), or a queue.

Asking a trained agent (`main`, at the end of this file) is the same engine on one row, greedy,
on a Task with no gold SQL, with an `on_message` hook that prints each tool call and a short view
of its observation as the row records them.

Rows are ragged, so the cache is a (B, S) rectangle with holes. The attention mask marks real
tokens 1 and holes 0, and every forward passes explicit position ids computed from the mask
(cumsum - 1): a token's position is the number of real tokens before it in its own row, the
same number a fresh forward over the row's token ids gives it. Shapes: B rows, S cache
columns, W tokens fed in one forward, V vocabulary, N samples per task, G tasks, P prompt length.

Deliberate simplifications, and why they are safe:
- Appends are turn-synchronous: a row that called a tool waits (fed holes) until no row is
  mid-turn, then all waiting rows append in one forward. Appending whenever a row is ready
  would add one full-width column block per row per turn; waiting, then packing, keeps the
  cache as wide as the longest row. A waiting row costs one row of a decode step.
- One tool call per turn: generation stops at `</tool_call>`, so a second call is never made.
- The KV cache is our own (`KVCache`, at the end of this file): transformers' DynamicCache grows
  by torch.cat, so every decode step allocates a new tensor per layer and copies the whole past
  into it (one more read and write of the entire cache per token). KVCache preallocates, writes
  only the new columns, and grows GROW_COLUMNS at a time when full; it still goes through the model's own
  forward and attention. It holds full-attention layers only (Llama, Qwen2, SmolLM2).
- Logits are projected for the last columns only, one per row and one per draft (the lm_head runs
  on those hidden states): full-vocabulary logits are never made for a whole prompt or tool result.
- A waiting row still samples a token each step, which is then ignored: one (B, C, V) sample
  is cheaper than gathering the rows that need it.
"""
import argparse
import copy
import json
import re
import textwrap
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from transformers.cache_utils import Cache, CacheLayerMixin

import lora
from sql_env import SQLEnv, SQLError, Task, database_tables, run_query, tables_read

# ----------------------------------------------------------------------------- chat and tools

SYSTEM_PROMPT = """You are a SQL agent. Answer the user's question about a SQLite database with tool calls only, one per turn, never with prose.
A tool call is one line: <tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call>"""

# One worked exchange before the real question. A small model like SmolLM2-135M answers in prose
# whatever the system prompt says, but copies the format of a demonstration. Its tokens have mask 0.
_CALL = '<tool_call>{{"name": "{}", "arguments": {{"query": "SELECT COUNT(*) FROM orders"}}}}</tool_call>'
DEMONSTRATION = [
    {"role": "user", "content": "How many orders are there?"},
    {"role": "assistant", "content": _CALL.format("run_sql")},
    {"role": "tool", "content": "COUNT(*)\n1520"},
    {"role": "assistant", "content": _CALL.format("submit_answer")},
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
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in fn.get("parameters", {}).get("properties", {}).items())
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
    top_p: float = 1.0
    greedy: bool = False       # argmax decoding, for evaluation
    seed: int = 0              # seeds the torch.Generator: same seed, same trajectories
    draft: int = 0             # prompt-lookup draft tokens a row checks per forward (0: one token a forward);
                               #   the tokens keep their distribution (greedy: the same tokens), see _draft
    weight_dtype: torch.dtype | None = None   # the merged layers' and the lm_head's weights while generating
                               #   (None: fp32 merged, the head as the model holds it); torch.bfloat16 reads
                               #   half the bytes, and a sampled rollout then records that policy's log-probs
                               #   (lora.lora_merged; grpo.py: the update's ratio corrects for it)


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
    sampled_logprobs: list[float]   # (T,) log p(token_t | tokens_<t) under the raw model (temperature 1,
                                    #      no top-p), 0.0 where the mask is 0
    submitted_sql: str | None
    correct: bool
    stop_reason: str                # submitted | no_tool_call | max_turns | max_new_tokens | max_context
                                    #   | non_finite_logits
    num_turns: int
    num_tool_calls: int
    num_tool_errors: int            # malformed calls + calls the environment answered with an error
    num_describe_calls: int = 0     # describe_table calls (SQLEnv counts them; 0 from an env that does not)
    failed_submission: bool = False # the submitted query itself failed to run (no such table, syntax, timeout)


@dataclass
class TrajectoryGroup:
    task: object
    trajectories: list[Trajectory]


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
    drafts: list[int] = field(default_factory=list)   # tokens fed after the row's last one, to be checked (_draft)
    stop_reason: str = ""
    num_turns: int = 0
    num_tool_calls: int = 0
    num_parse_errors: int = 0
    on_message: object = None                       # called with each message as it is recorded, or None


class _Chat:
    """Text <-> tokens for the engine: exact decoding, no special tokens added, template rendering."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode(self, text) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def render(self, row, add_generation_prompt) -> str:
        return render(self.tokenizer, row.messages, row.tools, add_generation_prompt)


def stop_token_ids(model, tokenizer) -> set[int]:
    """Tokens that end an assistant turn: of eos, the generation config's eos list, <|im_end|> and
    <|eot_id|>, those the chat template itself writes right after an assistant message. Another
    (Qwen2.5's <|endoftext|>, say) would leave a turn that the template re-renders differently, so
    the rows could not be extended; sampled mid-turn, it is text like any other."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    ids.update(tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|eot_id|>") if t in tokenizer.get_vocab())
    probe = "The answer is 42."
    rendered = render(tokenizer, [{"role": "user", "content": "Question?"}, {"role": "assistant", "content": probe}],
                      [], add_generation_prompt=False)
    after = rendered[rendered.rindex(probe) + len(probe):]       # what the template writes to close the turn
    stops = {i for i in ids if i is not None and after.startswith(tokenizer.decode([i]))}
    assert stops, f"no stop token candidate ({sorted(i for i in ids if i is not None)}) closes a turn in this chat template"
    return stops


def _sample(logits, sampling: Sampling, generator) -> torch.Tensor:
    """Next tokens (B, C) from logits (B, C, V): greedy, or temperature + nucleus (top-p) sampling."""
    if sampling.greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)     # (B, C, V)
    if sampling.top_p < 1.0:   # keep the smallest set of tokens whose mass reaches top_p
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= sampling.top_p                # mass before this token
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    # the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is a sample from p (the Gumbel-max
    # trick in another guise), and several times faster than torch.multinomial over a large V
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)     # (B, C, V)
    return (probs / race).argmax(-1)


def rollout_group(model, tokenizer, task, n, sampling=Sampling(), limits=Limits(), **kw) -> TrajectoryGroup:
    """N trajectories for one task (see rollout_groups)."""
    return rollout_groups(model, tokenizer, [task], n, sampling, limits, **kw)[0]


@torch.no_grad()
def rollout_groups(model, tokenizer, tasks, n, sampling=Sampling(), limits=Limits(),
                   make_env=None, forced_turns=None, stats=None, on_message=None, max_rows=None,
                   share_histories=True) -> list[TrajectoryGroup]:
    """N trajectories for each task, decoded in one batch (the steps in the docstring).

    make_env: task -> environment (default sql_env.SQLEnv), with .tools, .call(name, args), .done,
        .submitted_sql, .correct, .num_tool_errors.
    forced_turns: a test hook. forced_turns[i][k] is a text that row i (rows are task-major:
        task g, sample j is row g*n + j) emits at the start of turn k instead of sampling; the
        row then samples on. The log-probs recorded for forced tokens are still the raw model's.
    stats: a dict to fill with engine counters (forward_s, total_s, forwards, fed_tokens, ...; the
        flushes' forwards alone under flush_*: flush_forward_s, flush_forwards, flush_fed_tokens, ...).
    on_message: called as on_message(row, message) when a row records an assistant turn or a tool
        message, while the batch is still decoding: to show an episode as it happens.
    max_rows: at most this many rows decode at once (default: all G*N). The others wait in task
        order and join at a flush, in the places of finished rows (continuous batching), so one
        call runs a whole evaluation without waiting on the slowest row of each batch.
    share_histories: at a flush, rows whose tokens so far are the same (a group's samples, through
        the turns they agree on: the rest of the prompt, the same first calls and tool results) are
        fed once, in one row, and the cache row and logits copied to the others. False: every row
        fed (bench.py rollout's baseline)."""
    if not tasks:       # a process whose share of a step or an evaluation is empty (torchrun, few tasks)
        return []
    t_start, was_training = time.perf_counter(), model.training
    model.eval()
    generator = torch.Generator(device=model.device).manual_seed(sampling.seed)
    stop_ids, pad_id, chat = stop_token_ids(model, tokenizer), tokenizer.pad_token_id or 0, _Chat(tokenizer)
    forward = _Forward(model, sampling.weight_dtype)
    counters = dict(prompt_tokens=0, appended_tokens=0, non_finite_rows=0, packed_columns=0, drafted_tokens=0,
                    accepted_drafts=0)

    with lora.lora_merged(model, sampling.weight_dtype):   # one weight a layer while generating (lora.py says why)
        # 1) the prompts' common prefix (system prompt, tools, worked example) is encoded ONCE, into a
        #    one-row cache every row starts from; each row's own rest of the prompt waits to be fed
        rows, prompts = _start_rows(tasks, n, chat, limits, make_env or SQLEnv, forced_turns, on_message)
        prefix, prefix_len = KVCache(model.config), _common_prefix_length(prompts)
        forward(torch.tensor([prompts[0][:prefix_len]], device=model.device),
                torch.ones((1, prefix_len), dtype=torch.long, device=model.device), prefix, flush=True)
        for r, row in enumerate(rows):
            row.pending = prompts[r // n][prefix_len:]
        counters["prompt_tokens"] = prefix_len

        cache = KVCache(model.config, capacity=max(map(len, prompts)) + limits.max_new_tokens)
        mask = torch.zeros((0, 0), dtype=torch.long, device=model.device)       # (B, S): 1 real token, 0 hole
        waiting = list(range(len(rows)))[::-1]   # rows not started yet, the next one last
        active, logits = [], None                # active[b] = index into rows of cache row b; logits (B, C, V)
        max_rows = max_rows or len(rows)

        while active or waiting:
            # 2) every active row that is mid-turn takes its next tokens: forced, greedy or sampled, one
            #    from each of the row's C logit columns while they confirm its drafts (see _draft)
            feed = {}                       # r -> tokens to feed in the next forward
            if active:
                chosen, chosen_logprobs, finite = _next_tokens(logits, [rows[r] for r in active], sampling, generator)
            # 3) end turns: run tools, queue the appended tokens, close finished rows
            for b, r in enumerate(active):
                row = rows[r]
                if row.pending:             # waiting for the flush: not mid-turn, fed a hole
                    continue
                drafts, row.drafts, in_cache = row.drafts, [], 0   # in_cache: the drafts the row took (real tokens in the cache)
                for column in range(logits.shape[1] - 1 - len(drafts), logits.shape[1]):
                    if not finite[b][column]:       # an overflow upstream: no token to take, the row ends here
                        counters["non_finite_rows"] += 1
                        _end_turn(row, limits, chat, truncated="non_finite_logits")
                        break
                    token = chosen[b][column]
                    _take_token(row, token, chosen_logprobs[b][column], stop_ids, limits, chat)
                    counters["appended_tokens"] += len(row.pending)   # a tool message and the next header, if the turn ended
                    if in_cache < len(drafts) and token == drafts[in_cache]:
                        in_cache += 1               # the draft confirmed: already fed, its logits in the next column
                        if row.pending or row.stop_reason:
                            break
                        continue
                    if row.pending:
                        row.pending.insert(0, token)       # the call's last token is not in the cache yet
                    elif not row.stop_reason:              # still mid-turn: the token, and drafts to check
                        row.drafts = [] if _forced_token(row) is not None else _draft(row.token_ids, sampling.draft)
                        feed[r] = [token] + row.drafts
                        counters["drafted_tokens"] += len(row.drafts)
                    break
                counters["accepted_drafts"] += in_cache
                if in_cache < len(drafts):          # the drafts after the first refused one are holes from now on
                    mask[b, mask.shape[1] - (len(drafts) - in_cache):] = 0

            # 4) drop finished rows from the batch (cache, mask and their bookkeeping)
            keep = [b for b, r in enumerate(active) if not rows[r].stop_reason]
            if len(keep) < len(active):
                index = torch.tensor(keep, dtype=torch.long, device=model.device)
                cache.batch_select_indices(index)
                mask = mask[index]
                active = [active[b] for b in keep]

            # 5) the turn-synchronous flush: once no row is mid-turn, pack the cache (drop hole columns),
            #    let waiting rows join with the prefix, and feed every row its queued tokens at once
            flush = not feed
            if flush:
                mask, dropped = _pack_left(cache, mask)
                counters["packed_columns"] += dropped
                joining = [waiting.pop() for _ in range(min(len(waiting), max_rows - len(active)))]
                if joining:
                    cache.add_rows(prefix, len(joining))          # the prefix, then holes up to the cache's width
                    width = cache.get_seq_length()
                    new_mask = (torch.arange(width, device=model.device) < prefix_len).long().expand(len(joining), -1)
                    mask = torch.cat([nn.functional.pad(mask, (0, width - mask.shape[1])), new_mask])   # holes to the width
                    active += joining
                for r in active:
                    feed[r], rows[r].pending = rows[r].pending, []
                    if rows[r].num_turns == 0:      # a row's first feed is the rest of its prompt
                        counters["prompt_tokens"] += len(feed[r])
            if not active:
                break

            # 6) one forward for all rows over what they were fed; logits for each row's last token and
            #    its drafts (right-aligned, so the last C columns, C = 1 + the most drafts of a row). At a
            #    flush, a row's cache and feed hold its tokens so far, so rows with the same tokens end
            #    the forward with the same cache row (packed left) and logits: the forward takes one of
            #    each (`firsts`), and its cache row and logits are copied back to all (`which`)
            firsts, which = (_distinct_histories([rows[r] for r in active]) if flush and share_histories
                             else (range(len(active)), None))
            shared = len(firsts) < len(active)
            if shared:
                cache.batch_select_indices(torch.tensor(firsts, device=model.device))
                mask = mask[firsts]
            fed = [feed.get(active[b], []) for b in firsts]
            ids, new_mask = _right_aligned(fed, pad_id, model.device)                   # (B, W) each
            mask = torch.cat([mask, new_mask], dim=1)                                    # (B, S+W)
            columns = 1 + max(len(rows[r].drafts) for r in active)
            logits = forward(ids, mask, cache, columns, flush)     # (B, C, V); a waiting row's are unused
            if shared:
                index = torch.tensor(which, device=model.device)
                cache.batch_select_indices(index)
                mask, logits = mask[index], logits[index]

    model.train(was_training)
    if stats is not None:
        stats.update(counters, **forward.counters, **{"flush_" + k: v for k, v in forward.flushes.items()},
                     forward_s=forward.seconds, total_s=time.perf_counter() - t_start,
                     generated_tokens=sum(sum(row.mask) for row in rows))
    trajectories = [_trajectory(row) for row in rows]
    return [TrajectoryGroup(task, trajectories[g * n:(g + 1) * n]) for g, task in enumerate(tasks)]


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


def _common_prefix_length(prompts) -> int:
    """Tokens every prompt starts with, leaving each at least one of its own (the rows' first feed)."""
    length = min(map(len, prompts)) - 1
    for prompt in prompts[1:]:
        length = next((i for i in range(length) if prompt[i] != prompts[0][i]), length)
    return length


def _pack_left(cache, mask):
    """Move each row's real columns to the left, in order, and cut the columns that are now holes in
    every row. A column's key already holds its position (rotary), and positions come from the mask
    (cumsum - 1), so no token's position or attention changes. Returns (the new mask, columns cut)."""
    real = mask.sum(1)                                                              # (B,)
    width = int(real.max()) if len(mask) else 0     # no rows left: every column goes
    if width == mask.shape[1]:
        return mask, 0
    order = torch.sort(1 - mask, dim=1, stable=True).indices[:, :width]            # (B, width): real columns first
    cache.pack(order, width)
    return (torch.arange(width, device=mask.device) < real[:, None]).long(), mask.shape[1] - width


class _Forward:
    """One forward of the decoder body over new tokens and the cache, then the lm_head on the last
    columns only (a row's token and its drafts): full-vocabulary logits are never made for a whole prompt or tool result (as
    grpo.token_logprobs, the body and the head run apart). Counts and times every call. dtype: the
    head in that precision (Sampling.weight_dtype: a copy; None: the model's own)."""

    def __init__(self, model, dtype=None):
        self.body, self.head, self.device = model.base_model, model.get_output_embeddings(), model.device
        if dtype is not None and self.head.weight.dtype != dtype:
            self.head = copy.deepcopy(self.head).to(dtype)
        self.cache_arg = lora.cache_keyword(self.body)
        # cache_columns: KV columns read (every row reads the whole (B, S+W) cache, holes included);
        # query_key_pairs: attention's work, W new columns each against S+W (bench.py's floor)
        self.counters = dict(forwards=0, fed_tokens=0, fed_columns=0, logit_rows=0, cache_columns=0, query_key_pairs=0)
        self.seconds = 0.0
        self.flushes = dict.fromkeys([*self.counters, "forward_s"], 0)   # the same, and their time, for the flushes alone

    def __call__(self, ids, mask, cache, columns=1, flush=False):
        """ids (B, W) new tokens, mask (B, S+W) over cache + new columns -> logits (B, C, V) fp32 of
        the last C = `columns` new columns. flush: the forward feeds queues (the prompts' prefix, the
        rest of each prompt, tool messages), counted in `flushes` too."""
        t0 = time.perf_counter()
        W = ids.shape[1]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -W:]   # (B, W): real tokens before each, in its row
        hidden = self.body(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                           **{self.cache_arg: cache}).last_hidden_state                     # (B, W, H)
        logits = self.head(hidden[:, W - columns:].to(self.head.weight.dtype)).float()         # (B, C, V)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        counts = dict(forwards=1, fed_tokens=int(mask[:, -W:].sum()), fed_columns=ids.numel(), logit_rows=len(ids) * columns,
                      cache_columns=mask.numel(), query_key_pairs=ids.numel() * mask.shape[1])
        for key, count in counts.items():
            self.counters[key] += count
        if flush:
            for key, count in [*counts.items(), ("forward_s", seconds)]:
                self.flushes[key] += count
        return logits


def _start_rows(tasks, n, chat, limits, make_env, forced_turns, on_message=None):
    """The rows of a rollout, task-major (task g, sample j is row g*n + j), each with its own
    environment and the task's prompt: system prompt with the tools, the demonstration, the
    question, through the chat template. Returns (rows, one prompt's token ids per task)."""
    rows, prompts = [], []
    inline_tools = not template_takes_tools(chat.tokenizer)
    for task in tasks:
        envs = [make_env(task) for _ in range(n)]
        messages = build_messages(task, envs[0].tools, inline_tools=inline_tools)
        prompt = chat.encode(render(chat.tokenizer, messages, envs[0].tools, add_generation_prompt=True))
        assert len(prompt) < limits.max_context, f"prompt of {len(prompt)} tokens exceeds max_context={limits.max_context}"
        prompts.append(prompt)
        for env in envs:
            forced = [chat.encode(text) for text in forced_turns[len(rows)]] if forced_turns else []
            hook = (lambda message, row=len(rows): on_message(row, message)) if on_message else None
            rows.append(_Row(task, env, envs[0].tools, [dict(m) for m in messages], list(prompt),
                             [0] * len(prompt), [0.0] * len(prompt), forced, turn_start=len(prompt),
                             text_len=len(chat.decode(prompt)), on_message=hook))
    return rows, prompts


def _next_tokens(logits, rows, sampling, generator):
    """A token from each of the C logit columns of each row, logits (B, C, V): greedy or sampled, each
    column with its own randomness; a forced token where the row has one left in this turn (such
    a row has no drafts: its token comes from the last column). Log-probs are under the raw
    distribution (temperature 1, no top-p), what a fresh forward gives. Returns (tokens, log-probs,
    finite), lists of B lists of C."""
    logprobs = torch.log_softmax(logits, dim=-1)                                      # (B, C, V)
    chosen = _sample(logits, sampling, generator)                                     # (B, C)
    for b, row in enumerate(rows):
        if (forced := _forced_token(row)) is not None:
            chosen[b, -1] = forced
    chosen_logprobs = logprobs.gather(2, chosen[:, :, None])[:, :, 0]                # (B, C)
    return chosen.tolist(), chosen_logprobs.tolist(), torch.isfinite(logits).all(-1).tolist()


def _forced_token(row) -> int | None:
    """The row's next token where it is scripted (forced_turns, a test hook), else None."""
    turn, done = row.num_turns, len(row.token_ids) - row.turn_start
    return row.forced[turn][done] if turn < len(row.forced) and done < len(row.forced[turn]) else None


def _draft(tokens, k, ngram=3) -> list[int]:
    """Up to k tokens the row may write next, guessed from its own context (prompt lookup decoding,
    Saxena 2023): find the most recent earlier place where the row's last n tokens occur (n = 3,
    else 2) and propose what followed there. An agent copies much of its context: a table name from
    describe_table's answer, the query it ran into submit_answer, the tool-call format from the
    worked example.

    The next forward feeds the row's sampled token and its drafts together, and returns logits
    at each. A token is then drawn from each column in turn, as one token a forward would be; the
    row takes it, and goes on to the next column only while the token drawn equals the draft fed
    there (so the column's context is what the row really wrote). Every token taken is thus drawn
    from the model's distribution given exactly the row's own past: the trajectory has the
    distribution it has without drafts (the same tokens, greedy), and each log-prob is the one a
    fresh forward gives. What a draft saves: a forward of 1 + k tokens a row costs well under
    1 + k forwards of one (the weight matmuls are far from their floor at 16 rows; transformers'
    attention copies the cache for such forwards, lora.ATTENTION does not), and each confirmed
    draft is a forward not run. Refused drafts stay in the cache as holes (mask 0) until
    the next flush packs them away."""
    if k == 0:
        return []
    for n in range(ngram, 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start + n - 1] == tail[-1] and tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def _take_token(row, token, logprob, stop_ids, limits, chat):
    """Append a sampled token to a mid-turn row; end the turn on a stop token, a closed tool call
    (looked for in this turn's tokens only), or a limit."""
    row.token_ids.append(token)
    row.mask.append(1)
    row.logprobs.append(logprob)
    eos = token in stop_ids
    if eos or "</tool_call>" in chat.decode(row.token_ids[max(row.turn_start, len(row.token_ids) - 12):]):
        _end_turn(row, limits, chat, truncated=None, eos=eos)
    elif len(row.token_ids) - row.turn_start >= limits.max_new_tokens:
        _end_turn(row, limits, chat, truncated="max_new_tokens")
    elif len(row.token_ids) >= limits.max_context:
        _end_turn(row, limits, chat, truncated="max_context")


def _right_aligned(chunks, pad_id, device):
    """B token lists as one (B, W) batch, right-aligned with holes (mask 0) on the left, so the last
    column holds every row's newest real token (a row with nothing to feed: all holes).
    Returns (ids, mask), each (B, W)."""
    W = max(map(len, chunks))
    ids = torch.full((len(chunks), W), pad_id, dtype=torch.long)                      # (B, W)
    mask = torch.zeros((len(chunks), W), dtype=torch.long)                            # (B, W)
    for b, chunk in enumerate(chunks):
        if chunk:
            ids[b, W - len(chunk):] = torch.tensor(chunk)
            mask[b, W - len(chunk):] = 1
    return ids.to(device), mask.to(device)


def _trajectory(row) -> Trajectory:
    return Trajectory(row.task.id, row.messages, row.token_ids, row.mask, row.logprobs, row.env.submitted_sql,
                      bool(row.env.correct), row.stop_reason, row.num_turns, row.num_tool_calls,
                      row.num_parse_errors + row.env.num_tool_errors,
                      # behaviour counters of sql_env.SQLEnv; an environment without them reports none
                      num_describe_calls=getattr(row.env, "num_describe_calls", 0),
                      failed_submission=getattr(row.env, "submit_error", None) is not None)


def scripted_trajectory(tokenizer, task, turns, limits=Limits(), make_env=None) -> Trajectory:
    """The trajectory a rollout records when the model emits exactly `turns` (one text per
    assistant turn, each ending in </tool_call>), built with the tokenizer alone: the same
    prompt, the same appended tool tokens and masks as rollout_groups(forced_turns=[turns]),
    with no forward pass. sampled_logprobs are 0.0 (unknown without the model). For SFT."""
    chat, env = _Chat(tokenizer), (make_env or SQLEnv)(task)
    messages = build_messages(task, env.tools, inline_tools=not template_takes_tools(tokenizer))
    prompt = chat.encode(render(tokenizer, messages, env.tools, add_generation_prompt=True))
    row = _Row(task, env, env.tools, messages, list(prompt), [0] * len(prompt), [0.0] * len(prompt), [],
               turn_start=len(prompt), text_len=len(chat.decode(prompt)))
    for text in turns:
        assert not row.stop_reason, f"turn {text!r} comes after the episode ended ({row.stop_reason})"
        ids = chat.encode(text)
        assert len(ids) < limits.max_new_tokens, f"turn of {len(ids)} tokens exceeds max_new_tokens"
        row.token_ids += ids
        row.mask += [1] * len(ids)
        row.logprobs += [0.0] * len(ids)
        _end_turn(row, limits, chat, truncated=None)
        row.pending = []            # the engine would feed these; here they are already in token_ids
    if not row.stop_reason:
        _finish(row, "max_turns", chat)
    return _trajectory(row)


# Demonstrations for the SFT warm start, by kind, with the fewest assistant turns each one takes.
DEMO_KINDS = {"look": 4, "plain": 3, "recover": 4}


def tool_call_text(name, arguments) -> str:
    """One tool call as the agent writes it: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def gold_turns(task, kind="look", max_turns=None) -> list[str]:
    """The demonstration an SFT warm start imitates, one text per assistant turn, by kind:
      plain    list the tables, run the gold query, see its result, submit it;
      look     list the tables, describe the tables the gold query reads (sql_env.tables_read, in
               the order the query names them; as many as max_turns leaves room for), then run
               and submit: read the schema before writing against it;
      recover  list the tables, run the gold query with one table name wrong (its plural
               toggled, the slip a remembered schema makes), get "no such table", run the right
               query, submit it. `demonstration` keeps the slip out of what is imitated. A task
               whose query cannot be misnamed that way gets the plain demonstration.
    The gold query is assumed to run (the embedded set checks every one)."""
    assert kind in DEMO_KINDS, f"demonstration kind {kind!r}: one of {', '.join(DEMO_KINDS)}"
    assert max_turns is None or max_turns >= DEMO_KINDS[kind], f"a {kind} demonstration needs {DEMO_KINDS[kind]} turns"
    run = tool_call_text("run_sql", {"query": task.gold_sql})
    submit = tool_call_text("submit_answer", {"query": task.gold_sql})
    look_first = [tool_call_text("list_tables", {})]
    if kind == "look":
        tables = tables_read(task.db_path, task.gold_sql)
        room = len(tables) if max_turns is None else max_turns - 3
        look_first += [tool_call_text("describe_table", {"table": t}) for t in tables[:room]]
    if kind == "recover":
        wrong = _misnamed(task)
        if wrong is not None:
            look_first.append(tool_call_text("run_sql", {"query": wrong}))
    return look_first + [run, submit]


def _toggle_plural(name) -> str:
    for one, many in (("y", "ies"), ("", "s")):
        if name.lower().endswith(many) and len(name) > len(many) + 1:
            return name[:len(name) - len(many)] + one
    return name[:-1] + "ies" if name.lower().endswith("y") else name + "s"


def _misnamed(task) -> str | None:
    """The gold query with one table's name in the other number (customers -> customer, Store ->
    Stores), outside string literals, if that name exists nowhere in the database so the query
    fails with "no such table"; else None."""
    for table in tables_read(task.db_path, task.gold_sql):
        pattern = re.compile(rf"(?<![.\w]){re.escape(table)}(?!\w)", re.IGNORECASE)
        parts = re.split(r"('(?:[^']|'')*')", task.gold_sql)     # our own gold SQL: literals at odd indices
        wrong = "".join(p if i % 2 else pattern.sub(_toggle_plural(table), p) for i, p in enumerate(parts))
        try:
            run_query(task.db_path, wrong, max_rows=1)
        except SQLError as e:
            if "no such table" in str(e):
                return wrong
    return None


def demonstration(tokenizer, task, kind="look", limits=Limits()) -> Trajectory:
    """A gold demonstration as a rollout records it (scripted_trajectory of gold_turns), with the
    mask cleared on each turn the environment answered with an error: the warm start learns to
    read the error and recover, never to make the mistake."""
    trajectory = scripted_trajectory(tokenizer, task, gold_turns(task, kind, limits.max_turns), limits)
    first = len(build_messages(task, [])) + 1        # the first tool message: prompt, then assistant, tool
    failed = [m["content"].startswith("Error:") for m in trajectory.messages[first::2]]
    turn, sampled = -1, list(trajectory.assistant_mask)
    for i, m in enumerate(sampled):
        turn += m and (i == 0 or not sampled[i - 1])    # the first token of the next sampled turn
        if m and turn < len(failed) and failed[turn]:
            trajectory.assistant_mask[i] = 0
    return trajectory


def _end_turn(row: _Row, limits: Limits, chat, truncated: str | None, eos: bool = False):
    """Close the assistant turn that just ended: record the message, run the tool, then either
    queue the next turn's tokens in row.pending or finish the row (row.stop_reason)."""
    # the turn's text, decoded in context (exact for any tokenizer), minus a sampled stop token
    sampled_end = len(row.token_ids) - 1 if eos else len(row.token_ids)
    content = chat.decode(row.token_ids[:sampled_end])[row.text_len:]
    _record(row, {"role": "assistant", "content": content})
    row.num_turns += 1
    if truncated:
        return _finish(row, truncated, chat)
    if "<tool_call>" not in content:                # a final answer without submission: scores wrong
        return _finish(row, "no_tool_call", chat)
    row.num_tool_calls += 1
    try:
        name, args = parse_tool_call(content)
        observation = row.env.call(name, args)
    except ToolCallError as e:
        row.num_parse_errors += 1
        observation = f'Error: {e}. Write <tool_call>{{"name": "...", "arguments": {{...}}}}</tool_call>'
    _record(row, {"role": "tool", "content": observation})
    if row.env.done:
        return _finish(row, "submitted", chat)
    if row.num_turns >= limits.max_turns:
        return _finish(row, "max_turns", chat)
    # the new tokens: end of turn + tool message + next assistant header, as the template renders them
    text = chat.decode(row.token_ids)
    rendered = chat.render(row, add_generation_prompt=True)
    assert rendered.startswith(text), "the chat template re-renders earlier turns differently; cannot append"
    suffix = chat.encode(rendered[len(text):])
    if len(row.token_ids) + len(suffix) + 1 > limits.max_context:
        row.messages.pop()                          # no room for the tool result and one more token
        return _finish(row, "max_context", chat)
    row.pending = suffix
    row.token_ids += suffix
    row.mask += [0] * len(suffix)
    row.logprobs += [0.0] * len(suffix)
    row.turn_start, row.text_len = len(row.token_ids), len(chat.decode(row.token_ids))


def _record(row: _Row, message: dict):
    """Add a message to the row's conversation, and show it to the caller's hook if there is one."""
    row.messages.append(message)
    if row.on_message:
        row.on_message(message)


def _finish(row: _Row, reason: str, chat):
    """Stop the row; append the closing tokens (end of turn, last tool message) the template
    renders, so decode(token_ids) equals the rendering of messages. They are never fed to the model."""
    row.stop_reason = reason
    text = chat.decode(row.token_ids)
    rendered = chat.render(row, add_generation_prompt=False)
    assert rendered.startswith(text), "the chat template re-renders earlier turns differently"
    closing = chat.encode(rendered[len(text):])
    row.token_ids += closing
    row.mask += [0] * len(closing)
    row.logprobs += [0.0] * len(closing)


# ----------------------------------------------------------------------------- the KV cache
# What the transformers 5.x forward asks of a cache: update(keys, values, layer) -> the keys and
# values to attend, in the order of the mask's columns; get_mask_sizes / get_query_offset /
# get_seq_length -> the length before this forward (asked once, before any layer updates);
# subclassing Cache and CacheLayerMixin gives the rest (the is_sliding lists, isinstance checks).
GROW_COLUMNS = 256    # columns a KVLayer adds when it is full


class KVLayer(CacheLayerMixin):
    """One layer's keys and values in preallocated (rows allocated, kv_heads, capacity, head_dim)
    buffers, of which the first `rows` rows and `length` columns are valid; `update` returns views
    of the valid part. Dropped rows leave their memory allocated, for rows that join later."""

    is_sliding = False
    is_compileable = False       # True would make transformers build a mask at every decode step

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.rows = 0                    # valid rows (the batch) in the buffers
        self.length = 0                  # valid columns (tokens) in the buffers
        self.min_capacity = capacity     # a hint: preallocate this many columns on first use

    def lazy_initialization(self, key_states, value_states):
        self.device, self.dtype = key_states.device, key_states.dtype
        self.rows, capacity = key_states.shape[0], max(self.min_capacity, key_states.shape[-2], 16)
        self.keys, self.values = self._empty(key_states, self.rows, capacity), self._empty(value_states, self.rows, capacity)
        self.is_initialized = True

    def _empty(self, like, rows, capacity):
        return torch.empty((rows, like.shape[1], capacity, like.shape[-1]), dtype=like.dtype, device=like.device)

    def _reserve(self, rows, columns):
        """Make room for `rows` rows and `columns` columns, keeping the valid part. Columns grow by
        GROW_COLUMNS at a time, not by doubling: the copy of the whole cache then comes once every
        256 decode steps (it costs under half of one step's time, so about 0.2% of them), and at most
        256 columns stand empty, where doubling could leave nearly half of the cache unused (the
        evaluation's 16 rows x 2,000 columns of fp32 keys and values are 1.5 GB)."""
        allocated, capacity = self.keys.shape[0], self.keys.shape[-2]
        if rows <= allocated and columns <= capacity:
            return
        rows, capacity = max(rows, allocated), capacity if columns <= capacity else columns + GROW_COLUMNS
        for name in ("keys", "values"):
            old, new = getattr(self, name), self._empty(getattr(self, name), rows, capacity)
            new[:self.rows, :, :self.length].copy_(old[:self.rows, :, :self.length])
            setattr(self, name, new)

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the new (B, kv_heads, W, head_dim) states after the valid part and return the
        (B, kv_heads, length, head_dim) views to attend: W columns written, nothing else copied.
        The views are strided; SDPA reads them as they are."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        self._reserve(self.rows, end)
        self.keys[:self.rows, :, start:end].copy_(key_states)
        self.values[:self.rows, :, start:end].copy_(value_states)
        self.length = end
        return self.keys[:self.rows, :, :end], self.values[:self.rows, :, :end]

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0       # (kv_length, kv_offset), as DynamicLayer

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return -1                                  # grows without bound

    def add_rows(self, source: "KVLayer", count: int):
        """`count` new rows after the valid ones, each a copy of `source`'s first row in its first
        source.length columns and zeros (holes, which the mask hides) after; in rows dropped earlier
        when there are enough, so a batch that keeps its size allocates nothing."""
        if not self.is_initialized:
            self.lazy_initialization(source.keys[:0, :, :0], source.values[:0, :, :0])
        length, first, end = max(self.length, source.length), self.rows, self.rows + count
        self._reserve(end, length)
        for name in ("keys", "values"):
            buf = getattr(self, name)
            buf[first:end, :, :source.length] = getattr(source, name)[:1, :, :source.length]
            buf[first:end, :, source.length:length] = 0
        self.rows, self.length = end, length

    def pack(self, order, width):
        """Keep `width` columns, row b's taken from its columns order[b] (B, width), in that order."""
        rows = torch.arange(len(order), device=order.device)[:, None]                # (B, 1)
        for name in ("keys", "values"):
            buf = getattr(self, name)
            picked = buf[rows, :, order.to(buf.device)]                              # (B, width, H, D): a copy
            buf[:len(order), :, :width] = picked.transpose(1, 2)
        self.length = width

    def batch_select_indices(self, indices):
        """Keep rows `indices`, in that order, compacted in place into the first len(indices) rows; an
        index given twice copies its row (rows with the same history share one forward: rollout_groups)."""
        self._reserve(len(indices), self.length)
        for name in ("keys", "values"):
            buf = getattr(self, name)
            buf[:len(indices), :, :self.length] = buf[indices.to(buf.device), :, :self.length]   # gathered first
        self.rows = len(indices)


class KVCache(Cache):
    """A preallocated KV cache, a drop-in for DynamicCache in a model forward:

        cache = KVCache(config=model.config, capacity=prompt_len + max_new_tokens)   # a hint
        body(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, past_key_values=cache)
        cache.add_rows(prefix, n); cache.batch_select_indices(index); cache.pack(order, width)
    """

    def __init__(self, config, capacity: int = 0):
        config = config.get_text_config(decoder=True)
        kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        assert all(k == "full_attention" for k in kinds), f"KVCache holds full-attention layers only, not {sorted(set(kinds))}"
        super().__init__(layers=[KVLayer(capacity) for _ in range(config.num_hidden_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def add_rows(self, source: "KVCache", count: int):
        for layer, from_layer in zip(self.layers, source.layers):
            layer.add_rows(from_layer, count)

    def pack(self, order, width):
        for layer in self.layers:
            layer.pack(order, width)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].length + query_length, 0


# ----------------------------------------------------------------------------- asking a trained agent
NO_ANSWER = {   # why an episode ended without a submitted query, in words
    "no_tool_call": "the agent answered in prose instead of calling a tool",
    "max_turns": "the agent used all its turns without submitting (--max-turns)",
    "max_new_tokens": "a turn ran past --max-new-tokens",
    "max_context": "the conversation outgrew --max-context",
    "non_finite_logits": "the model's logits were not finite (numeric overflow)",
}


def short_view(text, max_lines=6, width=100) -> str:
    """The first lines of a text, each cut to `width` characters, saying how many were left out."""
    lines = text.split("\n")
    shown = [line if len(line) <= width else line[:width - 3] + "..." for line in lines[:max_lines]]
    return "\n".join(shown + ([f"... ({len(lines) - max_lines} more lines)"] if len(lines) > max_lines else []))


def show_message(message, turn) -> str:
    """A recorded message as the terminal shows it: a tool call as `turn. name  arguments`, an
    observation as an indented short view, a turn without a usable call as what it says."""
    if message["role"] == "tool":
        return textwrap.indent(short_view(message["content"]), "       ")
    try:
        name, args = parse_tool_call(message["content"])
    except ToolCallError as e:
        return f"  {turn:>2}. no usable tool call ({e}):\n" + textwrap.indent(short_view(message["content"], 3), "       ")
    plain = all(isinstance(v, str) for v in args.values())
    return (f"  {turn:>2}. {name}  " + (" ".join(args.values()) if plain else json.dumps(args))).rstrip()


def ask(model, tokenizer, db_path, question, limits=Limits(max_turns=4, max_new_tokens=256)) -> Trajectory:
    """One greedy episode on a question about any SQLite database, printed as it happens (each tool
    call, a short view of each observation), then the submitted query and its result rows, run
    again in the sandbox, or "no answer" and why. The question has no gold SQL: nothing is scored."""
    task, turns = Task("ask", db_path, question, gold_sql=None), []

    def show(row, message):
        turns.append(message["role"] == "assistant")
        print(show_message(message, sum(turns)), flush=True)

    trajectory = rollout_group(model, tokenizer, task, 1, Sampling(greedy=True), limits, on_message=show).trajectories[0]
    if trajectory.submitted_sql is None:
        print(f"no answer: {NO_ANSWER.get(trajectory.stop_reason, trajectory.stop_reason)}")
    else:
        result = SQLEnv(task).call("run_sql", {"query": trajectory.submitted_sql})
        print(f"answer: {trajectory.submitted_sql}\n" + textwrap.indent(result, "  "))
    return trajectory


def questions_from_stdin():
    """Questions typed (or piped) one a line, until the end of input; blank lines are skipped."""
    while True:
        try:
            line = input("question> ")
        except EOFError:
            print()
            return
        if line.strip():
            yield line.strip()


def main(argv=None) -> list[Trajectory]:
    p = argparse.ArgumentParser(description="Ask an agent questions about a SQLite database: one greedy episode "
                                            "per question, printed as it happens.")
    p.add_argument("question", nargs="?", help="the question; without one, questions are read from standard input")
    p.add_argument("--db", required=True, help="the SQLite file to ask about (opened read-only, in the training sandbox)")
    p.add_argument("--adapter", default=None, help="a trained adapter: its folder, or a run folder (its final adapter, "
                                                   "else its latest checkpoint); default: none, the base model")
    p.add_argument("--model", default=None, help="the base model (hub id or folder); default: the one the adapter "
                                                 "records, else the embedded SmolLM2-135M-Instruct")
    p.add_argument("--max-turns", type=int, default=4, help="assistant turns per episode")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per turn")
    p.add_argument("--max-context", type=int, default=4096, help="tokens per episode, prompt included")
    args = p.parse_args(argv)
    if min(args.max_turns, args.max_new_tokens, args.max_context) < 1:
        p.error("--max-turns, --max-new-tokens and --max-context must be >= 1")
    if args.question is not None and not args.question.strip():
        p.error("the question is empty")
    try:       # a bad path gets one line, before any model is loaded
        tables = database_tables(args.db)
        adapter = lora.find_adapter(args.adapter) if args.adapter else None
    except (SQLError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    model_name = args.model or (lora.adapter_base_model(adapter) if adapter else None)
    model, tokenizer = lora.load_model(model_name)
    if adapter:
        try:
            lora.load_adapter(model, adapter)
        except (AssertionError, RuntimeError) as e:     # the adapter was trained on another base model
            raise SystemExit(f"error: the adapter {adapter} does not fit {model_name or lora.EMBEDDED_NAME}: {e}") from None
    print(f"database: {args.db} ({len(tables)} table{'s' * (len(tables) != 1)}) | model: {model_name or lora.EMBEDDED_NAME}"
          f" | adapter: {adapter or 'none'}")
    limits = Limits(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, max_context=args.max_context)
    trajectories = []
    for question in [args.question] if args.question is not None else questions_from_stdin():
        print(f"question: {question}")
        trajectories.append(ask(model, tokenizer, args.db, question, limits))
    return trajectories


if __name__ == "__main__":
    main()
