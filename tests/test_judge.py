"""Tests for judge.py: serialization, reply parsing, score_group, HTTP and local backends.

The HTTP backend is tested against a real http.server on 127.0.0.1 that plays a script of
responses; the local backend against conftest's tiny random Llama and embedded tokenizer.
"""
import contextlib
import doctest
import http.server
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import agentrl
import judge
import judge_backends
import sql_env
from judge import (JudgeError, ParseError, ReasoningNeverClosed, agreement, conversation_tree, judge_ids,
                   parse_scores, serialize, split_reasoning, unit_scale)
from judge_backends import CachedBackend, HTTPBackend, LocalBackend

ROOT = Path(__file__).resolve().parents[1]


def score_group(conversations, backend, **options):
    """judge.score_group on the conversations' tree (the trainer passes its rollout's)."""
    return judge.score_group(conversation_tree(conversations), backend, **options)


def msg(role, content):
    return {"role": role, "content": content}


SYS, USER = msg("system", "You answer with SQL tools."), msg("user", "How many singers are there?")
CALL_A = msg("assistant", '<tool_call>{"name": "list_tables", "arguments": {}}</tool_call>')
OBS_A = msg("tool", "singer\nconcert")
CALL_B = msg("assistant", '<tool_call>{"name": "run_sql", "arguments": {"sql": "SELECT COUNT(*) FROM singer"}}</tool_call>')


def group():
    """1 and 2 share their first tool call and its observation; 3 goes its own way."""
    return [[SYS, USER, CALL_A, OBS_A, msg("assistant", "There are 6.")],
            [SYS, USER, CALL_A, OBS_A, CALL_B, msg("tool", "[(6,)]")],
            [SYS, USER, msg("assistant", "I don't know.")]]


class Scripted:
    """A backend that replays canned replies and records the prompts it was sent."""
    cache_id = "scripted"

    def __init__(self, *replies):
        self.replies, self.prompts = list(replies), []

    def complete(self, messages):
        self.prompts.append(messages)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def reply(*scores):
    return json.dumps({"scores": [{"trajectory_id": i, "explanation": f"e{i}", "score": s}
                                  for i, s in enumerate(scores, 1)]})


# ---------------------------------------------------------------- the group, printed once
BLOCK_RE, ROLE_RE = re.compile(r"^=== trajector(?:y|ies) (\d+(?:, \d+)*) ===$"), re.compile(r"^\[(\w+)\]$")


def parse_serialized(text):
    """The layout read back: trajectory k = every block whose label lists k, in order."""
    conversations, ids, message = {}, [], None
    for line in text.split("\n"):
        block, role = BLOCK_RE.match(line), ROLE_RE.match(line)
        if block:
            ids, message = [int(x) for x in block.group(1).split(", ")], None
        elif role:
            message = {"role": role.group(1), "content": None}
            for i in ids:  # the same dict in every sharing trajectory: filled in below
                conversations.setdefault(i, []).append(message)
        else:
            line = line[1:] if line.startswith("\\") else line
            message["content"] = line if message["content"] is None else message["content"] + "\n" + line
    return [[dict(m) for m in conversations[i]] for i in sorted(conversations)]


def printed(conversations):
    """The conversations as the judge's prompt prints them, each its own id (duplicates too)."""
    return serialize(conversation_tree(conversations), list(range(1, len(conversations) + 1)))


def test_tree_prints_shared_branches_once():
    """The point of the tree: a prefix shared by only some trajectories is sent once, labelled."""
    text = printed(group())
    assert text.count(CALL_A["content"]) == 1 and text.count(SYS["content"]) == 1 and text.count(USER["content"]) == 1
    assert "=== trajectories 1, 2, 3 ===" in text and "=== trajectories 1, 2 ===" in text
    assert len(text) < len("\n".join(judge.render_block([i], c) for i, c in enumerate(group(), 1)))


def test_round_trip_on_tricky_content():
    """The layout parses back to exactly the input: the judge reads the same thing we meant,
    even when content looks like our own headers, is empty, unicode, or ends in newlines."""
    tricky = msg("tool", "=== trajectory 9 ===\n[user]\n\\escaped\n[(1, 'a')]\n\n")
    convs = [[SYS, USER, tricky, msg("assistant", "fin\n")],
             [SYS, USER, tricky],                                     # a prefix of the first
             [SYS, USER, msg("tool", ""), msg("assistant", "")],      # empty contents
             [SYS, USER, msg("assistant", "Ça coûte 5 € — 日本語 ✓\r\nok")]]
    assert parse_serialized(printed(convs)) == convs


def test_round_trip_on_random_groups():
    """Seeded fuzz: random groups over a small message alphabet (so branches really share)."""
    rng = random.Random(0)
    alphabet = [msg(r, c) for r in ("assistant", "tool") for c in ("a", "b", "", "=== x ===", "[tool]", "\\")]
    for _ in range(200):
        convs = [[SYS] + [rng.choice(alphabet) for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(1, 6))]
        assert parse_serialized(printed(convs)) == convs, convs


def test_identical_trajectories_share_one_id():
    """Identical trajectories end at one node: one id, one copy; the ids count distinct
    trajectories in order, so with 1 and 3 identical the fourth is the judge's 3."""
    a, b, c = group()
    tree = conversation_tree([a, b, a, c])
    assert judge_ids(tree) == [1, 2, 1, 3]
    text = serialize(tree, judge_ids(tree))
    assert text.count("There are 6.") == 1 and "=== trajectory 1 ===\n[assistant]\nThere are 6." in text
    assert parse_serialized(text) == [a, b, c]


def test_a_rollouts_tree_prints_as_its_conversations(smol_tokenizer, db):
    """A rollout's own tree (a node a turn, agentrl.make_group) prints the same conversations as
    the message tree of its trajectories: the judge reads the tree the update trains on."""
    task = sql_env.load_tasks()[0]
    turns = [[agentrl.tool_call_text("list_tables", {}), agentrl.tool_call_text("submit_answer", {"query": "SELECT 1"})],
             [agentrl.tool_call_text("list_tables", {}), agentrl.tool_call_text("submit_answer", {"query": "SELECT 2"})],
             [agentrl.tool_call_text("submit_answer", {"query": task.gold_sql})]]
    trajectories = [agentrl.scripted_trajectory(smol_tokenizer, task, t) for t in turns]
    tree = agentrl.make_group(task, trajectories).tree
    text = serialize(tree, judge_ids(tree))
    assert parse_serialized(text) == [t.messages for t in trajectories]
    assert text.count("list_tables") == 1 + trajectories[0].messages[0]["content"].count("list_tables")


def test_single_trajectory():
    """A group of one is one block."""
    assert printed([group()[0]]).startswith("=== trajectory 1 ===\n[system]\n")
    assert printed([group()[0]]).count("===") == 2


def test_empty_tool_output_and_unicode_are_verbatim():
    """An empty observation is one empty line; unicode is printed as is, not \\u-escaped."""
    text = printed([[SYS, msg("tool", ""), msg("assistant", "naïve → ✓")]])
    assert "[tool]\n\n[assistant]\nnaïve → ✓" in text


def test_empty_trajectory_is_refused():
    """A trajectory without messages cannot be judged: a clear error, not a gap."""
    with pytest.raises(AssertionError, match="no messages"):
        conversation_tree([[SYS], []])


# ---------------------------------------------------------------- parsing replies
def test_parse_prose_wrapped_and_fenced_json():
    """Judges wrap JSON in prose and code fences; the scores must still be found."""
    body = reply(0.9, 0.1)
    for text in (f"Here are my scores:\n{body}\nHope this helps.", f"```json\n{body}\n```"):
        assert parse_scores(text, 2) == ([0.9, 0.1], ["e1", "e2"])


def test_parse_matches_ids_not_positions():
    """Out-of-order entries are matched by trajectory_id (also given as a string)."""
    text = json.dumps({"scores": [{"trajectory_id": "2", "score": 0.2}, {"trajectory_id": 1, "score": 0.7}]})
    assert parse_scores(text, 2)[0] == [0.7, 0.2]


def test_parse_missing_id_raises_and_extra_id_is_ignored():
    """A missing id is an error to correct; an id outside the group is noise to drop."""
    with pytest.raises(ParseError, match=r"\[2\]"):
        parse_scores(reply(0.5), 2)
    text = json.dumps({"scores": [{"trajectory_id": i, "score": 0.5} for i in (1, 2, 9)]})
    assert parse_scores(text, 2)[0] == [0.5, 0.5]


def test_parse_reads_scores_as_written_and_coerces():
    """7 stays 7 (its scale is judged on the whole reply, not clamped); "0.8" is a number;
    "high", a negative score and NaN (which json reads) are errors to correct."""
    assert parse_scores(reply(7, 0, "0.8"), 3)[0] == [7.0, 0.0, 0.8]
    for bad, message in (("high", "not a number"), (-1, "negative"), (float("nan"), "not finite")):
        with pytest.raises(ParseError, match=message):
            parse_scores(reply(0.5, bad), 2)


def test_unit_scale_keeps_the_order():
    """The smallest scale that holds every score; a fraction of one beside a score above 1 is
    two scales at once and an error; every rescale lands in [0, 1] in the same order."""
    assert doctest.testmod(judge).failed == 0
    cases = {(0.0, 0.3, 1.0): "0-1", (0, 2, 10): "0-10", (10.5, 3, 0): "0-100", (100, 20): "0-100",
             (101, 7, 0): "min-max"}
    for scores, scale in cases.items():
        scaled, read_on = unit_scale(list(scores))
        assert read_on == scale and all(0 <= s <= 1 for s in scaled) and sorted(range(len(scores)), key=scaled.__getitem__) == \
            sorted(range(len(scores)), key=scores.__getitem__)
    assert unit_scale([250, 250]) == ([0.5, 0.5], "min-max")
    with pytest.raises(ParseError, match="mix scales"):
        unit_scale([0.8, 7, 0])


def test_parse_truncated_json_raises():
    """A reply cut off mid-JSON (token budget) is an error, not a partial result."""
    with pytest.raises(ParseError, match="no JSON"):
        parse_scores(reply(0.9, 0.1)[:-20], 2)


# ---------------------------------------------------------------- score_group
def test_identical_trajectories_scored_once_and_copied():
    """The judge sees each distinct trajectory once; duplicates get the same score and reason."""
    a, b = group()[0], group()[2]
    backend = Scripted(reply(0.9, 0.2))
    result = score_group([a, b, a, a], backend)
    assert result.scored and result.scores == [0.9, 0.2, 0.9, 0.9] and result.explanations == ["e1", "e2", "e1", "e1"]
    assert "Trajectory ids: 1, 2\n" in backend.prompts[0][1]["content"]


def test_bad_reply_is_corrected_then_scored():
    """An unusable reply gets one short correction turn; the second reply is used."""
    backend = Scripted("I think trajectory 1 is best.", reply(0.1, 0.9, 0.5))
    result = score_group(group(), backend)
    assert result.scored and result.attempts == 2 and result.scores == [0.1, 0.9, 0.5]
    retry = backend.prompts[1]
    assert retry[:2] == backend.prompts[0] and retry[2] == msg("assistant", "I think trajectory 1 is best.")
    assert "could not be used" in retry[3]["content"] and "1, 2, 3" in retry[3]["content"]


def test_hopeless_judge_gives_unscored_result():
    """After max_retries corrections, or on a backend error, the group is unscored: no raise."""
    result = score_group(group(), Scripted("no", "nope", "never"), max_retries=2)
    assert not result.scored and result.scores is None and result.attempts == 3 and "no JSON" in result.error
    result = score_group(group(), Scripted(JudgeError("endpoint down")))
    assert not result.scored and result.attempts == 1 and "endpoint down" in result.error


def test_cache_serves_repeat_and_is_keyed_by_backend(tmp_path):
    """Re-judging the same group costs no call, corrections and rescale included; another
    backend (cache_id) is a miss; no temporary file is left behind."""
    first = score_group(group(), CachedBackend(Scripted("no JSON", reply(2, 9, 5)), tmp_path), max_retries=1)
    again = score_group(group(), CachedBackend(Scripted(), tmp_path), max_retries=1)   # would raise if called
    assert again == first and again.rescaled == "0-10" and again.scores == [0.2, 0.9, 0.5] and again.attempts == 2
    other = Scripted(reply(0.0, 0.0, 1.0))
    other.cache_id = "other"
    assert score_group(group(), CachedBackend(other, tmp_path)).scores == [0.0, 0.0, 1.0]
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert len(files) == 3 and all(f.endswith(".json") for f in files)


def test_an_unreadable_cache_entry_is_a_miss(tmp_path):
    """A torn or foreign entry is asked again and rewritten, never served."""
    score_group(group(), CachedBackend(Scripted(reply(0.3, 0.6, 0.9)), tmp_path))
    (entry,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    for junk in ('{"scores": [1, 1, 1]}', "{not json", "\xff\xfe"):
        Path(entry).write_text(junk)
        result = score_group(group(), CachedBackend(Scripted(reply(0.1, 0.9, 0.4)), tmp_path))
        assert result.scores == [0.1, 0.9, 0.4]


# ---------------------------------------------------------------- HTTP backend, real server
class ScriptedServer:
    """A real HTTP server on 127.0.0.1 that answers from a script of (status, headers, body, delay)."""

    def __init__(self, script, models_status=200):
        self.script, self.requests = list(script), []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"time": time.monotonic(), "path": self.path, "body": body,
                                       "auth": self.headers.get("Authorization")})
                status, headers, payload, delay = outer.script.pop(0)
                time.sleep(delay)
                data = payload if isinstance(payload, bytes) else payload.encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # client timed out
                    self.wfile.write(data)

            def do_GET(self):
                outer.requests.append({"time": time.monotonic(), "path": self.path, "auth": self.headers.get("Authorization")})
                self.send_response(models_status if self.path.endswith("/models") else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def gaps(self):
        times = [r["time"] for r in self.requests]
        return [b - a for a, b in zip(times, times[1:])]


@pytest.fixture
def serve():
    servers = []

    def start(*script, models_status=200):
        servers.append(ScriptedServer(script, models_status))
        return servers[-1]

    yield start
    for s in servers:
        s.server.shutdown()
        s.server.server_close()


def ok(content, finish_reason="stop", **fields):
    """A 200 chat completion whose message has this content (and extra fields, e.g. reasoning_content)."""
    choice = {"message": {"role": "assistant", "content": content, **fields}, "finish_reason": finish_reason}
    return 200, {"Content-Type": "application/json"}, json.dumps({"choices": [choice]}), 0


def fast_backend(server, **kw):
    return HTTPBackend(base_url=server.url, model="judge-model", api_key="sk-test", timeout_s=2, backoff_s=0.05, **kw)


def test_http_valid_reply(serve):
    """One request to /chat/completions with the model, key, temperature 0, the token budget and
    the verdict's JSON schema in OpenAI's structured-output form."""
    server = serve(ok(reply(0.2, 0.8, 0.5)))
    result = score_group(group(), fast_backend(server))
    assert result.scored and result.scores == [0.2, 0.8, 0.5] and len(server.requests) == 1
    request = server.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["auth"] == "Bearer sk-test"
    assert request["body"]["model"] == "judge-model" and request["body"]["temperature"] == 0
    assert request["body"]["max_tokens"] == 2048
    assert request["body"]["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "verdict", "strict": True, "schema": judge_backends.verdict_schema(3)}}


def test_verdict_schema_asks_for_each_id_once():
    """The schema sent for a prompt on n trajectories asks for exactly n entries with ids 1..n
    (OpenAI's form: an enum; llama.cpp's: entry k's id pinned to k); an answer in the schema's
    shape is one parse_scores reads. A prompt that is not build_prompt's gets the bare shape."""
    n = judge_backends._judged_count(judge.build_prompt(conversation_tree(group()), [1, 2, 3]))
    assert n == 3
    scores = judge_backends.verdict_schema(n)["properties"]["scores"]
    assert scores["minItems"] == scores["maxItems"] == 3
    assert scores["items"]["properties"]["trajectory_id"]["enum"] == [1, 2, 3]
    assert list(scores["items"]["properties"]) == ["trajectory_id", "explanation", "score"]
    pinned = judge_backends.verdict_schema(n, pin_ids=True)["properties"]["scores"]["prefixItems"]
    assert [e["properties"]["trajectory_id"] for e in pinned] == [{"const": 1}, {"const": 2}, {"const": 3}]
    assert judge_backends._judged_count([USER]) is None and "minItems" not in judge_backends.verdict_schema(None)["properties"]["scores"]
    assert judge_backends.format_body("json_object+schema", 3)["schema"]["properties"]["scores"]["prefixItems"] == pinned
    assert parse_scores(reply(0.2, 0.8, 0.5), 3)[0] == [0.2, 0.8, 0.5]


def test_http_malformed_then_valid(serve):
    """A malformed judge reply is corrected through a second request, not an HTTP retry."""
    server = serve(ok('{"scores": [{"trajectory_id": 1, "score"'), ok(reply(1, 0, 0)))
    result = score_group(group(), fast_backend(server))
    assert result.scored and result.attempts == 2 and len(server.requests) == 2
    assert server.requests[1]["body"]["messages"][-1]["role"] == "user"


def test_http_500_then_valid_backs_off(serve):
    """A 5xx is retried after backoff_s."""
    server = serve((500, {}, "overloaded", 0), ok("fine"))
    assert fast_backend(server, response_format="none").complete([USER]) == "fine"
    assert len(server.requests) == 2 and server.gaps()[0] >= 0.05


def test_http_429_honours_retry_after(serve):
    """A 429's Retry-After (1 s) wins over a much shorter backoff."""
    server = serve((429, {"Retry-After": "1"}, "slow down", 0), ok("fine"))
    assert fast_backend(server).complete([USER]) == "fine"
    assert server.gaps()[0] >= 1.0


def test_http_timeout_is_retried(serve):
    """A response slower than timeout_s is abandoned and the request retried."""
    server = serve(ok("too late")[:3] + (1.5,), ok("fine"))
    backend = HTTPBackend(base_url=server.url, model="m", timeout_s=0.3, backoff_s=0.01)
    assert backend.complete([USER]) == "fine" and len(server.requests) == 2


def formats(server):
    """The response_format each request asked for, by its rung in judge_backends.RESPONSE_FORMATS."""
    def rung(shape):
        return "none" if shape is None else shape["type"] + ("+schema" if "schema" in shape else "")
    return [rung(r["body"].get("response_format")) for r in server.requests]


def test_http_format_ladder_steps_down_once_and_remembers(serve):
    """A server that refuses the OpenAI schema form (500, as llama-cpp-python does), then
    llama.cpp's (422), then JSON mode (400) is asked with nothing; every later request starts
    there, and none of the steps spent a retry or waited."""
    server = serve((500, {}, "Internal Server Error", 0), (422, {}, "unknown type", 0),
                   (400, {}, "response_format not supported", 0), ok("fine"), ok("again"))
    backend = fast_backend(server, max_retries=0)
    assert backend.complete([USER]) == "fine" and backend.complete([USER]) == "again"
    assert formats(server) == ["json_schema", "json_object+schema", "json_object", "none", "none"]
    assert backend.response_format == "none"


def test_http_llama_cpp_schema_form_is_kept_once_accepted(serve):
    """A server that takes llama.cpp's schema form keeps it; after a format was accepted, a 500
    is a server error again (retried with backoff, the format kept), and a 400 is not a refusal
    of the format (a JudgeError: e.g. a prompt too long for the context)."""
    server = serve((500, {}, "Internal Server Error", 0), ok("fine"), (500, {}, "overloaded", 0), ok("again"),
                   (400, {}, "context length exceeded", 0))
    backend = fast_backend(server)
    assert backend.complete([USER]) == "fine" and backend.complete([USER]) == "again"
    with pytest.raises(JudgeError, match="400"):
        backend.complete([USER])
    assert formats(server) == ["json_schema"] + ["json_object+schema"] * 4 and server.gaps()[2] >= 0.05


def test_http_persistent_failure_gives_unscored_group(serve):
    """500 on every request: max_retries + 1 requests with exponential gaps, then unscored."""
    server = serve(*[(500, {}, "down", 0)] * 3)
    result = score_group(group(), fast_backend(server, max_retries=2, response_format="none"))
    assert not result.scored and result.scores is None and "giving up after 3 requests" in result.error
    gaps = server.gaps()
    assert len(server.requests) == 3 and gaps[0] >= 0.05 and gaps[1] >= 0.1


def test_http_client_error_is_not_retried(serve):
    """A 401 will not pass by waiting: one request, then a JudgeError."""
    server = serve((401, {}, "bad key", 0))
    with pytest.raises(JudgeError, match="401"):
        fast_backend(server, response_format="none").complete([USER])
    assert len(server.requests) == 1


def test_http_check_reports_reachability(serve):
    """check() is a cheap start-up probe: None for a live endpoint, a reason for a dead one."""
    server = serve()
    assert fast_backend(server).check() is None and server.requests[0]["path"] == "/v1/models"
    port = server.server.server_address[1]
    server.server.shutdown()
    server.server.server_close()
    problem = HTTPBackend(base_url=f"http://127.0.0.1:{port}/v1", model="m", timeout_s=1).check()
    assert problem and "cannot reach" in problem


@pytest.mark.parametrize("status", [404, 405, 501])
def test_http_check_counts_a_server_without_a_model_list_as_reachable(serve, status):
    """Servers and proxies that serve chat completions only answer GET /models with 404, 405 or
    501: they are up, and the trainer must not refuse to start."""
    server = serve(models_status=status)
    assert fast_backend(server).check() is None and server.requests[0]["path"] == "/v1/models"


@pytest.mark.parametrize("status", [401, 403, 500, 503])
def test_http_check_fails_fast_on_a_refused_key_or_a_server_error(serve, status):
    """A key refused (401, 403) or a broken server (5xx other than 501) is reported at start."""
    server = serve(models_status=status)
    assert fast_backend(server).check() == f"HTTP {status} from {server.url}/models"


def four():
    """A group of four different trajectories."""
    return group() + [[SYS, USER, CALL_B, msg("tool", "[(6,)]"), msg("assistant", "6")]]


def corrections(server):
    """The correction turns the judge was sent, in order."""
    return [r["body"]["messages"][-1]["content"] for r in server.requests[1:]]


def test_http_judge_on_0_to_10_keeps_its_ranking(serve):
    """The case that was lost to clamping (1, 4, 7, 10 -> all 1.0): corrected once; the judge
    insists, and its scores are read on 0-10, in order, and counted as rescaled."""
    server = serve(ok(reply(1, 4, 7, 10)), ok(reply(1, 4, 7, 10)))
    result = score_group(four(), fast_backend(server))
    assert result.scored and result.scores == [0.1, 0.4, 0.7, 1.0] and result.rescaled == "0-10"
    assert result.attempts == 2 and len(corrections(server)) == 1
    assert "from 0 to 1" in corrections(server)[0] and "up to 10" in corrections(server)[0]


def test_http_judge_on_0_to_100(serve):
    """A judge on 0-100 (35, 90, 0, 60) insists: divided by 100."""
    server = serve(ok(reply(35, 90, 0, 60)), ok(reply(35, 90, 0, 60)))
    result = score_group(four(), fast_backend(server))
    assert result.scores == [0.35, 0.9, 0.0, 0.6] and result.rescaled == "0-100" and result.attempts == 2


def test_http_judge_above_any_scale_is_min_max_normalized(serve):
    """Scores above 100 fit no scale: the last resort is min-max within the group."""
    server = serve(ok(reply(150, 300, 900, 150)), ok(reply(150, 300, 900, 150)))
    result = score_group(four(), fast_backend(server))
    assert result.scores == [0.0, 0.2, 1.0, 0.0] and result.rescaled == "min-max"


def test_http_corrected_retry_succeeds(serve):
    """A judge told its 0-10 scores must be in [0, 1] answers again in range: used as given,
    not counted as rescaled, one correction spent."""
    server = serve(ok(reply(1, 4, 7, 10)), ok(reply(0.1, 0.45, 0.7, 1)))
    result = score_group(four(), fast_backend(server))
    assert result.scores == [0.1, 0.45, 0.7, 1.0] and result.rescaled == "" and result.attempts == 2


def test_http_judge_that_mixes_scales_is_corrected(serve):
    """0.8 beside 7 fits no single scale: a parse error sent back as a correction; the corrected
    reply is used. A judge that keeps mixing leaves the group unscored, never rescaled."""
    server = serve(ok(reply(0.8, 7, 0.2, 10)), ok(reply(0.8, 0.7, 0.2, 1)))
    result = score_group(four(), fast_backend(server))
    assert result.scores == [0.8, 0.7, 0.2, 1.0] and result.rescaled == "" and result.attempts == 2
    assert "mix scales" in corrections(server)[0]
    server = serve(*[ok(reply(0.8, 7, 0.2, 10))] * 3)
    result = score_group(four(), fast_backend(server))
    assert not result.scored and result.attempts == 3 and "mix scales" in result.error


@pytest.mark.parametrize("bad, message", [(-2, "negative"), (float("nan"), "not finite")])
def test_http_negative_or_nan_score_is_corrected_never_rescaled(serve, bad, message):
    """A negative score or NaN has no scale to be read on: corrected; then, if the judge
    persists through every correction, the group is unscored."""
    server = serve(ok(reply(0.5, bad, 0.1, 0.9)), ok(reply(0.5, 0.3, 0.1, 0.9)))
    result = score_group(four(), fast_backend(server))
    assert result.scores == [0.5, 0.3, 0.1, 0.9] and result.attempts == 2 and message in corrections(server)[0]
    server = serve(*[ok(reply(5, bad, 1, 9))] * 3)
    result = score_group(four(), fast_backend(server))
    assert not result.scored and result.attempts == 3 and message in result.error


def test_out_of_range_with_no_correction_left_is_rescaled_at_once():
    """With max_retries=0 there is no one to correct: a 0-10 reply is rescaled rather than lost;
    a garbled reply after a correction still leaves the judge a last in-range chance."""
    result = score_group(group(), Scripted(reply(3, 8, 5)), max_retries=0)
    assert result.scores == [0.3, 0.8, 0.5] and result.rescaled == "0-10" and result.attempts == 1
    result = score_group(group(), Scripted(reply(3, 8, 5), "oops", reply(30, 80, 50)), max_retries=2)
    assert result.scores == [0.3, 0.8, 0.5] and result.rescaled == "0-100" and result.attempts == 3


# ---------------------------------------------------------------- reasoning judges
def test_split_reasoning_reads_after_the_last_close():
    """The answer starts after the last closing tag (<think>, <thinking>, <reasoning>, any case);
    a close alone counts (the template may have opened the block); a block that opens after the
    last close and never closes leaves no answer."""
    assert split_reasoning("<think>a</think> x <think>b</think> y") == ("a x b", " y")
    assert split_reasoning("<Thinking>a</Thinking>{}") == ("a", "{}")
    assert split_reasoning("<reasoning>a</reasoning>{}") == ("a", "{}")
    assert split_reasoning("draft {} </think>final") == ("draft {}", "final")
    assert split_reasoning("<think>a</think>{} <think>b") == ("a{} b", None)
    assert split_reasoning("plain {}") == ("", "plain {}")


def test_parse_never_reads_scores_inside_reasoning():
    """Draft scores in the reasoning are not the verdict: the answer's scores are, and an answer
    with none is a parse error even when the reasoning holds a complete, valid draft."""
    assert parse_scores(f"<think>Draft: {reply(0.1, 0.9)} Hmm, no.</think>{reply(0.8, 0.2)}", 2)[0] == [0.8, 0.2]
    with pytest.raises(ParseError, match="no JSON"):
        parse_scores(f"<think>{reply(0.1, 0.9)}</think>Done.", 2)
    with pytest.raises(ReasoningNeverClosed):
        parse_scores(f"<think>{reply(0.1, 0.9)}", 2)


def test_http_draft_scores_in_think_lose_to_the_final_ones(serve):
    """Inline reasoning with draft scores that disagree with the answer: the answer's scores are
    used, and the reasoning (without tags) is kept on the result for the judgement log."""
    server = serve(ok(f"<think>First pass: {reply(0.9, 0.1, 0.5)}. No: 2 is right.</think>\n{reply(0.2, 0.8, 0.5)}"))
    result = score_group(group(), fast_backend(server))
    assert result.scored and result.scores == [0.2, 0.8, 0.5] and result.attempts == 1
    assert result.reasoning.startswith("First pass:") and result.reasoning.endswith("No: 2 is right.")


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_http_reasoning_field_beside_json_content(serve, field):
    """A separate reasoning field (vLLM/DeepSeek's reasoning_content, OpenRouter's and Ollama's
    reasoning) holding draft scores is ignored for scoring: the content's scores are used, and
    the field is kept as the result's reasoning."""
    server = serve(ok(reply(0.2, 0.8, 0.5), **{field: f"Maybe {reply(1, 0, 0)}? No."}))
    result = score_group(group(), fast_backend(server))
    assert result.scored and result.scores == [0.2, 0.8, 0.5] and result.reasoning == f"Maybe {reply(1, 0, 0)}? No."


def test_http_unclosed_reasoning_is_corrected_then_unscored_naming_the_budget(serve):
    """Reasoning that never closes has no answer: a correction goes back (repeating no reasoning),
    and a judge cut off every time leaves the group unscored with an error that names the cause
    and the token budget; the reasoning is kept."""
    server = serve(*[ok(f"<think>Trajectory 1 scores {reply(0.9, 0.1, 0.2)} or maybe", "length")] * 3)
    result = score_group(group(), fast_backend(server, max_tokens=300))
    assert not result.scored and result.scores is None and result.attempts == 3
    assert "reasoning never closed" in result.error and "max tokens (now 300)" in result.error
    assert result.reasoning.startswith("Trajectory 1 scores")
    echoed, correction = server.requests[1]["body"]["messages"][-2:]
    assert echoed == msg("assistant", "") and "never closed" in correction["content"]


def test_http_reasoning_only_reply_then_an_answer(serve):
    """Content empty, reasoning_content set (the cap hit mid-thought) is reasoning that never
    closed; the corrected reply with an answer is scored. A reply with neither (a server that
    hides the reasoning it spent the budget on) reads the same."""
    server = serve(ok("", "length", reasoning_content="Comparing 1 and 2..."), ok(None, "length"),
                   ok(reply(0.1, 0.9, 0.5)))
    result = score_group(group(), fast_backend(server))
    assert result.scored and result.scores == [0.1, 0.9, 0.5] and result.attempts == 3
    assert all("never closed" in c for c in corrections(server))
    server = serve(*[ok("", "length", reasoning_content="Comparing 1 and 2...")] * 3)
    result = score_group(group(), fast_backend(server, max_tokens=64))
    assert not result.scored and "max tokens (now 64)" in result.error and result.reasoning == "Comparing 1 and 2..."


def test_http_empty_content_is_a_counted_failure(serve):
    """An empty answer with no reasoning and no cap hit is corrected as empty, then unscored."""
    server = serve(ok(""), ok(reply(0.1, 0.9, 0.5)))
    result = score_group(group(), fast_backend(server))
    assert result.scored and result.attempts == 2 and "empty" in corrections(server)[0]
    server = serve(*[ok("")] * 3)
    result = score_group(group(), fast_backend(server))
    assert not result.scored and result.error == "unparseable reply: the reply was empty"


def test_http_reply_of_any_bytes_scores_or_fails_the_group_never_the_run(serve):
    """A reply body that is not UTF-8 never raises out of score_group: a bad byte inside an
    explanation is read as U+FFFD and the group is scored; bytes that are not JSON at all are a
    malformed reply, retried, then the group is unscored; so is a body over MAX_REPLY_BYTES."""
    valid = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply(0.1, 0.9, 0.5)},
                                     "finish_reason": "stop"}]}).encode().replace(b"e2", b"e\xff2")
    server = serve((200, {}, valid, 0))
    result = score_group(group(), fast_backend(server))
    assert result.scored and result.scores == [0.1, 0.9, 0.5] and result.explanations[1] == "e\ufffd2"
    garbage = bytes(range(128, 256)) * 4
    server = serve(*[(200, {}, garbage, 0)] * 2)
    result = score_group(group(), fast_backend(server, max_retries=1))
    assert not result.scored and "malformed response body" in result.error
    monkey = serve((200, {}, b"x" * 2048, 0))
    backend = fast_backend(monkey, max_retries=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(judge_backends, "MAX_REPLY_BYTES", 1024)
        result = score_group(group(), backend)
    assert not result.scored and "over 1024 bytes" in result.error


def test_a_backend_that_raises_anything_leaves_the_group_unscored():
    """Whatever a backend raises or returns, the group comes back unscored with the cause."""
    class Broken:
        cache_id = "broken"

        def __init__(self, outcome):
            self.outcome = outcome

        def complete(self, messages):
            if isinstance(self.outcome, Exception):
                raise self.outcome
            return self.outcome

    for outcome, cause in [(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "invalid start"),
                           (RuntimeError("boom"), "boom"), (b"\xff{}", "a bytes, not text"), (None, "NoneType")]:
        result = score_group(group(), Broken(outcome))
        assert not result.scored and result.scores is None and cause in result.error, result.error


def test_reasoning_is_clipped_to_its_end():
    """The result keeps the last REASONING_CHARS characters of the reasoning (where the judge concludes)."""
    thought = "x" * judge.REASONING_CHARS + "so 2 wins"
    first = score_group(group(), Scripted(f"<think>{thought}</think>{reply(0.1, 0.9, 0.5)}"))
    assert first.reasoning == "..." + thought[-judge.REASONING_CHARS:] and first.reasoning.endswith("so 2 wins")


# ---------------------------------------------------------------- agreement with correctness
def test_agreement_hand_computed():
    """Per-group AUC over (correct, wrong) pairs, ties half: hand-computed cases, and None for a
    group with nothing to rank."""
    assert agreement([0.9, 0.1], [True, False]) == 1.0
    assert agreement([0.1, 0.9], [True, False]) == 0.0
    assert agreement([0.5, 0.5, 0.5, 0.5], [True, False, True, False]) == 0.5
    # correct 0.7, 0.4 against wrong 0.4, 0.2, 0.9: (1 + 1 + 0) + (0.5 + 1 + 0) = 3.5 of 6 pairs
    assert agreement([0.7, 0.4, 0.4, 0.2, 0.9], [True, True, False, False, False]) == pytest.approx(3.5 / 6)
    assert agreement([0.3, 0.8], [True, True]) is None and agreement([0.3, 0.8], [False, False]) is None


def test_http_settings_from_environment(monkeypatch):
    """Base URL, key and model fall back to OPENAI_BASE_URL, OPENAI_API_KEY, AGENTRL_JUDGE_MODEL."""
    monkeypatch.setenv("OPENAI_BASE_URL", "http://example.invalid/v1/")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("AGENTRL_JUDGE_MODEL", "env-model")
    backend = HTTPBackend()
    assert (backend.base_url, backend.api_key, backend.model) == ("http://example.invalid/v1", "sk-env", "env-model")
    monkeypatch.delenv("AGENTRL_JUDGE_MODEL")
    with pytest.raises(ValueError, match="AGENTRL_JUDGE_MODEL"):
        HTTPBackend()


# ---------------------------------------------------------------- local backend, tiny model
def test_local_backend_reads_the_expected_score_from_the_judges_probabilities(tiny_llama, smol_tokenizer):
    """The local judge always answers: each score is the expectation of the judge's next-token
    probabilities, (p1 + p0 E / 10) / (p0 + p1), as computed here by hand from one plain forward
    over the prompt and the verdict's opening (no cache), within fp32 rounding."""
    tree = conversation_tree(group())
    messages = judge.build_prompt(tree, judge_ids(tree))
    backend = LocalBackend(tiny_llama, smol_tokenizer)
    result = judge.score_group(tree, backend)
    assert result.scored and result.attempts == 1 and len(result.scores) == 3
    ids = lambda text: smol_tokenizer(text, add_special_tokens=False).input_ids     # noqa: E731
    digits = [ids(str(d))[0] for d in range(10)]
    prompt = ids(smol_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    for k, score in enumerate(result.scores, 1):
        opening = ids(f'{{"scores": [{{"trajectory_id": {k}, "score": ') + [digits[0], ids(".")[0]]
        with torch.no_grad():
            logits = tiny_llama(torch.tensor([prompt + opening])).logits[0].double()
        first, last = logits[-3].softmax(-1), logits[-1].softmax(-1)[digits]
        expected = sum(d * p for d, p in enumerate(last.tolist())) / last.sum().item()
        p0, p1 = first[digits[0]].item(), first[digits[1]].item()
        assert score == pytest.approx((p1 + p0 * expected / 10) / (p0 + p1), rel=1e-4, abs=1e-6)
        assert 0 <= score <= 1


def test_local_backend_refuses_prompt_over_context(tiny_llama, smol_tokenizer):
    """A prompt that does not fit the context is refused (unscored), never truncated."""
    backend = LocalBackend(tiny_llama, smol_tokenizer, max_context=256)
    result = score_group(group(), backend)
    assert not result.scored and result.attempts == 1 and "256-token context" in result.error


def test_local_backend_out_of_memory_leaves_the_group_unscored(tiny_llama, smol_tokenizer, monkeypatch):
    """An OOM while the judge reads (a long group on a full GPU) is a JudgeError: the group is
    unscored and training goes on with its correctness rewards, instead of the run dying."""
    def out_of_memory(*args, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(tiny_llama, "forward", out_of_memory)
    result = score_group(group(), LocalBackend(tiny_llama, smol_tokenizer), max_retries=0)
    assert not result.scored and "out of memory" in result.error


def test_local_backend_judges_inside_the_callers_adapter_off_context(tiny_llama, smol_tokenizer):
    """The trainer hands the judge its "LoRA off" context; the forwards run inside it, and the
    model's train/eval mode is restored afterwards."""
    events = []

    @contextlib.contextmanager
    def adapter_off():
        events.append("off")
        yield
        events.append("on")

    tiny_llama.train()
    result = score_group(group(), LocalBackend(tiny_llama, smol_tokenizer, adapter_off=adapter_off))
    assert result.scored and events == ["off", "on"] and tiny_llama.training
    tiny_llama.eval()


def test_local_backend_with_lora_disabled_judges_as_the_base_model(tiny_llama, smol_tokenizer):
    """With the real lora.lora_disabled, a trained adapter does not change the judge's scores."""
    import lora
    base = score_group(group(), LocalBackend(tiny_llama, smol_tokenizer)).scores
    lora.apply_lora(tiny_llama, r=4)
    with torch.no_grad():
        for p in lora.lora_parameters(tiny_llama):
            p.add_(torch.randn_like(p))
    judged = score_group(group(), LocalBackend(tiny_llama, smol_tokenizer,
                                               adapter_off=lambda: lora.lora_disabled(tiny_llama))).scores
    drifted = score_group(group(), LocalBackend(tiny_llama, smol_tokenizer)).scores
    assert judged == pytest.approx(base, abs=1e-6) and drifted != pytest.approx(base, abs=1e-6)


def test_local_backend_answers_only_a_judge_prompt(tiny_llama, smol_tokenizer):
    """A prompt without build_prompt's trajectory ids has no verdict to read: a JudgeError."""
    with pytest.raises(JudgeError, match="trajectory ids"):
        LocalBackend(tiny_llama, smol_tokenizer).complete([USER])


def test_importing_judge_loads_no_model_code():
    """judge.py stands alone: importing it pulls in neither our model code nor transformers."""
    code = "import sys, judge; print(sorted({'agentrl', 'lora', 'grpo', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"