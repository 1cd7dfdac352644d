"""The agent: the chat/tool-call format, the episode a trajectory records, the group, demonstrations.

    trajectory = scripted_trajectory(tokenizer, task, [tool_call_text("list_tables", {}), ...])
    group = make_group(task, trajectories)              # the trajectories with their tree (tree.py)
    demo = demonstration(tokenizer, task)               # a gold SFT demonstration, as a rollout records it
    groups = engine.rollout_groups(model, tokenizer, tasks, n=8, sampling=engine.Sampling(seed=0))

An episode: the system prompt (with the tools), a worked example, the question; then turns in which
the model writes one `<tool_call>{json}</tool_call>` and the environment answers, until it calls
`submit_answer`. A Trajectory records every token the model saw or sampled, in order, with a mask
(1 on sampled tokens) and their log-probs: what the update trains on, never a re-tokenization.
An `Episode` is a trajectory being written: `end_turn` closes an assistant turn (records the
message, runs the tool, appends the template's next tokens) and `finish` ends it. The engine
(engine.py) writes many episodes at once with a model; `scripted_trajectory` writes one from given
turns with the tokenizer alone.

How a tool's answer becomes tokens: nanochat's engine appends a tool's output as forced tokens in
its own format; here the conversation is re-rendered through the model's chat template and only
the new text (end of turn, the tool message, the next assistant header) is encoded and appended.
That works for any template, and `end_turn` asserts the template re-renders the earlier turns as
they were, so the tokens stay exactly the ones the model saw.

A group is a tree (tree.py, `make_group`): its trajectories share the prompt, and often their first
turns and the tool's answers. The root's child is the prompt, each node below it one turn (the
sampled call, the tool's answer, the next turn's header); a trajectory is the path to its leaf.
The judge prints that tree (judge.py), the update forwards each of its nodes once (forward.py), and
the step advantages are read off it (grpo.step_advantages).

Simplification, and why it is safe: one tool call per turn: generation stops at `</tool_call>`, so
a second call is never made.
"""
import json
import re
from dataclasses import dataclass, field

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


# ----------------------------------------------------------------------------- episodes

@dataclass
class Limits:
    max_turns: int = 4         # assistant turns per trajectory (a demonstration takes DEMO_TURNS)
    max_new_tokens: int = 128  # sampled tokens per turn
    max_context: int = 2048    # tokens per trajectory, prompt included


@dataclass
class Trajectory:
    task_id: str
    messages: list[dict]            # the full conversation; decode(token_ids) == its chat-template rendering
    token_ids: list[int]            # (T,) exact tokens the model saw or sampled, in order
    assistant_mask: list[int]       # (T,) 1 only on sampled tokens
    sampled_logprobs: list[float]   # (T,) log p_T(token_t | tokens_<t) under the policy sampled (the
                                    #      logits over the sampling temperature T), 0.0 where the mask is 0
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
class Episode:
    """A trajectory being written (end_turn, finish), then read out whole (to_trajectory)."""
    task: object
    env: object
    tools: list[dict]
    messages: list[dict]
    token_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    turn_start: int = 0                             # index in token_ids where this turn's tokens begin
    text_len: int = 0                               # len(decode(token_ids[:turn_start]))
    turns: list[tuple[int, int]] = field(default_factory=list)  # Trajectory.turns
    stop_reason: str = ""
    num_turns: int = 0
    num_tool_calls: int = 0
    num_parse_errors: int = 0

    @classmethod
    def start(cls, task, env, tokenizer, limits):
        """A fresh episode in `env`: the task's prompt (system prompt with the tools, the demonstration,
        the question, through the chat template), nothing sampled yet."""
        messages = build_messages(task, env.tools, inline_tools=not template_takes_tools(tokenizer))
        prompt = encode(tokenizer, render(tokenizer, messages, env.tools, add_generation_prompt=True))
        assert len(prompt) < limits.max_context, \
            f"prompt of {len(prompt)} tokens exceeds max_context={limits.max_context}"
        return cls(task, env, env.tools, messages, list(prompt), [0] * len(prompt), [0.0] * len(prompt),
                   turn_start=len(prompt), text_len=len(decode(tokenizer, prompt)),
                   turns=[(len(prompt), len(messages))])


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


def to_trajectory(row: Episode) -> Trajectory:
    """The finished episode as the Trajectory the update and the judge read."""
    return Trajectory(row.task.id, row.messages, row.token_ids, row.mask, row.logprobs, row.env.submitted_sql,
                      bool(row.env.correct), row.stop_reason, row.num_turns, row.num_tool_calls,
                      row.num_parse_errors + row.env.num_tool_errors,
                      # behaviour counters of sql_env.SQLEnv; an environment without them reports none
                      num_describe_calls=getattr(row.env, "num_describe_calls", 0),
                      failed_submission=getattr(row.env, "submit_error", None) is not None, turns=row.turns)


def end_turn(row: Episode, limits: Limits, tokenizer, truncated: str | None = None, eos=False) -> list[int]:
    """Close the assistant turn that just ended: record the message, run the tool, then either append
    the next turn's tokens (returned: the model has yet to see them) or finish the episode
    (row.stop_reason; returns [])."""
    # the turn's text, decoded in context (exact for any tokenizer), minus a sampled stop token
    sampled_end = len(row.token_ids) - 1 if eos else len(row.token_ids)
    content = decode(tokenizer, row.token_ids[:sampled_end])[row.text_len:]
    row.messages.append({"role": "assistant", "content": content})
    row.num_turns += 1
    if truncated:
        return finish(row, truncated, tokenizer)
    if "<tool_call>" not in content:                # a final answer without submission: scores wrong
        return finish(row, "no_tool_call", tokenizer)
    row.num_tool_calls += 1
    try:
        name, args = parse_tool_call(content)
        observation = row.env.call(name, args)
    except ToolCallError as e:
        row.num_parse_errors += 1
        observation = f'Error: {e}. Write <tool_call>{{"name": "...", "arguments": {{...}}}}</tool_call>'
    row.messages.append({"role": "tool", "content": observation})
    if row.env.done:
        return finish(row, "submitted", tokenizer)
    if row.num_turns >= limits.max_turns:
        return finish(row, "max_turns", tokenizer)
    # the new tokens: end of turn + tool message + next assistant header, as the template renders them
    text = decode(tokenizer, row.token_ids)
    rendered = render(tokenizer, row.messages, row.tools, add_generation_prompt=True)
    assert rendered.startswith(text), "the chat template re-renders earlier turns differently; cannot append"
    suffix = encode(tokenizer, rendered[len(text):])
    if len(row.token_ids) + len(suffix) + 1 > limits.max_context:
        row.messages.pop()                          # no room for the tool result and one more token
        return finish(row, "max_context", tokenizer)
    row.token_ids += suffix
    row.mask += [0] * len(suffix)
    row.logprobs += [0.0] * len(suffix)
    row.turn_start, row.text_len = len(row.token_ids), len(decode(tokenizer, row.token_ids))
    row.turns.append((row.turn_start, len(row.messages)))
    return suffix


def finish(row: Episode, reason: str, tokenizer) -> list[int]:
    """End the episode; append the closing tokens (end of turn, last tool message) the template
    renders, so decode(token_ids) equals the rendering of messages. They are never fed to the model:
    returns []."""
    row.stop_reason = reason
    text = decode(tokenizer, row.token_ids)
    rendered = render(tokenizer, row.messages, row.tools, add_generation_prompt=False)
    assert rendered.startswith(text), "the chat template re-renders earlier turns differently"
    closing = encode(tokenizer, rendered[len(text):])
    row.token_ids += closing
    row.mask += [0] * len(closing)
    row.logprobs += [0.0] * len(closing)
    return []


# ----------------------------------------------------------------------------- demonstrations (SFT)
DEMO_TURNS = 4     # the assistant turns a demonstration needs: list, describe (a table or more), run, submit


def scripted_trajectory(tokenizer, task, turns, limits=Limits(), make_env=None) -> Trajectory:
    """The trajectory a rollout records when the model emits exactly `turns` (one text per
    assistant turn, each ending in </tool_call>), built with the tokenizer alone: the same
    prompt, the same appended tool tokens and masks as the engine's, with no forward pass.
    sampled_logprobs are 0.0 (unknown without the model). For SFT."""
    row = Episode.start(task, (make_env or SQLEnv)(task), tokenizer, limits)
    for text in turns:
        assert not row.stop_reason, f"turn {text!r} comes after the episode ended ({row.stop_reason})"
        ids = encode(tokenizer, text)
        assert len(ids) < limits.max_new_tokens, f"turn of {len(ids)} tokens exceeds max_new_tokens"
        row.token_ids += ids
        row.mask += [1] * len(ids)
        row.logprobs += [0.0] * len(ids)
        end_turn(row, limits, tokenizer)
    if not row.stop_reason:
        finish(row, "max_turns", tokenizer)
    return to_trajectory(row)


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
