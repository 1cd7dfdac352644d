"""The relative judge: an LLM ranks a group of trajectories that attempted the same task.

RULER (OpenPipe, 2025): an LLM ranks several attempts at one task against each other far better
than it scores one attempt alone, and GRPO only needs scores that are right relative to the group.
So the judge sees the whole group in one prompt and returns one score in [0, 1] per trajectory:

    result = score_group(group.tree, judge_backends.HTTPBackend(model="gpt-4.1-mini"))   # tree.Node
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
4. Any backend (judge_backends.py): an object whose `complete(messages)` returns the reply as
   text. `LocalBackend` reads a Hugging Face model's probabilities over the score's digits
   (G-Eval), so it always answers; `HTTPBackend` speaks the OpenAI `/v1/chat/completions`
   protocol, asks for the verdict's JSON schema, and hands a separate reasoning field back inline
   as `<think>...</think>`, so one parser reads every judge. Whatever a backend raises or returns
   instead of text leaves the group unscored, never the run ended.
5. Calibration: `agreement` measures how often the judge ranks an execution-correct trajectory
   above a wrong one in the same group (a per-group AUC); near 0.5, the judge adds noise.

Simplifications, and why they are safe:
- Nodes end at turns: two turns that differ in one token are two nodes, printed whole.
"""
import json
import math
import re
from dataclasses import dataclass

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
        ends.update(dict.fromkeys(node.through, node))     # a row's deepest node is its end
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
            while len(child.children) == 1 and child.children[0].through == child.through:
                child = child.children[0]
                messages += child.messages
            blocks.append(render_block(sorted({ids[r] for r in child.through}), messages))
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
            if not isinstance(reply, str):
                raise TypeError(f"the backend replied with a {type(reply).__name__}, not text")
        except Exception as e:    # whatever a backend raises leaves the group unscored, never the run ended
            why = str(e) if isinstance(e, JudgeError) else repr(e)
            return JudgeResult(None, [], False, attempt, error=f"backend: {why}", reasoning=reasoning)
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
