"""The relative judge: an LLM ranks a group of trajectories that attempted the same task.

RULER (OpenPipe, 2025): an LLM ranks several attempts at one task against each other far better
than it scores one attempt alone, and GRPO only needs scores that are right relative to the group.
So the judge sees the whole group in one prompt and returns one score in [0, 1] per trajectory:

    result = score_group(group.tree, HTTPBackend(model="gpt-4.1-mini"))   # the group's tree (tree.Node)
    result.scores        # [0.9, 0.1, ...] in trajectory order, or None if the group is unscored

What this file adds to RULER:
1. The group printed as its tree: every node of the rollout's tree (agentrl.make_group: the
   prompt, then a node a turn) is printed once, labelled with the ids of the trajectories through
   it; trajectory k is every block whose label lists k, top to bottom. Identical trajectories end
   at the same node: one id, scored once, the score copied to each.
2. Robust parsing: the verdict is read only from the answer, after the last closing `</think>`
   (`</thinking>`, `</reasoning>`), never from the judge's reasoning, which may hold draft scores;
   reasoning that never closes means no answer (the token budget ran out mid-thought). JSON is dug
   out of prose or code fences and matched by `trajectory_id`, never by position; a bad reply gets
   a short correction and another try; if that fails too, the group comes back unscored instead of
   raising (the trainer then uses correctness alone). The reasoning is kept, clipped, on the result.
3. Scores on another scale keep their order: a reply above 1 is corrected once; if the judge
   insists, its scores are divided by the scale they evidently use (0-10, 0-100), or min-max
   normalized within the group, and the group is counted as `rescaled`. Negative or non-finite
   scores, and a mix of scales (0.8 beside 7), are parse errors.
4. Two backends and a cache: `LocalBackend` runs any Hugging Face causal LM greedily (in
   train.py, the policy's base model with the LoRA off); `HTTPBackend` speaks the OpenAI
   `/v1/chat/completions` protocol (OpenAI, vLLM, llama.cpp, Ollama, ...) with the standard library
   only, asks the server to shape the reply by the verdict's JSON schema, and hands a separate
   reasoning field back inline as `<think>...</think>`, so one parser reads every judge.
   `CachedBackend` wraps either and keeps its replies on disk, by a hash of (model, prompt).
5. Calibration: `agreement` measures how often the judge ranks an execution-correct trajectory
   above a wrong one in the same group (a per-group AUC); near 0.5, the judge adds noise.

Simplifications, and why they are safe:
- Nodes end at turns: two turns that differ in one token are two nodes, printed whole.
- Backoff has no jitter: one trainer talks to one endpoint.
- A prompt longer than the local model's context is refused (unscored), never truncated: a
  relative judgement must see every trajectory it ranks.
"""
import contextlib
import hashlib
import http.client
import json
import math
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import torch

from files import read_json, write_text_atomic
from tree import Node, build_tree

# ---------------------------------------------------------------- the prompt
# In RULER's spirit: success dominates, then efficiency, partial credit, proportional gaps.
DEFAULT_RUBRIC = """\
- A trajectory that achieves the goal scores far higher than one that does not.
- Among those that achieve it, fewer wasted steps and fewer errors score higher.
- A failed trajectory that made real progress scores higher than one that made none.
- Score gaps should be proportional to quality gaps; equal quality, equal score."""

SYSTEM_PROMPT = """\
You compare attempts at one task. Every trajectory below is an agent's attempt at the same \
goal; infer the goal from them. Score each trajectory from 0 to 1, relative to the others.

Layout: each block starts with a line like "=== trajectories 1, 3 ===". Trajectory k is \
every block whose label lists k, read top to bottom; steps shared by several trajectories \
are printed once. Each message starts with its role: [system], [user], [assistant], [tool].

Rubric:
{rubric}

Reply with JSON only, one entry per trajectory id, explanation before score:
{{"scores": [{{"trajectory_id": 1, "explanation": "...", "score": 0.0}}]}}"""

CORRECTION = ("Your reply could not be used: {error}. Reply with only the JSON object, with one "
              "entry for each trajectory id in {ids}.")


class JudgeError(Exception):
    """A backend could not produce a reply (endpoint down, prompt too long, ...)."""


class ParseError(ValueError):
    """A reply that does not contain a usable score for every trajectory."""


class ReasoningNeverClosed(ParseError):
    """A reply whose reasoning block never closed, so it has no answer: the token budget ran out
    mid-thought."""


@dataclass
class JudgeResult:
    scores: list[float] | None      # (N,) in the order of the conversations; None = unscored
    explanations: list[str]         # (N,) the judge's reasons; empty when unscored
    scored: bool
    attempts: int                   # replies asked for; attempts - 1 corrections
    rescaled: str = ""              # the scale a reply above [0, 1] was read on: "0-10", "0-100", "min-max"
    error: str = ""                 # why the group is unscored, or the last error retried past
    reasoning: str = ""             # the last reply's pre-verdict reasoning, clipped; for logs, never scored


# ---------------------------------------------------------------- the group, printed once
# A message is printed as a role line "[role]" followed by its content, verbatim. A block is a
# header line "=== trajectories 1, 3 ===" followed by messages. Content lines that could be
# read as a header (or that start with the escape character) get one "\" prepended, so the
# text parses back unambiguously while staying readable.
_ROLE_RE = re.compile(r"^\[(\w+)\]$")


def _escape(line: str) -> str:
    needs = line.startswith(("\\", "===")) or _ROLE_RE.match(line)
    return "\\" + line if needs else line


def render_block(ids: list[int], messages: list[dict]) -> str:
    """One block of the judge's prompt: a header naming trajectories `ids`, then the messages."""
    label = f"trajectory {ids[0]}" if len(ids) == 1 else "trajectories " + ", ".join(map(str, ids))
    lines = [f"=== {label} ==="]
    for m in messages:
        lines.append(f"[{m['role']}]")
        # split("\n"), not splitlines(): every message has >= 1 content line and the
        # line count is exact, so an empty tool output is one empty line.
        lines.extend(_escape(line) for line in m["content"].split("\n"))
    return "\n".join(lines)


def judge_ids(tree) -> list[int]:
    """The id (1, 2, ...) the judge knows each trajectory of `tree` by, in trajectory order.
    Identical trajectories end at the same node, so they get one id and are judged once."""
    ends = {}

    def walk(node):
        ends.update(dict.fromkeys(node.rows, node))     # a row's deepest node is its end
        for child in node.children:
            walk(child)

    walk(tree)
    first = {}
    return [first.setdefault(id(ends[r]), len(first) + 1) for r in sorted(ends)]


def serialize(tree, ids) -> str:
    """Every node of the group's tree once, depth first, labelled with the ids of the
    trajectories through it; a chain of nodes with the same trajectories is one block."""
    blocks = []

    def walk(node):
        for child in node.children:
            messages = list(child.messages)
            while len(child.children) == 1 and child.children[0].rows == child.rows:
                child = child.children[0]
                messages += child.messages
            blocks.append(render_block(sorted({ids[r] for r in child.rows}), messages))
            walk(child)

    walk(tree)
    return "\n".join(blocks)


def conversation_tree(conversations: list[list[dict]]) -> Node:
    """The tree of conversations that come without a rollout's (a report, a benchmark, a test):
    a node a message, compared on (role, content)."""
    assert conversations, "a group needs at least one trajectory"
    for i, conversation in enumerate(conversations, 1):
        assert conversation, f"trajectory {i} has no messages (it needs at least its task)"
        for m in conversation:
            assert isinstance(m.get("content"), str) and re.fullmatch(r"\w+", m.get("role", "")), \
                f"bad message: {m}"
    return build_tree([[(0, [], [{"role": m["role"], "content": m["content"]}]) for m in c]
                       for c in conversations])


def build_prompt(tree, ids, rubric: str = DEFAULT_RUBRIC) -> list[dict]:
    """The judge's chat messages: the rubric in the system prompt, the group in the user turn."""
    user = f"Trajectory ids: {', '.join(map(str, range(1, max(ids) + 1)))}\n\n{serialize(tree, ids)}"
    return [{"role": "system", "content": SYSTEM_PROMPT.format(rubric=rubric.strip())},
            {"role": "user", "content": user}]


# ---------------------------------------------------------------- parsing the reply
# Reasoning judges think before they answer: inline, "<think> ... </think> answer" (the opening tag
# may be in the chat template's generation prompt, so only the closing one is needed), or in a
# separate field of the server's message, which HTTPBackend hands back in the same inline form.
_REASONING_TAG = re.compile(r"<(/?)(?:think|thinking|reasoning)>", re.IGNORECASE)   # group 1: "/" closes
REASONING_CHARS = 2000   # the reasoning a JudgeResult keeps: its end, where the judge concludes


def split_reasoning(text: str) -> tuple[str, str | None]:
    """(reasoning, answer): the answer is the text after the last closing reasoning tag, or None
    when a reasoning block opens there and never closes (the reply has no answer; all of it is
    then reasoning). The reasoning is returned without its tags.

    >>> split_reasoning("<think>1: 0.2? No, 0.9.</think> {...}")
    ('1: 0.2? No, 0.9.', ' {...}')
    >>> split_reasoning("{...}"), split_reasoning("<think>1 looks best, so")
    (('', '{...}'), ('1 looks best, so', None))
    """
    tags = list(_REASONING_TAG.finditer(text))
    cut = max((t.end() for t in tags if t.group(1)), default=0)
    reasoning, answer = text[:cut], text[cut:]
    if any(t.start() >= cut for t in tags):      # a block opened after the last close
        reasoning, answer = text, None
    return _REASONING_TAG.sub("", reasoning).strip(), answer


def _clip(reasoning: str) -> str:
    return reasoning if len(reasoning) <= REASONING_CHARS else "..." + reasoning[-REASONING_CHARS:]


def _find_json(text: str):
    """The first JSON object (or list) in `text` that holds scores: prose and fences skipped."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"[{\[]", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and isinstance(value.get("scores"), list):
            return value["scores"]
        if isinstance(value, list) and value and all(isinstance(e, dict) and "trajectory_id" in e
                                                     for e in value):
            return value
    raise ParseError("no JSON object with a \"scores\" list was found")


def _as_id(value) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"\s*(?:trajectory\s*)?#?(\d+)\s*", str(value), re.IGNORECASE)
    return int(match.group(1)) if match else None


def _as_score(value) -> float:
    if isinstance(value, bool):
        raise ParseError(f"score {value!r} is not a number")
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise ParseError(f"score {value!r} is not a number") from None
    if not math.isfinite(score):
        raise ParseError(f"score {value!r} is not finite")
    if score < 0:
        raise ParseError(f"score {value!r} is negative")
    return score


def parse_scores(text: str, n: int) -> tuple[list[float], list[str]]:
    """Scores and explanations for ids 1..n from a judge reply's answer (split_reasoning: never
    from its reasoning), the scores as written (any scale).

    Raises ParseError (with a message fit to send back to the judge) when the reply has no answer
    (ReasoningNeverClosed) or an empty one, or when any id is missing, scored twice, or has no
    finite, non-negative score. Ids outside 1..n are ignored.
    """
    reasoning, answer = split_reasoning(text)
    if answer is None:
        raise ReasoningNeverClosed("your reasoning never closed, so no answer came after it")
    if not answer.strip():
        raise ParseError("the reply was empty" + (" after the reasoning" if reasoning else ""))
    found: dict[int, tuple[float, str]] = {}
    for entry in _find_json(answer):
        if not isinstance(entry, dict):
            raise ParseError(f"entry {entry!r} is not an object")
        i = _as_id(entry.get("trajectory_id"))
        if i is None or not 1 <= i <= n:
            continue
        if i in found:
            raise ParseError(f"trajectory {i} is scored twice")
        if "score" not in entry:
            raise ParseError(f"trajectory {i} has no score")
        found[i] = (_as_score(entry["score"]), str(entry.get("explanation", "")))
    missing = [i for i in range(1, n + 1) if i not in found]
    if missing:
        raise ParseError(f"no score for trajectory ids {missing}")
    return [found[i][0] for i in range(1, n + 1)], [found[i][1] for i in range(1, n + 1)]


# ---------------------------------------------------------------- a judge on another scale
SCALES = {"0-10": 10.0, "0-100": 100.0}   # the scales judges are seen to use, smallest first


def unit_scale(scores: list[float]) -> tuple[list[float], str]:
    """(the scores mapped into [0, 1] in the same order, the scale they were read on): "0-1" as they
    are; else the smallest scale that holds them all, divided by its size; else "min-max", the lowest
    0 and the highest 1, absolute quality lost (GRPO's per-group normalization discards it anyway).

    >>> unit_scale([0, 0.5, 1]), unit_scale([1, 4, 7, 10]), unit_scale([150, 300, 900])
    (([0, 0.5, 1], '0-1'), ([0.1, 0.4, 0.7, 1.0], '0-10'), ([0.0, 0.2, 1.0], 'min-max'))

    A fraction (0 < s < 1) beside a score above 1 reads as two scales at once (0.8 on 0-1 beside 7
    on 0-10): no one rescale keeps that order, so it raises ParseError."""
    top, low = max(scores), min(scores)
    if top <= 1:
        return list(scores), "0-1"
    if fractions := [s for s in scores if 0 < s < 1]:
        raise ParseError(f"the scores mix scales ({fractions[0]:g} beside {top:g}); "
                         "score every trajectory from 0 to 1")
    scale = next((name for name, size in SCALES.items() if top <= size), "min-max")
    if scale == "min-max":
        return [(s - low) / (top - low) if top > low else 0.5 for s in scores], scale
    return [s / SCALES[scale] for s in scores], scale


# ---------------------------------------------------------------- how far to trust the judge
def agreement(scores: list[float], correct: list[bool]) -> float | None:
    """How often the judge ranks an execution-correct trajectory above a wrong one in its group:
    over every (correct, wrong) pair, 1 when the correct one scored higher, 1/2 for a tie, 0 when
    lower, averaged (the group's AUC). None for a group with nothing to rank: all right or all wrong.

    >>> agreement([0.9, 0.2, 0.5], [True, False, False]), agreement([0.3, 0.3, 0.8], [True, False, False])
    (1.0, 0.25)

    1.0: the judge always prefers the right answer; 0.5: it ranks as a coin would, and only adds
    noise to the correctness bonus; below 0.5: it prefers wrong answers.
    """
    assert len(scores) == len(correct), f"{len(scores)} scores for {len(correct)} trajectories"
    right = [s for s, c in zip(scores, correct) if c]
    wrong = [s for s, c in zip(scores, correct) if not c]
    if not right or not wrong:
        return None
    wins = sum((r > w) + 0.5 * (r == w) for r in right for w in wrong)
    return wins / (len(right) * len(wrong))


# ---------------------------------------------------------------- scoring a group
def score_group(tree, backend, rubric: str = DEFAULT_RUBRIC, max_retries: int = 2) -> JudgeResult:
    """Relative scores in [0, 1] for the trajectories of a group's tree (tree.Node; for bare
    conversations, conversation_tree), in trajectory order.

    Never raises on a bad judge: a backend failure, or replies still unusable after
    `max_retries` corrections, give `JudgeResult(scored=False, scores=None, error=...)`.
    Scores above 1 are sent back once with a correction; a judge that insists (or one with no
    correction left) has its scores rescaled into [0, 1] in order (`rescaled` names the scale).
    A correction turn repeats the judge's answer without its reasoning, as reasoning models'
    chat templates drop it from the history; the last reasoning is kept, clipped, for the logs.
    """
    assert max_retries >= 0, "max_retries must be >= 0"
    ids = judge_ids(tree)
    n = max(ids)
    prompt = build_prompt(tree, ids, rubric)
    # ask; on an unusable reply, or scores above 1 the first time, ask again with a short correction
    messages, error, range_corrected, reasoning = prompt, "", False, ""
    for attempt in range(1, max_retries + 2):
        try:
            reply = backend.complete(messages)
        except JudgeError as e:
            return JudgeResult(None, [], False, attempt, error=f"backend: {e}", reasoning=reasoning)
        reasoning, answer = split_reasoning(reply)
        reasoning, unclosed = _clip(reasoning), answer is None
        try:
            scores, explanations = parse_scores(reply, n)
            unit, scale = unit_scale(scores)
        except ParseError as e:
            error = str(e)
        else:
            # in range; or the judge insists on its scale after a correction, or may not be asked again
            if scale == "0-1" or range_corrected or attempt == max_retries + 1:
                return JudgeResult([unit[k - 1] for k in ids], [explanations[k - 1] for k in ids],
                                   True, attempt, rescaled="" if scale == "0-1" else scale,
                                   error=error, reasoning=reasoning)
            error = f"scores must be from 0 to 1, and this reply's go up to {max(scores):g}"
            range_corrected = True
        correction = CORRECTION.format(error=error, ids=", ".join(map(str, range(1, n + 1))))
        messages = prompt + [{"role": "assistant", "content": answer or ""},
                             {"role": "user", "content": correction}]
    if unclosed:   # the last reply was cut off mid-thought: say what to change
        budget = getattr(backend, "max_tokens", None)
        error = "the judge's reasoning never closed, so it gave no answer: raise the judge's max tokens" + \
                (f" (now {budget})" if budget else "")
    return JudgeResult(None, [], False, max_retries + 1, error=f"unparseable reply: {error}",
                       reasoning=reasoning)


# ---------------------------------------------------------------- backends
# A backend is any object with `cache_id: str` (what identifies its answers: kind + model)
# and `complete(messages) -> str`, the judge's whole reply, its reasoning included (inline, in
# `<think>...</think>` before the answer), raising JudgeError when it cannot answer. Both backends
# here also have `max_tokens`, the reply's token budget, which an unscored group's error names
# when the judge's reasoning ran past it.
class LocalBackend:
    """A Hugging Face causal LM on this machine, decoding greedily within a token budget.

    adapter_off: a function returning a context manager under which `model` is the judge, for
    the usual case where the judge is the policy's own base model: the trainer passes
    `lambda: lora.lora_disabled(model)`, so the judge does not drift with the policy (the
    default, a null context, judges with the model as it is). `max_tokens` is the reply's budget
    (new tokens); `max_context` defaults to the model's `max_position_embeddings`; a prompt that
    leaves fewer than `min_tokens` for the reply is refused with a JudgeError.
    """

    def __init__(self, model, tokenizer, max_tokens: int = 512, max_context: int | None = None,
                 min_tokens: int = 64, name: str | None = None, adapter_off=contextlib.nullcontext):
        self.model, self.tokenizer, self.adapter_off = model, tokenizer, adapter_off
        self.max_tokens, self.min_tokens = max_tokens, min_tokens
        self.max_context = max_context or model.config.max_position_embeddings
        self.cache_id = "local:" + (name or getattr(model.config, "_name_or_path", "")
                                    or type(model).__name__)

    @torch.inference_mode()
    def complete(self, messages: list[dict]) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        device = next(self.model.parameters()).device
        input_ids = self.tokenizer(text, add_special_tokens=False,
                                   return_tensors="pt").input_ids.to(device)  # (1, T)
        budget = min(self.max_tokens, self.max_context - input_ids.shape[1])
        if budget < self.min_tokens:
            raise JudgeError(f"prompt of {input_ids.shape[1]} tokens leaves {budget} of the "
                             f"{self.max_context}-token context for the reply (need {self.min_tokens})")
        was_training = self.model.training
        self.model.eval()
        try:
            with self.adapter_off():
                eos = self.tokenizer.eos_token_id
                out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                          do_sample=False, max_new_tokens=budget, eos_token_id=eos,
                                          pad_token_id=eos)  # (1, T + new)
        except torch.OutOfMemoryError as e:   # a long group on a full GPU: it goes unscored, the run goes on
            raise JudgeError(f"out of memory judging a {input_ids.shape[1]}-token prompt: "
                             f"{str(e)[:120]}") from e
        finally:
            self.model.train(was_training)
        return self.tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)


class CachedBackend:
    """A backend whose replies are kept on disk, by a hash of (its cache_id, the messages): a group
    judged again (a resumed run, a benchmark run twice) costs no call. A missing or unreadable entry
    is a miss; every other attribute is the wrapped backend's."""

    def __init__(self, backend, folder):
        self.backend, self.folder = backend, folder

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def complete(self, messages: list[dict]) -> str:
        digest = hashlib.sha256(json.dumps([self.backend.cache_id, messages]).encode()).hexdigest()
        path = os.path.join(self.folder, digest[:2], digest + ".json")
        try:
            entry = read_json(path)
        except (OSError, ValueError):
            entry = None
        if isinstance(entry, dict) and isinstance(entry.get("reply"), str):
            return entry["reply"]
        reply = self.backend.complete(messages)
        write_text_atomic(path, json.dumps({"reply": reply}, ensure_ascii=False))
        return reply


NO_MODEL_LIST = (404, 405, 501)   # GET /models answered "not here", "not this method", "not implemented"

# The verdict's shape, sent so that a server that constrains decoding makes the judge write it.
def verdict_schema(n: int | None, pin_ids: bool = False) -> dict:
    """The JSON schema of a verdict on trajectories 1..n: exactly n entries (any number for n None),
    each an id, an explanation, then a score (explanation first: the judge explains, then scores).
    Keywords that OpenAI's strict mode and llama.cpp both take; pin_ids (llama.cpp, whose grammar
    can) fixes entry k's id to k, so no id is missed or scored twice. No numeric bounds: servers
    do not enforce them, and the rescaling above reads any scale."""
    def entry(trajectory_id):
        return {"type": "object", "additionalProperties": False,
                "required": ["trajectory_id", "explanation", "score"],
                "properties": {"trajectory_id": trajectory_id, "explanation": {"type": "string"},
                               "score": {"type": "number"}}}
    if n is None:
        scores = {"type": "array", "items": entry({"type": "integer"})}
    elif pin_ids:
        scores = {"type": "array", "prefixItems": [entry({"const": k}) for k in range(1, n + 1)],
                  "minItems": n, "maxItems": n}
    else:
        scores = {"type": "array", "items": entry({"type": "integer", "enum": list(range(1, n + 1))}),
                  "minItems": n, "maxItems": n}
    return {"type": "object", "additionalProperties": False, "required": ["scores"],
            "properties": {"scores": scores}}


def _judged_count(messages: list[dict]) -> int | None:
    """How many trajectories build_prompt's "Trajectory ids: 1, 2, ..." line asks about; None for
    another prompt."""
    found = (re.search(r"^Trajectory ids: (\d+(?:, \d+)*)$", m["content"], re.MULTILINE)
             for m in messages if m["role"] == "user")
    match = next(filter(None, found), None)
    return len(match.group(1).split(", ")) if match else None


# The `response_format` ladder, most constrained first. OpenAI's structured-output form first:
# OpenAI, vLLM, SGLang, Ollama and llama-server honour it, and a server that does not know it
# refuses it (llama-cpp-python: a 500), where one may ignore llama.cpp's unknown `schema` key
# without a word. Then llama-cpp-python's form (JSON mode with a schema), JSON mode, nothing.
RESPONSE_FORMATS = ("json_schema", "json_object+schema", "json_object", "none")
FORMAT_REFUSED = (400, 422, 500)   # how servers refuse a response_format they do not support


def format_body(name: str, n: int | None) -> dict | None:
    """The request's `response_format` at a rung of RESPONSE_FORMATS, for a verdict on n trajectories
    (None: send none)."""
    if name == "json_schema":
        return {"type": "json_schema",
                "json_schema": {"name": "verdict", "strict": True, "schema": verdict_schema(n)}}
    if name == "json_object+schema":
        return {"type": "json_object", "schema": verdict_schema(n, pin_ids=True)}
    return {"type": "json_object"} if name == "json_object" else None


class HTTPBackend:
    """Any OpenAI-compatible `/v1/chat/completions` endpoint, with the standard library only.

    Arguments fall back to the usual environment variables: OPENAI_BASE_URL (default
    https://api.openai.com/v1), OPENAI_API_KEY (may be empty for a local vLLM or Ollama) and
    AGENTRL_JUDGE_MODEL. `max_tokens` is the reply's budget, reasoning included, and `timeout_s`
    one request's: a reasoning judge needs far more of both than an instruct judge. Failures
    that may pass (429, 5xx, timeouts, refused connections) are retried `max_retries` times,
    waiting `backoff_s * 2**k` seconds, or what a 429's Retry-After asks (capped at `max_wait_s`).
    The verdict's schema is asked for from the rung `response_format` of RESPONSE_FORMATS down:
    until the server has accepted a format, a 400, 422 or 500 steps down at once (no retry
    spent), for this request and every later one; after that, those codes mean what they usually do.
    A separate reasoning field comes back inline (_inline_reasoning).
    """

    def __init__(self, base_url: str | None = None, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 60, max_retries: int = 4, backoff_s: float = 1.0, max_wait_s: float = 60,
                 max_tokens: int = 2048, response_format: str = "json_schema"):
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL")
                         or "https://api.openai.com/v1").rstrip("/")
        self.model = model or os.environ.get("AGENTRL_JUDGE_MODEL")
        if not self.model:
            raise ValueError("no judge model: pass model= or set AGENTRL_JUDGE_MODEL")
        assert response_format in RESPONSE_FORMATS, f"response_format must be one of {list(RESPONSE_FORMATS)}"
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.backoff_s, self.max_wait_s = backoff_s, max_wait_s
        self.max_tokens, self.response_format, self.format_accepted = max_tokens, response_format, False
        self.cache_id = f"http:{self.base_url}:{self.model}"

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def check(self) -> str | None:
        """Why the endpoint is unusable (unreachable, key refused, server error), or None if fine.

        One GET of `/models`, no retries: meant for a trainer's start, to fail fast. A server that
        answers but does not list models (404, 405, 501) counts as reachable: several
        OpenAI-compatible servers and proxies serve chat completions only. A 401/403 or another
        5xx is a problem, as is a refused connection.
        """
        request = urllib.request.Request(self.base_url + "/models", headers=self._headers())
        try:
            with urllib.request.urlopen(request, timeout=min(self.timeout_s, 10)):
                return None
        except urllib.error.HTTPError as e:
            return None if e.code in NO_MODEL_LIST else f"HTTP {e.code} from {self.base_url}/models"
        except (OSError, http.client.HTTPException) as e:
            return f"cannot reach {self.base_url}: {e!r}"

    def _post(self, messages: list[dict]) -> str:
        body = {"model": self.model, "messages": messages, "temperature": 0, "max_tokens": self.max_tokens}
        shape = format_body(self.response_format, _judged_count(messages))
        if shape is not None:
            body["response_format"] = shape
        request = urllib.request.Request(self.base_url + "/chat/completions", json.dumps(body).encode(),
                                         self._headers())
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return response.read().decode("utf-8")

    def complete(self, messages: list[dict]) -> str:
        retries = 0
        while True:
            wait, why = None, ""
            try:
                choice = json.loads(self._post(messages))["choices"][0]
                self.format_accepted = True
                return _inline_reasoning(choice["message"], choice.get("finish_reason"))
            except urllib.error.HTTPError as e:
                detail = e.read().decode("utf-8", "replace")[:300]
                if e.code in FORMAT_REFUSED and not self.format_accepted and self.response_format != "none":
                    # refused: ask again one rung down, and start there from now on
                    self.response_format = RESPONSE_FORMATS[RESPONSE_FORMATS.index(self.response_format) + 1]
                    continue
                if e.code != 429 and e.code < 500:
                    raise JudgeError(f"HTTP {e.code} from {self.base_url}: {detail}") from None
                why = f"HTTP {e.code}: {detail}"
                wait = _retry_after(e.headers.get("Retry-After")) if e.code == 429 else None
            except (json.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError) as e:
                why = f"malformed response body ({e!r})"
            except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out
                why = f"connection failed: {e!r}"
            if retries == self.max_retries:
                raise JudgeError(f"giving up after {retries + 1} requests; last: {why}")
            time.sleep(min(self.max_wait_s, wait if wait is not None else self.backoff_s * 2 ** retries))
            retries += 1


def _inline_reasoning(message: dict, finish_reason: str | None) -> str:
    """A chat completion's message as one text: a reasoning field (`reasoning_content`, or
    `reasoning`) before the content, `<think>reasoning</think>content`; with no content, and
    reasoning or a token cap hit (the budget spent thinking, shown or hidden), `<think>reasoning`:
    reasoning that never closed."""
    content = message.get("content") or ""
    reasoning = next((r for r in (message.get("reasoning_content"), message.get("reasoning"))
                      if isinstance(r, str) and r), "")
    if not content.strip() and (reasoning or finish_reason == "length"):
        return f"<think>{reasoning}"
    return f"<think>{reasoning}</think>{content}" if reasoning else content


def _retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds form; an HTTP date falls back to backoff)."""
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        return None

