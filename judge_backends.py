"""Who answers the judge's prompt (judge.py): a model on this machine read from its probabilities,
any OpenAI-compatible server, a disk cache around either, and the one train.py picks.

    backend = LocalBackend(model, tokenizer)                  # G-Eval: it always answers
    backend = HTTPBackend(base_url=..., model="gpt-4.1-mini") # OpenAI, vLLM, llama.cpp, Ollama, ...
    backend = CachedBackend(backend, "runs/x/judge_cache")    # a reply asked for again costs nothing
    judge.score_group(group.tree, backend)

A backend is any object with `cache_id: str` (what identifies its answers: kind + model) and
`complete(messages) -> str`, the judge's whole reply, its reasoning included (inline, in
`<think>...</think>` before the answer), raising JudgeError when it cannot answer; whatever else
it raises or returns, judge.score_group leaves the group unscored, never the run ended.

Simplifications, and why they are safe:
- Backoff has no jitter: one trainer talks to one endpoint.
- A prompt longer than the local model's context is refused (unscored), never truncated: a
  relative judgement must see every trajectory it ranks.
"""
import contextlib
import copy
import hashlib
import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request

import torch

import lora
from files import read_json, write_text_atomic
from judge import JudgeError

# ---------------------------------------------------------------- a model on this machine
class LocalBackend:
    """A Hugging Face causal LM on this machine, read from its probabilities, not its samples: it
    always answers. G-Eval (Liu et al. 2023, arXiv:2303.16634) takes a score as the expectation
    of the judge's next-token distribution over the score tokens, which never fails to parse and
    ranks better than one sampled score. Here the judge's chat is followed, for each trajectory
    k, by the verdict's opening as the judge would write it, teacher-forced:

        {"scores": [{"trajectory_id": k, "score": |0.|
                                                   ^ p0, p1: P(next = "0"), P(next = "1")
                                                      ^ after "0.": the digits' distribution, mean E

    score_k = (p1 + p0 * E / 10) / (p0 + p1), in [0, 1]. The prompt is forwarded once and each
    trajectory's opening continues a copy of its KV cache. `complete` returns the verdict as the
    JSON a server's judge writes, so score_group reads both alike.

    adapter_off: a function returning a context manager under which `model` is the judge, for
    the usual case where the judge is the policy's own base model: the trainer passes
    `lambda: lora.lora_disabled(model)`, so the judge does not drift with the policy. A prompt
    longer than `max_context` (default: the model's `max_position_embeddings`) is refused with a
    JudgeError, as is running out of GPU memory: the group goes unscored, the run goes on.
    """
    OPENING = '{{"scores": [{{"trajectory_id": {k}, "score": '

    def __init__(self, model, tokenizer, max_context: int | None = None, name: str | None = None,
                 adapter_off=contextlib.nullcontext):
        self.model, self.tokenizer, self.adapter_off = model, tokenizer, adapter_off
        self.max_context = max_context or model.config.max_position_embeddings
        self.cache_id = "local-probabilities:" + (name or getattr(model.config, "_name_or_path", "")
                                                  or type(model).__name__)
        pieces = [self._ids(text) for text in [*"0123456789", "."]]
        if any(len(p) != 1 for p in pieces):
            raise ValueError("the judge's tokenizer must write each digit and '.' as one token")
        self.digits, self.dot = torch.tensor([p[0] for p in pieces[:10]]), pieces[10][0]

    def _ids(self, text) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    @torch.inference_mode()
    def expected_scores(self, messages: list[dict], n: int) -> list[float]:
        """The expected score of each of trajectories 1..n (see the class docstring)."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt, zero = self._ids(text), self.digits[0].item()
        openings = [self._ids(self.OPENING.format(k=k)) + [zero, self.dot] for k in range(1, n + 1)]
        if len(prompt) + max(map(len, openings)) > self.max_context:
            raise JudgeError(f"prompt of {len(prompt)} tokens does not fit the judge's "
                             f"{self.max_context}-token context")
        device, was_training = next(self.model.parameters()).device, self.model.training
        self.model.eval()
        try:
            with self.adapter_off():
                cache = self.model(torch.tensor([prompt], device=device), use_cache=True).past_key_values
                scores, keyword = [], lora.cache_keyword(self.model)    # (past_key_values= or cache=)
                digit_ids, values = self.digits.to(device), torch.arange(10, device=device)
                for opening in openings:
                    logits = self.model(torch.tensor([opening], device=device), use_cache=True,
                                        **{keyword: copy.deepcopy(cache)}).logits[0].float()  # (L, V)
                    p0, p1 = logits[-3].softmax(-1)[digit_ids[:2]]       # after `"score": `: "0" or "1"
                    digits = logits[-1].softmax(-1)[digit_ids]            # after `0.`
                    expected = (digits * values).sum() / digits.sum()
                    scores.append(((p1 + p0 * expected / 10) / (p0 + p1)).item())
        except torch.OutOfMemoryError as e:   # a long group on a full GPU: it goes unscored, the run goes on
            raise JudgeError(f"out of memory judging a {len(prompt)}-token prompt: {str(e)[:120]}") from e
        finally:
            self.model.train(was_training)
        return scores

    def complete(self, messages: list[dict]) -> str:
        n = _judged_count(messages)
        if n is None:
            raise JudgeError("the local judge reads build_prompt's prompts, which name the trajectory ids")
        scores = self.expected_scores(messages, n)
        return json.dumps({"scores": [{"trajectory_id": k, "score": round(s, 6),
                                       "explanation": "expected over the judge's probabilities"}
                                      for k, s in enumerate(scores, 1)]})


# ---------------------------------------------------------------- a cache around any backend
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


# ---------------------------------------------------------------- an OpenAI-compatible server
MAX_REPLY_BYTES = 10_000_000     # a longer reply body is malformed (a verdict is a few kB)
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
            body = response.read(MAX_REPLY_BYTES + 1)
        if len(body) > MAX_REPLY_BYTES:
            raise ValueError(f"a reply of over {MAX_REPLY_BYTES} bytes")
        return body.decode("utf-8", "replace")    # any bytes: a bad one becomes U+FFFD, the rest is read

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
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:   # JSON errors too
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


# ---------------------------------------------------------------- the judge a run uses
HTTP_JUDGE = "gpt-4.1-mini"   # --judge http's model where neither --judge-model nor $AGENTRL_JUDGE_MODEL is


def judge_kind(config, device_type, environ=os.environ) -> tuple[str, str]:
    """(the judge --judge names, why): auto is a judge server where one is set up (RULER's usual
    setup, a stronger judge than the policy), else on a GPU the policy's base model, else none."""
    if config.judge != "auto":
        return config.judge, "--judge"
    if environ.get("OPENAI_BASE_URL") or environ.get("OPENAI_API_KEY"):
        return "http", "--judge auto, and OPENAI_BASE_URL or OPENAI_API_KEY is set"
    if device_type == "cuda":
        return "local", "--judge auto on a GPU, no judge server set (OPENAI_BASE_URL)"
    return "none", "--judge auto on a CPU: a 135M model judging itself is noise"


def make_judge(config, model, tokenizer, device):
    """Return a judge backend, or None for `--judge none` (rewards = correctness bonus alone), and
    print which and why. An http endpoint that does not answer at start is an error."""
    kind, why = judge_kind(config, device.type)
    backend = None
    if kind.startswith("http"):
        url = kind if "://" in kind else None     # --judge http: $OPENAI_BASE_URL
        name = config.judge_model or os.environ.get("AGENTRL_JUDGE_MODEL") or HTTP_JUDGE
        backend = HTTPBackend(base_url=url, model=name, max_tokens=config.judge_max_tokens,
                              timeout_s=60 + config.judge_max_tokens / 10)   # a server writes 10 tokens/s
        if (problem := backend.check()) is not None:
            raise SystemExit(f"judge endpoint unreachable: {problem}\n"
                             f"fix --judge URL, or train with --judge local or none")
        what = f"{name} at {backend.base_url}"
    elif kind == "local" and config.judge_model:
        backend = LocalBackend(*lora.load_model(config.judge_model, device=device))
        what = f"{config.judge_model} on this machine, read from its probabilities"
    elif kind == "local":   # the policy's base model, its LoRA switched off while it judges
        backend = LocalBackend(model, tokenizer, adapter_off=lambda: lora.lora_disabled(model))
        what = "the policy's base model (LoRA off), read from its probabilities"
    print(f"judge: {what if backend else 'none, the reward is the correctness bonus alone'} ({why})")
    return backend
