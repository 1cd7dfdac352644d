"""Tests for agentrl.py (the tool-call format, episodes, demonstrations) and engine.py (the rollout
engine's exactness).

The rollout tests drive tiny random models. Such a model never writes a tool call by itself, so
bench.common.scripted_policy scripts the start of chosen turns from outside the engine. A
scripted token's log-prob is filled in after the rollout by a full forward under the policy
sampled, so the exactness checks hold for it by construction; what they test of the engine is
every token it sampled, many of them after scripted turns and tool results in its cache
(`engine_sampled` picks those out where a check must not count scripted ones).
"""
import json
import math
from dataclasses import dataclass

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import agentrl
import engine
import forward
import lora
from bench.common import scripted_policy

TOOLS = [
    {"type": "function", "function": {"name": "run_sql", "description": "Run a read-only SQL query.",
                                      "parameters": {"type": "object", "properties": {"sql": {"type": "string"}},
                                                     "required": ["sql"]}}},
    {"type": "function", "function": {"name": "submit_answer", "description": "Submit the final SQL query.",
                                      "parameters": {"type": "object", "properties": {"sql": {"type": "string"}},
                                                     "required": ["sql"]}}},
]


@dataclass
class FakeTask:
    id: str
    question: str
    gold_sql: str = "SELECT 1"
    evidence: str = ""


class FakeEnv:
    """The SQLEnv interface with canned answers whose length depends on the query (ragged appends)."""

    def __init__(self, task):
        self.task, self.tools = task, TOOLS
        self.done, self.submitted_sql, self.correct = False, None, False
        self.num_tool_calls = self.num_tool_errors = 0

    def call(self, name, arguments):
        self.num_tool_calls += 1
        if name == "submit_answer":
            self.done, self.submitted_sql = True, arguments.get("sql")
            self.correct = self.submitted_sql == self.task.gold_sql
            return "Submitted."
        if name == "run_sql":
            return "\n".join(f"row {i}: {arguments.get('sql', '')}" for i in range(len(arguments.get("sql", "")) % 7 + 1))
        self.num_tool_errors += 1
        return f"Error: unknown tool {name!r}"


def call(name, sql):
    return f'<tool_call>{{"name": "{name}", "arguments": {{"sql": "{sql}"}}}}</tool_call>'


TASKS = [FakeTask("t0", "How many singers are there?"),
         FakeTask("t1", "List the names of all the albums released after 2001, newest first.", evidence="year is a column")]
# rows are task-major: rows 0-3 belong to t0, rows 4-7 to t1
SCRIPT = [
    [call("run_sql", "SELECT COUNT(*) FROM singer"), call("submit_answer", "SELECT 1")],  # 2 turns, submitted
    [call("run_sql", "SELECT name FROM singer WHERE age > 30 ORDER BY name")],            # then samples freely
    ['<tool_call>{"name": "run_sql", "arguments": {sql}</tool_call>', call("submit_answer", "SELECT 1")],  # malformed, then recovers
    [],                                                                                   # samples from the start
    [call("submit_answer", "SELECT 2")],                                                  # early finisher
    [call("run_sql", "SELECT 1"), call("run_sql", "SELECT a, b FROM t"), call("run_sql", "x")],  # max turns
    ["Hello<|im_end|>"],                                                                  # answers, no call
    [call("nope", "SELECT 1")],                                                           # unknown tool
]
LIMITS = agentrl.Limits(max_turns=3, max_new_tokens=48, max_context=1024)


def rollout(model, tokenizer, seed=0, sampling=None, turns=SCRIPT, **kw):
    """TASKS' groups of 4 under the policy scripted by `turns` (scripted_policy's)."""
    sampling = sampling or engine.Sampling(seed=seed)
    with scripted_policy(turns):
        return engine.rollout_groups(model, tokenizer, TASKS, 4, sampling, LIMITS, make_env=FakeEnv, **kw)


def engine_sampled(trajectory, turns, tokenizer):
    """(T,) bool: the tokens the engine sampled itself, i.e. the trained ones (mask 1) less the
    scripted start of each turn (`turns`, the row's texts in scripted_policy, turn by turn)."""
    mask = torch.tensor(trajectory.assistant_mask, dtype=torch.bool)
    for k, (start, _) in enumerate(trajectory.turns[:len(turns)]):
        mask[start:start + len(agentrl.encode(tokenizer, turns[k]))] = False
    return mask


def full_forward_logprobs(model, token_ids, weight_dtype=None):
    """log p(x_t | x_<t) from one plain forward over the whole sequence, (T,), 0 at t=0.
    weight_dtype: of the policy the engine decodes with under Sampling.weight_dtype, the LoRA layers
    merged into weights of that precision (lora_merged) and the lm_head's weight in it."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        if weight_dtype is None:
            logits = model(input_ids=ids).logits[0]
        else:
            with lora.lora_merged(model, weight_dtype):
                hidden = model.base_model(input_ids=ids).last_hidden_state[0]
            logits = F.linear(hidden.to(weight_dtype), model.lm_head.weight.to(weight_dtype))
        logp = torch.log_softmax(logits.float(), dim=-1)    # (T, V)
    out = torch.zeros(len(token_ids))
    out[1:] = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    return out


PAIRS = [("llama", "smol_tokenizer"), ("qwen2", "qwen_tokenizer")]


@pytest.fixture(scope="module")
def scripted(request):
    """One scripted rollout per (model family, template), shared by the tests that inspect it."""
    done = {}

    def get(kind, tok):
        if (kind, tok) not in done:
            from conftest import build_tiny_model
            model, tokenizer = build_tiny_model(kind), request.getfixturevalue(tok)
            with fed_tokens() as fed:
                groups = rollout(model, tokenizer)
            done[kind, tok] = model, tokenizer, groups, fed
        return done[kind, tok]
    return get


@contextmanager
def fed_tokens():
    """The real tokens each of the engine's forwards is fed, in order (a list filled as it runs)."""
    fed, original = [], engine.CachedForward

    class Counting(original):
        def __call__(self, ids, mask, cache):
            fed.append(int(mask[:, -ids.shape[1]:].sum()))
            return super().__call__(ids, mask, cache)
    engine.CachedForward = Counting
    try:
        yield fed
    finally:
        engine.CachedForward = original




# ----------------------------------------------------------------------------- rollouts

def test_rollouts_record_and_the_update_reads_the_policy_sampled(tiny_llama, smol_tokenizer):
    """At temperature T the engine samples from softmax(logits / T) and records log of that (the
    tokens it sampled: the full forward's logits over T, < 1e-4), and the update's forward at the same
    T reads the same log-probs back (every trained token), so its ratio starts at 1 (grpo.py)."""
    groups = rollout(tiny_llama, smol_tokenizer, sampling=engine.Sampling(seed=0, temperature=0.5))
    checked = 0
    for traj, turns in zip([t for g in groups for t in g.trajectories], SCRIPT):
        sampled = engine_sampled(traj, turns, smol_tokenizer)[1:]
        if not sampled.any():          # a row scripted to its end: nothing the engine sampled
            continue
        ids = torch.tensor([traj.token_ids])
        with torch.no_grad():
            logits = tiny_llama(input_ids=ids).logits[0, :-1].float()
        at = {T: torch.log_softmax(logits / T, -1).gather(1, ids[0, 1:, None])[:, 0][sampled] for T in (0.5, 1.0)}
        recorded = torch.tensor(traj.sampled_logprobs[1:])[sampled]
        assert (recorded - at[0.5]).abs().max() < 1e-4 < (recorded - at[1.0]).abs().max()   # T = 1's differ
        checked += 1
    assert checked >= 3             # rows that sampled tokens of their own (the others are scripted to the end)
    for g in groups:
        with torch.no_grad():
            read = forward.tree_logprobs(tiny_llama, g.tree, g.trajectories, list(range(4)), temperature=0.5)
        batch = forward.collate(g.trajectories, None, torch.device("cpu"))
        assert ((read - batch["old_logprobs"]) * batch["mask"]).abs().max() < 1e-4


@pytest.mark.parametrize("kind,tok", PAIRS)
def test_rollout_logprobs_equal_full_forward(kind, tok, scripted):
    """The recorded log-probs are what GRPO's fresh forward over token_ids computes: the cache
    reuse, holes, position ids from the mask and ragged appends change nothing (< 1e-4, fp32)."""
    model, tokenizer, groups, _ = scripted(kind, tok)
    trajs = [t for g in groups for t in g.trajectories]
    for traj in trajs:
        reference = full_forward_logprobs(model, traj.token_ids)
        mask = torch.tensor(traj.assistant_mask, dtype=torch.bool)
        recorded = torch.tensor(traj.sampled_logprobs)
        assert mask.any() and (recorded[~mask] == 0).all()
        assert (recorded[mask] - reference[mask]).abs().max() < 1e-4, traj.stop_reason
    # what this tests of the engine: the tokens it sampled, some after a scripted turn and a tool result
    sampled = [engine_sampled(t, turns, tokenizer) for t, turns in zip(trajs, SCRIPT)]
    assert any(m[t.turns[1][0]:].any() for t, m in zip(trajs, sampled) if len(t.turns) > 1)


@pytest.mark.parametrize("kind,tok", PAIRS)
def test_rollout_tokens_decode_to_template_rendering(kind, tok, scripted):
    """decode(token_ids) is exactly the chat template's rendering of the recorded messages, so
    the judge (which reads messages) and the trainer (which reads tokens) see the same thing."""
    _, tokenizer, groups, _ = scripted(kind, tok)
    for traj in (t for g in groups for t in g.trajectories):
        text = tokenizer.decode(traj.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert text == agentrl.render(tokenizer, traj.messages, TOOLS, add_generation_prompt=False)


def sampled_runs(mask):
    """Lengths of the runs of 1s in a mask: the sampled tokens of each turn."""
    runs, n = [], 0
    for m in mask + [0]:
        if m:
            n += 1
        elif n:
            runs, n = runs + [n], 0
    return runs


def test_rollout_outcomes_follow_the_script(scripted):
    """Each way a row can stop is recorded: submission (with the env outcome), a final answer
    without a call, the turn limit, the per-turn token limit; malformed calls and unknown tools
    become error observations and count as tool errors, never exceptions, and the agent gets its
    next turn to recover."""
    _, _, groups, _ = scripted("llama", "smol_tokenizer")
    trajs = [t for g in groups for t in g.trajectories]
    assert [t.stop_reason for t in trajs] == ["submitted", "max_new_tokens", "submitted", "max_new_tokens",
                                              "submitted", "max_turns", "no_tool_call", "max_new_tokens"]
    assert trajs[0].submitted_sql == "SELECT 1" and trajs[0].correct and trajs[0].num_turns == 2
    # the error observation ends in "</tool_call>" (it shows the format): only the new turn's tokens may end a turn
    assert trajs[2].submitted_sql == "SELECT 1" and trajs[2].num_turns == 2 and trajs[2].num_tool_calls == 2
    assert trajs[4].submitted_sql == "SELECT 2" and not trajs[4].correct and trajs[4].num_turns == 1
    first_tool = len(agentrl.build_messages(TASKS[0], TOOLS)) + 1     # prompt, then assistant, then tool
    assert trajs[2].num_tool_errors == 1 and trajs[2].messages[first_tool]["content"].startswith("Error:")
    assert trajs[7].num_tool_errors == 1 and "unknown tool" in trajs[7].messages[first_tool]["content"]
    assert trajs[5].num_turns == 3 and trajs[5].num_tool_calls == 3
    for t in trajs:
        assert len(sampled_runs(t.assistant_mask)) == t.num_turns
        assert max(sampled_runs(t.assistant_mask)) <= LIMITS.max_new_tokens


def test_rollout_prompt_prefix_encoded_once(scripted, smol_tokenizer):
    """All rows of a group start from their task's prompt tokens, mask 0; the tokens every prompt
    shares (all but the question) are encoded once for the whole call, and the rest once per group
    (its rows agree so far: one node of its tree, fed once at the first flush)."""
    _, _, groups, fed = scripted("llama", "smol_tokenizer")
    prompts = [smol_tokenizer(agentrl.render(smol_tokenizer, agentrl.build_messages(g.task, TOOLS), TOOLS, True),
                              add_special_tokens=False).input_ids for g in groups]
    for group, ids in zip(groups, prompts):
        for traj in group.trajectories:
            assert traj.token_ids[:len(ids)] == ids and not any(traj.assistant_mask[:len(ids)])
        assert [c.tokens for c in group.tree.children] == [ids]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    question = smol_tokenizer(groups[0].task.question, add_special_tokens=False).input_ids
    assert shared > len(prompts[0]) - len(question) - 8, "the shared prefix stops before the question"
    assert fed[:2] == [shared, sum(len(ids) - shared for ids in prompts)]


def test_each_trajectory_is_a_path_of_its_group_s_tree(scripted):
    """A group's tree (make_group): every trajectory's tokens and messages are those of the nodes on
    its path, in order; a node starts where its parent ends, and holds the trajectories through it."""
    _, _, groups, _ = scripted("qwen2", "qwen_tokenizer")
    for group in groups:
        paths = {i: [] for i in range(len(group.trajectories))}

        def walk(node, end):
            assert node.start == end
            for i in node.through:
                paths[i].append(node)
            for child in node.children:
                assert set(child.through) <= set(node.through)
                walk(child, node.start + len(node.tokens))
        walk(group.tree, 0)
        for i, t in enumerate(group.trajectories):
            assert [tok for n in paths[i] for tok in n.tokens] == t.token_ids
            assert [m for n in paths[i] for m in n.messages] == t.messages
            assert len(paths[i]) == 2 + len(t.turns)    # the empty root, the prompt, a node a turn


def test_no_tasks_no_groups(tiny_llama, smol_tokenizer):
    """A process whose share is empty (torchrun with fewer held-out tasks than processes) gets no
    groups, and an evaluation of nothing is nothing; it used to fail on an empty prompt list."""
    assert engine.rollout_groups(tiny_llama, smol_tokenizer, [], 2, engine.Sampling(seed=0), LIMITS) == []


def test_rollout_is_reproducible_from_seed(tiny_llama, smol_tokenizer):
    """Same seed, same tokens; another seed, other tokens (sampling goes through the generator)."""
    def run(seed):
        groups = engine.rollout_groups(tiny_llama, smol_tokenizer, TASKS[:1], 2, engine.Sampling(seed=seed),
                                        agentrl.Limits(max_turns=1, max_new_tokens=8), make_env=FakeEnv)
        return [t.token_ids for t in groups[0].trajectories]
    assert run(1) == run(1) and run(1) != run(2)


def test_greedy_rows_agree(tiny_llama, smol_tokenizer):
    """Greedy decoding is deterministic: unscripted rows of one group produce identical tokens,
    whatever their neighbours in the batch do."""
    groups = rollout(tiny_llama, smol_tokenizer, sampling=engine.Sampling(greedy=True),
                     turns=[[]] * 3 + [[call("submit_answer", "SELECT 3")]] + [[]] * 4)
    rows = groups[0].trajectories[:3] + groups[1].trajectories
    assert rows[0].token_ids == rows[1].token_ids == rows[2].token_ids
    assert rows[3].token_ids == rows[4].token_ids


@pytest.mark.parametrize("max_rows", [1, 3])
def test_continuous_batching_equals_one_batch(tiny_llama, smol_tokenizer, max_rows):
    """With max_rows=3 the eight scripted rows decode at most three at a time, later rows joining
    as others finish (with 1, every row starts from an emptied cache), and every trajectory is the
    one the full batch gives (greedy): same tokens, the same log-probs to 1e-4, and those equal a
    fresh forward."""
    widths = []
    hook = tiny_llama.lm_head.register_forward_hook(lambda module, inputs, output: widths.append(len(output)))
    try:
        joined = rollout(tiny_llama, smol_tokenizer, sampling=engine.Sampling(greedy=True), max_rows=max_rows)
    finally:
        hook.remove()
    whole = rollout(tiny_llama, smol_tokenizer, sampling=engine.Sampling(greedy=True))
    assert max(widths) == max_rows                         # the prefix forward is one row, then never more
    for a, b in zip([t for g in joined for t in g.trajectories], [t for g in whole for t in g.trajectories]):
        assert a.token_ids == b.token_ids and a.stop_reason == b.stop_reason
        torch.testing.assert_close(torch.tensor(a.sampled_logprobs), torch.tensor(b.sampled_logprobs), rtol=0, atol=1e-4)
        fresh = full_forward_logprobs(tiny_llama, a.token_ids) * torch.tensor(a.assistant_mask)
        torch.testing.assert_close(torch.tensor(a.sampled_logprobs), fresh, rtol=0, atol=1e-4)


@pytest.mark.parametrize("greedy", [True, False])
def test_weights_in_bf16_record_the_bf16_policys_logprobs(greedy, tiny_llama, smol_tokenizer):
    """Sampling.weight_dtype=torch.bfloat16 (greedy evaluation, or sampled rollouts): every merged
    layer computes with a bf16 weight while rows decode, and so does a bf16 copy of the lm_head. The
    recorded log-probs are that policy's (a fresh forward through the same bf16 weights), off the
    fp32 policy's by bf16 rounding (the gap GRPO's first ratio then corrects for); the model is fp32
    and unmerged again after."""
    lora.apply_lora(tiny_llama, r=4, alpha=8)
    layers = [m for m in tiny_llama.modules() if isinstance(m, lora.LoRALinear)]
    merged = []
    hooks = [m.register_forward_pre_hook(lambda module, inputs: merged.append(module.merged.dtype)) for m in layers]
    try:
        half = rollout(tiny_llama, smol_tokenizer, sampling=engine.Sampling(greedy=greedy, weight_dtype=torch.bfloat16))
    finally:
        for hook in hooks:
            hook.remove()
    assert merged and set(merged) == {torch.bfloat16}
    assert all(m.merged is None for m in layers) and tiny_llama.lm_head.weight.dtype == torch.float32
    to_fp32, to_bf16 = [], []
    for t, turns in zip([t for g in half for t in g.trajectories], SCRIPT):
        mask = engine_sampled(t, turns, smol_tokenizer)     # the engine's; a scripted token's are bf16 by construction
        if not mask.any():
            continue
        recorded = torch.tensor(t.sampled_logprobs) * mask
        to_fp32.append((recorded - full_forward_logprobs(tiny_llama, t.token_ids) * mask).abs().max())
        to_bf16.append((recorded - full_forward_logprobs(tiny_llama, t.token_ids, torch.bfloat16) * mask).abs().max())
    assert 1e-3 < max(to_fp32) < 0.5, to_fp32      # this random model's logits are large; fp32 is within 1e-4
    median = sorted(to_bf16)[len(to_bf16) // 2], sorted(to_fp32)[len(to_fp32) // 2]
    assert median[0] < median[1] / 10, (to_bf16, to_fp32)    # (a row decoded beside others may round apart in bf16)
    assert max(to_bf16) < max(to_fp32) / 2, (to_bf16, to_fp32)


def test_non_finite_logits_end_only_their_row(tiny_llama, smol_tokenizer):
    """An fp16 overflow in one row (nan logits in the fourth forward: the shared prefix, the rest of
    the prompt, then two decode steps) ends that row with
    stop_reason non_finite_logits and no nan in its log-probs, and changes nothing for the other
    rows: they match a clean run token for token."""
    def run(poison):
        forwards = []

        def nan_in_row_0(module, inputs, output):
            forwards.append(1)
            if poison and len(forwards) == 4:
                output[0] = float("nan")

        hook = tiny_llama.lm_head.register_forward_hook(nan_in_row_0)
        try:
            groups = engine.rollout_groups(tiny_llama, smol_tokenizer, TASKS[:1], 3, engine.Sampling(greedy=True),
                                            agentrl.Limits(max_turns=1, max_new_tokens=8), make_env=FakeEnv)
        finally:
            hook.remove()
        return groups[0].trajectories

    clean, poisoned = run(False), run(True)
    assert sum(t.stop_reason == "non_finite_logits" for t in poisoned) == 1
    assert not any(t.stop_reason == "non_finite_logits" for t in clean)
    assert poisoned[0].stop_reason == "non_finite_logits" and clean[0].stop_reason == "max_new_tokens"
    assert sum(poisoned[0].assistant_mask) == 2                  # tokens from forwards 2 and 3, none from 4
    start = poisoned[0].assistant_mask.index(1)
    assert poisoned[0].token_ids[:start + 2] == clean[0].token_ids[:start + 2]
    assert all(math.isfinite(lp) for lp in poisoned[0].sampled_logprobs)
    assert [t.token_ids for t in poisoned[1:]] == [t.token_ids for t in clean[1:]]


def test_only_stop_tokens_the_template_writes_end_a_turn(qwen_tokenizer):
    """A model whose generation config lists a second eos (Qwen2.5: <|endoftext|> beside <|im_end|>)
    does not end a turn on it: the template closes turns with <|im_end|>, and a turn ended by the
    other could not be re-rendered (the rollout would stop on an assertion). Sampled mid-turn it
    is text: the row goes on and still decodes to the template's rendering."""
    from conftest import build_tiny_model
    model = build_tiny_model("qwen2")
    im_end, endoftext = qwen_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config.eos_token_id = [im_end, endoftext]
    assert agentrl.stop_token_ids(qwen_tokenizer) == {im_end}
    with scripted_policy([["Hi<|endoftext|>"]]):
        groups = engine.rollout_groups(model, qwen_tokenizer, TASKS[:1], 1, engine.Sampling(seed=0),
                                       agentrl.Limits(max_turns=1, max_new_tokens=8), make_env=FakeEnv)
    traj = groups[0].trajectories[0]
    assert traj.stop_reason == "max_new_tokens" and traj.messages[-1]["content"].startswith("Hi<|endoftext|>")
    text = qwen_tokenizer.decode(traj.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert text == agentrl.render(qwen_tokenizer, traj.messages, TOOLS, add_generation_prompt=False)


# ----------------------------------------------------------------------------- tool calls

def test_parse_tool_call_accepts_hermes_and_rejects_the_rest():
    """The Hermes format parses; malformed or missing calls raise ToolCallError with a reason."""
    assert agentrl.parse_tool_call('x <tool_call>{"name": "run_sql", "arguments": {"sql": "S"}}</tool_call>') == ("run_sql", {"sql": "S"})
    assert agentrl.parse_tool_call('<tool_call>\n{"name": "a", "arguments": "{\\"k\\": 1}"}\n</tool_call>') == ("a", {"k": 1})
    for bad in ["no call here", "<tool_call>{oops}</tool_call>", '<tool_call>["run_sql"]</tool_call>',
                '<tool_call>{"name": "a", "arguments": [1]}</tool_call>']:
        with pytest.raises(agentrl.ToolCallError):
            agentrl.parse_tool_call(bad)


def test_tools_go_through_the_template_or_the_system_prompt(smol_tokenizer, qwen_tokenizer):
    """A template with tool support renders the schemas itself; otherwise the system prompt lists them."""
    task = TASKS[0]
    smol = agentrl.render(smol_tokenizer, agentrl.build_messages(task, TOOLS, inline_tools=True), TOOLS, True)
    qwen = agentrl.render(qwen_tokenizer, agentrl.build_messages(task, TOOLS, inline_tools=False), TOOLS, True)
    assert not agentrl.template_takes_tools(smol_tokenizer) and agentrl.template_takes_tools(qwen_tokenizer)
    assert "- run_sql(sql: string)" in smol and "<tools>" not in smol
    assert '"name": "run_sql"' in qwen and "- run_sql(" not in qwen
    assert '<tool_call>{"name": "run_sql"' in smol and task.question in qwen


def test_real_environment_round_trip(tiny_llama, smol_tokenizer):
    """With sql_env's SQLEnv: a scripted run_sql then submit of the gold query is scored correct,
    and the observations are the environment's own."""
    import sql_env
    task = sql_env.load_tasks()[0]
    run = f'<tool_call>{json.dumps({"name": "run_sql", "arguments": {"query": task.gold_sql}})}</tool_call>'
    submit = run.replace('"run_sql"', '"submit_answer"')
    with scripted_policy([[run, submit], [submit.replace(task.gold_sql, "SELECT 1")]]):
        group = engine.rollout_group(tiny_llama, smol_tokenizer, task, 2, engine.Sampling(seed=0),
                                     agentrl.Limits(max_new_tokens=200))
    good, bad = group.trajectories
    assert good.stop_reason == bad.stop_reason == "submitted"
    assert good.correct and good.submitted_sql == task.gold_sql and good.num_turns == 2 and not bad.correct
    assert good.messages[-3]["role"] == "tool" and "Error" not in good.messages[-3]["content"]


def demo_tasks():
    """Train tasks for demonstrations: a one-table and a two-table query, each on a non-original
    rendering."""
    import sql_env
    tasks = [t for t in sql_env.load_tasks()[:100] if "plain" not in t.db_path]
    return [next(t for t in tasks if len(sql_env.tables_read(t.db_path, t.gold_sql)) == k) for k in (1, 2)]


@pytest.mark.parametrize("kind,tok", PAIRS)
def test_scripted_trajectory_equals_the_forced_rollout(kind, tok, tiny_model_factory, request):
    """SFT demonstrations must carry exactly the tokens and masks a rollout of the same actions
    records, or the warm start teaches a format the policy never sees while sampling (with the
    describe_table observations between the calls)."""
    tokenizer = request.getfixturevalue(tok)
    tasks = demo_tasks()
    limits = agentrl.Limits(max_turns=5, max_new_tokens=160)
    turns = [agentrl.gold_turns(task, limits.max_turns) for task in tasks]
    with scripted_policy(turns):
        groups = engine.rollout_groups(tiny_model_factory(kind), tokenizer, tasks, 1, engine.Sampling(seed=0), limits)
    for task, task_turns, group in zip(tasks, turns, groups):
        rolled = group.trajectories[0]
        scripted = agentrl.scripted_trajectory(tokenizer, task, task_turns, limits)
        assert scripted.token_ids == rolled.token_ids
        assert scripted.assistant_mask == rolled.assistant_mask
        assert scripted.messages == rolled.messages
        assert (scripted.num_describe_calls, scripted.failed_submission) == (rolled.num_describe_calls, False)
        assert scripted.correct and rolled.correct and scripted.stop_reason == "submitted"
        assert scripted.num_turns == len(task_turns) == 3 + scripted.num_describe_calls


def test_demonstrations_count_what_they_show(smol_tokenizer):
    """The behaviour counters on scripted trajectories: a demonstration describes each table its
    query reads, within the turn budget, and submits a query that runs; a trajectory that submits a
    failing query is counted as a failed submission. Turns to submission are the demonstration's
    length."""
    import sql_env
    one, two = demo_tasks()
    for task, tables in [(one, 1), (two, 2)]:
        look = agentrl.demonstration(smol_tokenizer, task, agentrl.Limits(max_turns=6))
        assert look.num_describe_calls == tables and look.num_turns == 3 + tables and look.num_tool_errors == 0
        assert not look.failed_submission and look.correct
    budget = agentrl.demonstration(smol_tokenizer, two, agentrl.Limits(max_turns=agentrl.DEMO_TURNS))
    assert budget.num_describe_calls == 1 and budget.num_turns == 4
    described = sql_env.tables_read(two.db_path, two.gold_sql)[0]
    assert f'"table": "{described}"' in budget.messages[-6]["content"]
    wrong = "SELECT COUNT(*) FROM no_such_table"
    failing = agentrl.scripted_trajectory(smol_tokenizer, two, [agentrl.gold_turns(two)[0],
                                                                agentrl.tool_call_text("submit_answer", {"query": wrong})])
    assert failing.failed_submission and not failing.correct and failing.stop_reason == "submitted"


def test_a_demonstration_with_the_default_limits(smol_tokenizer):
    """The call agentrl's docstring shows, demonstration(tokenizer, task), with the default Limits:
    they leave room for the DEMO_TURNS a demonstration takes (while Limits.max_turns defaulted to 3,
    gold_turns refused it), and the demonstration is the scripted trajectory of its gold turns,
    every turn trained."""
    limits = agentrl.Limits()
    assert limits.max_turns >= agentrl.DEMO_TURNS
    for task, tables in zip(demo_tasks(), (1, 2)):
        demo = agentrl.demonstration(smol_tokenizer, task)
        turns = agentrl.gold_turns(task, limits.max_turns)
        assert demo.stop_reason == "submitted" and demo.correct and not demo.failed_submission
        assert demo.num_tool_errors == 0 and demo.num_describe_calls == min(tables, limits.max_turns - 3)
        assert demo.num_turns == len(turns) == 3 + demo.num_describe_calls
        assert demo.token_ids == agentrl.scripted_trajectory(smol_tokenizer, task, turns).token_ids
        assert sum(demo.assistant_mask) == sum(len(agentrl.encode(smol_tokenizer, text)) for text in turns)


def test_a_demonstration_does_not_imitate_a_turn_the_tool_refused(smol_tokenizer):
    """A gold query whose result is too large for run_sql (a Spider or BIRD query can be) gets an
    error observation; the warm start must not learn to write that turn, only the others."""
    import dataclasses
    task = demo_tasks()[0]
    huge = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 20) SELECT hex(zeroblob(40000)) FROM r"
    task = dataclasses.replace(task, gold_sql=huge)
    demo = agentrl.demonstration(smol_tokenizer, task, agentrl.Limits(max_turns=agentrl.DEMO_TURNS, max_new_tokens=160))
    scripted = agentrl.scripted_trajectory(smol_tokenizer, task, agentrl.gold_turns(task, agentrl.DEMO_TURNS),
                                           agentrl.Limits(max_turns=agentrl.DEMO_TURNS, max_new_tokens=160))
    assert demo.messages[-3]["content"].startswith("Error:")   # run_sql's answer, before the submit
    mask = scripted.assistant_mask
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]   # each sampled turn's first token
    kept = [bool(demo.assistant_mask[i]) for i in starts]
    assert len(starts) == len(sampled_runs(mask)) and sum(demo.assistant_mask) < sum(mask)
    assert kept == [True] * (len(starts) - 2) + [False, True]   # only the refused run_sql turn is cleared


# ----------------------------------------------------------------------------- branched groups

@pytest.mark.parametrize("rule", ["uniform", "entropy"])
def test_branched_rows_go_on_from_a_state_and_train_only_on_what_they_sample(rule, scripted):
    """branch_groups: each new row starts at a turn boundary of one of the group's trajectories (its
    tokens, messages and turns up to there, mask 0 on them), samples on from there, and stays exact:
    its log-probs are a fresh forward's, its tokens the template's rendering of its messages; the
    tree shares the copied turns, so the branch point is a state two trajectories pass through."""
    model, tokenizer, groups, _ = scripted("llama", "smol_tokenizer")
    branched = engine.branch_groups(model, tokenizer, groups, 7, engine.Sampling(seed=3), LIMITS, rule,
                                     make_env=FakeEnv)
    deep = 0
    for group, before in zip(branched, groups):
        assert group.trajectories[:4] == before.trajectories and len(group.trajectories) == 7
        for i, t in enumerate(group.trajectories[4:], start=4):
            own = t.assistant_mask.index(1) if 1 in t.assistant_mask else len(t.token_ids)
            j = max(k for k, (start, _) in enumerate(t.turns) if start <= own)   # the turns it was given
            start, first_message = t.turns[j]
            parents = [p for p in before.trajectories if p.turns[:j + 1] == t.turns[:j + 1]
                       and p.token_ids[:start] == t.token_ids[:start] and p.messages[:first_message] == t.messages[:first_message]]
            assert parents and not any(t.assistant_mask[:start])
            turns = [m["content"] for m in t.messages[t.turns[0][1]:] if m["role"] == "assistant"]
            errors = [m["content"] for m in t.messages[t.turns[0][1]:] if m["role"] == "tool"]
            assert t.num_turns == len(turns) and t.num_tool_calls == sum("<tool_call>" in c for c in turns)
            assert t.num_tool_errors == sum(c.startswith("Error") for c in errors)     # replayed, then its own
            reference = full_forward_logprobs(model, t.token_ids)
            mask = torch.tensor(t.assistant_mask, dtype=torch.bool)
            recorded = torch.tensor(t.sampled_logprobs)
            assert (recorded[~mask] == 0).all() and (recorded[mask] - reference[mask]).abs().max() < 1e-4
            text = tokenizer.decode(t.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            assert text == agentrl.render(tokenizer, t.messages, TOOLS, add_generation_prompt=False)
            if j:       # the state it started from is a node of the tree both it and its parent pass through
                deep += 1
                node = group.tree.children[0]
                for _ in range(j):
                    node = next(c for c in node.children if i in c.through)
                assert i in node.through and any(p in node.through for p in range(4))
    assert deep, "some row branched past the prompt"
