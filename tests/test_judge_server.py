"""An integration test of the HTTP judge against a real server: llama.cpp's OpenAI-compatible
server (`pip install 'llama-cpp-python[server]'`, see the README) serving the embedded GGUF.

The loopback tests in test_judge.py check our reading of what we think servers send; this one
checks it against what a server no one here wrote does send, on the trainer's path
(judge_backends.HTTPBackend + judge.score_group, as train.make_judge builds it for `--judge http`).
Skipped where llama_cpp is not installed (CI does not build it).
"""
import time

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python[server] is not installed (README: the local judge server)")

import judge  # noqa: E402
import judge_backends  # noqa: E402
from bench.judge import LLAMA_ALIAS, agreement_groups, llama_cpp_server  # noqa: E402


def test_llama_cpp_server_scores_a_real_group_with_the_schema(smol_tokenizer, cache):
    """One real group (two right and two wrong answers to a train question, bench judge's first
    group) judged by the embedded SmolLM2-135M behind llama.cpp's server: the server refuses
    OpenAI's json_schema form, the backend steps down to llama.cpp's schema form and keeps it, and
    the group comes back scored, one score in [0, 1] per trajectory (this judge's first reply mixes
    scales, 0.5 beside 2; corrected, it answers on 0-10, which is rescaled). Its agreement with
    correctness is printed as measured (a 135M judge: expect little); the server is stopped."""
    ((conversations, correct),) = agreement_groups(smol_tokenizer, seed=0, num_groups=1)
    t0 = time.perf_counter()
    with llama_cpp_server() as url:
        backend = judge_backends.HTTPBackend(base_url=url, model=LLAMA_ALIAS, timeout_s=300)
        assert backend.check() is None
        result = judge.score_group(judge.conversation_tree(conversations), backend)   # as the trainer calls it: up to 2 corrections
    seconds = time.perf_counter() - t0
    assert backend.response_format == "json_object+schema", backend.response_format
    assert result.scored, result.error
    assert len(result.scores) == len(conversations) and all(0 <= s <= 1 for s in result.scores)
    print(f"\nllama.cpp judge: scores {result.scores} for correct {correct} (rescaled {result.rescaled or 'no'}, "
          f"{result.attempts} replies), agreement {judge.agreement(result.scores, correct):.2f}, {seconds:.0f} s")
