"""Tests for ask.py: asking a trained agent about a database it has never seen, and bad input.

Run: python -m pytest -q tests/test_ask.py
"""
import pytest

import agentrl
import ask
import engine
import lora
from bench.common import scripted_policy


@pytest.fixture
def shop_db(tmp_path):
    """A small database the agent has never seen, and its bytes' hash to check it is left as it was."""
    import hashlib
    import sqlite3
    path = tmp_path / "shop.sqlite"
    con = sqlite3.connect(path)
    con.executescript("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT);"
                      "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INT REFERENCES customers(id), total REAL);"
                      "INSERT INTO customers VALUES (1, 'Ann'), (2, 'Bo');"
                      "INSERT INTO orders VALUES (1, 1, 9.5), (2, 1, 20), (3, 2, 4);")
    con.close()
    digest = lambda: hashlib.sha256(path.read_bytes()).hexdigest()   # noqa: E731
    return str(path), digest, digest()


ASK = ["--max-turns", "3", "--max-new-tokens", "24"]


def test_ask_one_question_ends_with_a_clear_no_answer(tiny_model_dir, shop_db, capsys):
    """A random tiny model writes no tool call: the episode still prints, and ends with one line
    saying there is no answer and why; the database is byte-identical afterwards."""
    db, digest, before = shop_db
    [trajectory] = ask.main(["--db", db, "--model", tiny_model_dir, *ASK, "How many orders are there?"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"database: {db} (2 tables)") and out[1] == "question: How many orders are there?"
    assert trajectory.submitted_sql is None
    assert out[-1] == "no answer: " + ask.NO_ANSWER[trajectory.stop_reason]
    assert digest() == before


def test_ask_prints_tool_calls_and_the_answer_rows(tiny_model_dir, shop_db, capsys, monkeypatch):
    """Scripted turns (bench.common.scripted_policy) stand in for a trained model: each tool call
    and a short view of its observation is printed in order, after the rollout returns, then the
    submitted query and its rows, run again in the sandbox. The database is byte-identical afterwards, though the agent
    ran queries (and tried to write)."""
    db, digest, before = shop_db
    turns = [agentrl.tool_call_text("list_tables", {}),
             agentrl.tool_call_text("run_sql", {"query": "DELETE FROM orders"}),
             agentrl.tool_call_text("submit_answer", {"query": "SELECT COUNT(*) FROM orders"})]
    real = engine.rollout_groups

    def returned(*args, **kw):
        groups = real(*args, **kw)
        print("ROLLOUT RETURNED")
        return groups
    monkeypatch.setattr(engine, "rollout_groups", returned)     # patched first: scripted_policy wraps it
    with scripted_policy([turns]):
        [trajectory] = ask.main(["--db", db, "--model", tiny_model_dir, "--max-new-tokens", "48",
                                 "How many orders are there?"])
    out = capsys.readouterr().out
    assert trajectory.stop_reason == "submitted" and trajectory.submitted_sql == "SELECT COUNT(*) FROM orders"
    calls = ["ROLLOUT RETURNED", "   1. list_tables", "customers: id, name", "   2. run_sql  DELETE FROM orders",
             "Error: not allowed", "   3. submit_answer  SELECT COUNT(*) FROM orders",
             "answer: SELECT COUNT(*) FROM orders\n  COUNT(*)\n  3\n  (1 row)"]
    positions = [out.find(text) for text in calls]
    assert -1 not in positions and positions == sorted(positions), out
    assert digest() == before


def test_ask_reads_questions_until_end_of_input(tiny_model_dir, shop_db, capsys, monkeypatch):
    """Without a question on the command line, questions come from standard input, one a line,
    blank lines skipped, until it ends."""
    import io
    db, digest, before = shop_db
    monkeypatch.setattr("sys.stdin", io.StringIO("How many customers are there?\n\nWhat is the largest order?\n"))
    trajectories = ask.main(["--db", db, "--model", tiny_model_dir, *ASK])
    out = capsys.readouterr().out
    assert len(trajectories) == 2
    assert out.index("question: How many customers are there?") < out.index("question: What is the largest order?")
    assert out.count("no answer: ") == 2 and digest() == before


def test_ask_with_a_run_folder_uses_its_final_adapter(tiny_model_dir, shop_db, tmp_path, capsys):
    """--adapter takes a run folder (train.py --out) and finds its final adapter; the base model is
    the one the adapter records, so --model is not needed."""
    model, _ = lora.load_model(tiny_model_dir)
    lora.apply_lora(model, r=4, alpha=8)
    lora.save_adapter(model, tmp_path / "run" / "final")
    ask.main(["--db", shop_db[0], "--adapter", str(tmp_path / "run"), *ASK, "How many orders are there?"])
    header = capsys.readouterr().out.splitlines()[0]
    assert f"model: {tiny_model_dir}" in header and f"adapter: {tmp_path / 'run' / 'final'}" in header


@pytest.mark.parametrize("case, message", [
    ("missing", "no database file at"),
    ("not_sqlite", "is not a SQLite database"),
    ("no_tables", "holds no tables"),
    ("no_adapter", "no adapter there"),
])
def test_ask_bad_input_is_one_clear_line_before_any_model_loads(case, message, tmp_path, shop_db, monkeypatch):
    """A missing file, a non-SQLite file, an empty database or a folder with no adapter: one line
    naming the problem, no traceback, no model loaded, and the file left as it was."""
    import sqlite3
    monkeypatch.setattr(lora, "load_model", lambda *a, **kw: pytest.fail("a model was loaded"))
    paths = {"missing": tmp_path / "nope.sqlite", "not_sqlite": tmp_path / "notes.sqlite",
             "no_tables": tmp_path / "empty.sqlite", "no_adapter": shop_db[0]}
    (tmp_path / "notes.sqlite").write_text("not a database")
    sqlite3.connect(tmp_path / "empty.sqlite").execute("PRAGMA user_version = 1").connection.close()
    before = {p: p.read_bytes() for p in tmp_path.glob("*.sqlite")}
    extra = ["--adapter", str(tmp_path)] if case == "no_adapter" else []
    with pytest.raises(SystemExit) as e:
        ask.main(["--db", str(paths[case]), *extra, "How many orders are there?"])
    assert str(e.value).startswith("error: ") and message in str(e.value) and "\n" not in str(e.value)
    assert {p: p.read_bytes() for p in tmp_path.glob("*.sqlite")} == before
