"""The relative judge: an LLM ranks a group of trajectories that attempted the same task.

RULER (OpenPipe, 2025): an LLM ranks several attempts at one task against each other far better
than it scores one attempt alone, and GRPO only needs scores that are right relative to the group.
So the judge sees the whole group in one prompt and returns one score in [0, 1] per trajectory:

    result = score_group([t.messages for t in group.trajectories], HTTPBackend(model="gpt-4.1-mini"))
    result.scores        # [0.9, 0.1, ...] in trajectory order, or None if the group is unscored

What this file adds to RULER:
1. Trie serialization: the trajectories' messages go into a trie (one node a message), and every
   branch is printed once, labelled with the ids of the trajectories that share it; trajectory k
   is every block whose label lists k, top to bottom (`parse_serialized` reads it back).
   Identical trajectories are scored once and the score copied.
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
   Results are cached on disk by a hash of (backend, model, prompt).
5. Calibration: `agreement` measures how often the judge ranks an execution-correct trajectory
   above a wrong one in the same group (a per-group AUC); near 0.5, the judge adds noise.

Simplifications, and why they are safe:
- The trie is message-level: two turns that differ in one token are two messages.
- Messages are compared on (role, content) only; extra keys are not part of what is judged.
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
from dataclasses import dataclass, field

import torch

from files import common_prefix_length, read_json, write_text_atomic

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
    """A reply whose reasoning block never closed, so it has no answer: the token budget ran out mid-thought."""


@dataclass
class JudgeResult:
    scores: list[float] | None      # (N,) in the order of the conversations; None = unscored
    explanations: list[str]         # (N,) the judge's reasons; empty when unscored
    scored: bool
    attempts: int                   # backend calls made (0 when served from the cache); attempts - 1 corrections
    rescaled: str = ""              # the scale a reply above [0, 1] was read on: "0-10", "0-100", "min-max"
    error: str = ""                 # why the group is unscored, or the last error retried past
    cached: bool = False
    reasoning: str = ""             # the judge's reasoning before its verdict (last reply), clipped; for logs, never scored


# ---------------------------------------------------------------- serialization
# A message is printed as a role line "[role]" followed by its content, verbatim. A block is a
# header line "=== trajectories 1, 3 ===" followed by messages. Content lines that could be
# read as a header (or that start with the escape character) get one "\" prepended, so the
# text parses back unambiguously while staying readable.
_BLOCK_RE = re.compile(r"^=== trajector(?:y|ies) (\d+(?:, \d+)*) ===$")
_ROLE_RE = re.compile(r"^\[(\w+)\]$")


def _escape(line: str) -> str:
    needs = line.startswith(("\\", "===")) or _ROLE_RE.match(line)
    return "\\" + line if needs else line


def _render_block(ids: list[int], messages: list[dict]) -> str:
    label = f"trajectory {ids[0]}" if len(ids) == 1 else "trajectories " + ", ".join(map(str, ids))
    lines = [f"=== {label} ==="]
    for m in messages:
        lines.append(f"[{m['role']}]")
        # split("\n"), not splitlines(): every message has >= 1 content line and the
        # line count is exact, so an empty tool output is one empty line.
        lines.extend(_escape(line) for line in m["content"].split("\n"))
    return "\n".join(lines)


def _check(conversations: list[list[dict]]) -> None:
    assert conversations, "a group needs at least one trajectory"
    for i, conv in enumerate(conversations, 1):
        assert conv, f"trajectory {i} has no messages (it needs at least its task)"
        for m in conv:
            assert isinstance(m.get("content"), str), f"trajectory {i}: content must be a str: {m}"
            assert re.fullmatch(r"\w+", m.get("role", "")), f"trajectory {i}: bad role: {m}"


def serialize_naive(conversations: list[list[dict]]) -> str:
    """Every trajectory in full: the baseline cost."""
    _check(conversations)
    return "\n".join(_render_block([i], conv) for i, conv in enumerate(conversations, 1))


def serialize_ruler(conversations: list[list[dict]]) -> str:
    """RULER's layout: the messages common to *all* trajectories once, then each remainder."""
    _check(conversations)
    n = shared_prefix_length(conversations)
    blocks = [_render_block(list(range(1, len(conversations) + 1)), conversations[0][:n])] if n else []
    blocks += [_render_block([i], c[n:]) for i, c in enumerate(conversations, 1) if c[n:]]
    return "\n".join(blocks)


def shared_prefix_length(conversations: list[list[dict]]) -> int:
    """How many leading messages every conversation shares, compared on (role, content): the block
    that RULER's layout, and the trie's first block, print once for the whole group."""
    return common_prefix_length([[_key(m) for m in c] for c in conversations])


def _key(message: dict) -> tuple[str, str]:
    return message["role"], message["content"]


@dataclass
class _Node:
    message: dict | None
    ids: list[int] = field(default_factory=list)                  # trajectories through here
    children: dict[tuple, "_Node"] = field(default_factory=dict)  # insertion-ordered


def serialize_trie(conversations: list[list[dict]]) -> str:
    """Every branch of the message trie once, labelled with the trajectories that share it."""
    _check(conversations)
    root = _Node(None)
    for i, conv in enumerate(conversations, 1):
        node = root
        for m in conv:
            node = node.children.setdefault(_key(m), _Node({"role": m["role"], "content": m["content"]}))
            node.ids.append(i)
    blocks = []

    def walk(node: _Node) -> None:
        # Depth-first, so the blocks of one trajectory appear in conversation order. A chain
        # of nodes shared by exactly the same trajectories is one block (path compression).
        for child in node.children.values():
            messages = [child.message]
            while len(child.children) == 1 and next(iter(child.children.values())).ids == child.ids:
                child = next(iter(child.children.values()))
                messages.append(child.message)
            blocks.append(_render_block(child.ids, messages))
            walk(child)

    walk(root)
    return "\n".join(blocks)


def parse_serialized(text: str) -> list[list[dict]]:
    """Inverse of the three serializers: trajectory k = every block listing k, in order."""
    conversations: dict[int, list[dict]] = {}
    ids: list[int] = []
    message = None
    for line in text.split("\n"):
        block, role = _BLOCK_RE.match(line), _ROLE_RE.match(line)
        if block:
            ids, message = [int(x) for x in block.group(1).split(", ")], None
        elif role:
            assert ids, f"role line before any block header: {line!r}"
            message = {"role": role.group(1), "content": None}
            for i in ids:  # the same dict in every sharing trajectory: filled in below
                conversations.setdefault(i, []).append(message)
        else:
            assert message is not None, f"content line outside a message: {line!r}"
            line = line[1:] if line.startswith("\\") else line
            message["content"] = line if message["content"] is None else message["content"] + "\n" + line
    assert sorted(conversations) == list(range(1, len(conversations) + 1)), "ids must be 1..N"
    return [[dict(m) for m in conversations[i]] for i in sorted(conversations)]


def build_prompt(conversations: list[list[dict]], rubric: str = DEFAULT_RUBRIC,
                 serializer=serialize_trie) -> list[dict]:
    """The judge's chat messages: the rubric in the system prompt, the group in the user turn."""
    ids = ", ".join(str(i) for i in range(1, len(conversations) + 1))
    user = f"Trajectory ids: {ids}\n\n{serializer(conversations)}"
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
        if isinstance(value, list) and value and all(isinstance(e, dict) and "trajectory_id" in e for e in value):
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


def evident_scale(scores: list[float]) -> str:
    """The scale a reply's (non-negative) scores are on: the smallest that holds them all.

    >>> evident_scale([0, 0.5, 1]), evident_scale([1, 4, 7, 10]), evident_scale([35, 90]), evident_scale([150, 900])
    ('0-1', '0-10', '0-100', 'min-max')

    "min-max" means no known scale holds them. A fraction of one (0 < s < 1) beside a score
    above 1 reads as two scales at once (0.8 on 0-1 beside 7 on 0-10): no single rescale keeps
    that order, so it raises ParseError.
    """
    top = max(scores)
    if top <= 1:
        return "0-1"
    fractions = [s for s in scores if 0 < s < 1]
    if fractions:
        raise ParseError(f"the scores mix scales ({fractions[0]:g} beside {top:g}); score every trajectory from 0 to 1")
    return next((name for name, size in SCALES.items() if top <= size), "min-max")


def rescale(scores: list[float], scale: str) -> list[float]:
    """Scores on `scale` mapped into [0, 1], their order and spacing kept.

    >>> rescale([1, 4, 7, 10], "0-10"), rescale([150, 300, 900], "min-max")
    ([0.1, 0.4, 0.7, 1.0], [0.0, 0.2, 1.0])

    Min-max is the last resort: it stretches the group to fill [0, 1] (lowest 0, highest 1), so
    absolute quality is lost, which GRPO's per-group normalization discards anyway. A group
    whose scores are all equal has nothing to rank: 0.5 each.
    """
    if scale == "0-1":
        return list(scores)
    if scale == "min-max":
        low, high = min(scores), max(scores)
        return [(s - low) / (high - low) if high > low else 0.5 for s in scores]
    return [s / SCALES[scale] for s in scores]


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
def deduplicate(conversations: list[list[dict]]) -> tuple[list[list[dict]], list[int]]:
    """(unique, index): the distinct conversations in first-seen order, and for each conversation
    the position of its copy in `unique`. The judge's prompt numbers `unique` 1, 2, ...: the
    trajectory i of a group is the judge's trajectory index[i] + 1."""
    unique, index, seen = [], [], {}
    for conv in conversations:
        key = json.dumps([_key(m) for m in conv])
        if key not in seen:
            seen[key] = len(unique)
            unique.append(conv)
        index.append(seen[key])
    return unique, index


def score_group(conversations: list[list[dict]], backend, rubric: str = DEFAULT_RUBRIC,
                max_retries: int = 2, cache_dir: str | None = None) -> JudgeResult:
    """Relative scores in [0, 1] for a group of trajectories that attempted the same task.

    Never raises on a bad judge: a backend failure, or replies still unusable after
    `max_retries` corrections, give `JudgeResult(scored=False, scores=None, error=...)`.
    Scores above 1 are sent back once with a correction; a judge that insists (or one with no
    correction left) has its scores rescaled into [0, 1] in order (`rescaled` names the scale).
    Scores come from the answer only; the last reply's reasoning is kept in `reasoning`, clipped
    to its last REASONING_CHARS characters. A correction turn repeats the judge's answer without
    its reasoning, as reasoning models' chat templates drop it from the history.
    """
    _check(conversations)
    assert max_retries >= 0, "max_retries must be >= 0"
    # 1) identical trajectories are judged once: unique[k] stands for every i with index[i] == k
    unique, index = deduplicate(conversations)

    def expand(scores, explanations, **info) -> JudgeResult:
        return JudgeResult([scores[k] for k in index], [explanations[k] for k in index], True, **info)

    # 2) the prompt, and the cache entry it would have
    prompt = build_prompt(unique, rubric)
    path = None
    if cache_dir is not None:
        digest = hashlib.sha256(json.dumps([backend.cache_id, prompt]).encode()).hexdigest()
        path = os.path.join(cache_dir, digest[:2], digest + ".json")
        hit = _read_cache(path)
        if hit is not None:
            return expand(hit["scores"], hit["explanations"], attempts=0, rescaled=hit["rescaled"], cached=True,
                          reasoning=hit.get("reasoning", ""))

    # 3) ask; on an unusable reply, or scores above 1 the first time, ask again with a short correction
    messages, error, range_corrected, reasoning = prompt, "", False, ""
    for attempt in range(1, max_retries + 2):
        try:
            reply = backend.complete(messages)
        except JudgeError as e:
            return JudgeResult(None, [], False, attempt, error=f"backend: {e}", reasoning=reasoning)
        reasoning, answer = split_reasoning(reply)
        reasoning, unclosed = _clip(reasoning), answer is None
        try:
            scores, explanations = parse_scores(reply, len(unique))
            scale = evident_scale(scores)
        except ParseError as e:
            error = str(e)
        else:
            # in range; or the judge insists on its scale after a correction, or may not be asked again
            if scale == "0-1" or range_corrected or attempt == max_retries + 1:
                scores, rescaled = rescale(scores, scale), "" if scale == "0-1" else scale
                if path is not None:
                    write_text_atomic(path, json.dumps({"scores": scores, "explanations": explanations, "rescaled": rescaled,
                                                        "reasoning": reasoning}, ensure_ascii=False))
                return expand(scores, explanations, attempts=attempt, rescaled=rescaled, error=error, reasoning=reasoning)
            error, range_corrected = f"scores must be from 0 to 1, and this reply's go up to {max(scores):g}", True
        ids = ", ".join(str(i) for i in range(1, len(unique) + 1))
        messages = prompt + [{"role": "assistant", "content": answer or ""},
                             {"role": "user", "content": CORRECTION.format(error=error, ids=ids)}]
    if unclosed:   # the last reply was cut off mid-thought: say what to change
        budget = getattr(backend, "max_tokens", None)
        error = "the judge's reasoning never closed, so it gave no answer: raise the judge's max tokens" + \
                (f" (now {budget})" if budget else "")
    return JudgeResult(None, [], False, max_retries + 1, error=f"unparseable reply: {error}", reasoning=reasoning)


def _read_cache(path: str) -> dict | None:
    """A cached judgement, or None: a missing or corrupt entry, or one without the "rescaled" key
    (its scores may have been clamped), is a miss."""
    try:
        entry = read_json(path)
    except (OSError, json.JSONDecodeError):
        return None
    return entry if isinstance(entry, dict) and {"scores", "explanations", "rescaled"} <= entry.keys() else None


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
        self.cache_id = "local:" + (name or getattr(model.config, "_name_or_path", "") or type(model).__name__)

    @torch.inference_mode()
    def complete(self, messages: list[dict]) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        device = next(self.model.parameters()).device
        input_ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(device)  # (1, T)
        budget = min(self.max_tokens, self.max_context - input_ids.shape[1])
        if budget < self.min_tokens:
            raise JudgeError(f"prompt of {input_ids.shape[1]} tokens leaves {budget} of the "
                             f"{self.max_context}-token context for the reply (need {self.min_tokens})")
        was_training = self.model.training
        self.model.eval()
        try:
            with self.adapter_off():
                eos = self.tokenizer.eos_token_id
                out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                          max_new_tokens=budget, eos_token_id=eos, pad_token_id=eos)  # (1, T + new)
        except torch.OutOfMemoryError as e:   # a long group on a full GPU: this group goes unscored, the run goes on
            raise JudgeError(f"out of memory judging a {input_ids.shape[1]}-token prompt: {str(e)[:120]}") from e
        finally:
            self.model.train(was_training)
        return self.tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)


NO_MODEL_LIST = (404, 405, 501)   # GET /models answered "not here", "not this method", "not implemented"

# The verdict's shape, sent so that a server that constrains decoding makes the judge write it.
def verdict_schema(n: int | None, pin_ids: bool = False) -> dict:
    """The JSON schema of a verdict on trajectories 1..n: exactly n entries (any number for n None),
    each an id, an explanation, then a score (explanation first: the judge explains, then scores).
    Keywords that OpenAI's strict mode and llama.cpp both take; pin_ids (llama.cpp, whose grammar
    can) fixes entry k's id to k, so no id is missed or scored twice. No numeric bounds: servers
    do not enforce them, and the rescaling above reads any scale."""
    def entry(trajectory_id):
        return {"type": "object", "additionalProperties": False, "required": ["trajectory_id", "explanation", "score"],
                "properties": {"trajectory_id": trajectory_id, "explanation": {"type": "string"},
                               "score": {"type": "number"}}}
    if n is None:
        scores = {"type": "array", "items": entry({"type": "integer"})}
    elif pin_ids:
        scores = {"type": "array", "prefixItems": [entry({"const": k}) for k in range(1, n + 1)], "minItems": n, "maxItems": n}
    else:
        scores = {"type": "array", "items": entry({"type": "integer", "enum": list(range(1, n + 1))}), "minItems": n, "maxItems": n}
    return {"type": "object", "additionalProperties": False, "required": ["scores"], "properties": {"scores": scores}}


def _judged_count(messages: list[dict]) -> int | None:
    """How many trajectories build_prompt's "Trajectory ids: 1, 2, ..." line asks about; None for another prompt."""
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
    """The request's `response_format` at a rung of RESPONSE_FORMATS, for a verdict on n trajectories (None: send none)."""
    if name == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "verdict", "strict": True, "schema": verdict_schema(n)}}
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
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1").rstrip("/")
        self.model = model or os.environ.get("AGENTRL_JUDGE_MODEL")
        if not self.model:
            raise ValueError("no judge model: pass model= or set AGENTRL_JUDGE_MODEL")
        assert response_format in RESPONSE_FORMATS, f"response_format must be one of {list(RESPONSE_FORMATS)}"
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.timeout_s, self.max_retries, self.backoff_s, self.max_wait_s = timeout_s, max_retries, backoff_s, max_wait_s
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
        request = urllib.request.Request(self.base_url + "/chat/completions", json.dumps(body).encode(), self._headers())
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
    reasoning = next((r for r in (message.get("reasoning_content"), message.get("reasoning")) if isinstance(r, str) and r), "")
    if not content.strip() and (reasoning or finish_reason == "length"):
        return f"<think>{reasoning}"
    return f"<think>{reasoning}</think>{content}" if reasoning else content


def _retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds form; an HTTP date falls back to backoff)."""
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        return None

