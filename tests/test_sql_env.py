"""Tests for sql_env.py: the tools, scoring, the sandbox, loaders.

Everything writes under pytest's tmp folders (AGENTRL_CACHE is pointed there), nothing is downloaded.
"""
import hashlib
import json
import multiprocessing
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

import sql_env
from sql_env import SQLEnv, SQLError, Task, execution_match, load_tasks, run_query


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def env_for(db, gold="SELECT COUNT(*) FROM customers", **kwargs):
    return SQLEnv(Task("t", db, "How many customers are there?", gold), **kwargs)


# ----------------------------------------------------------------------------- the tools
def test_tools_are_openai_schemas():
    """The chat template's tools= argument expects OpenAI-style function schemas."""
    names = [t["function"]["name"] for t in SQLEnv.tools]
    assert names == ["list_tables", "describe_table", "run_sql", "submit_answer"]
    for tool in SQLEnv.tools:
        assert tool["type"] == "function" and tool["function"]["parameters"]["type"] == "object"
        assert set(tool["function"]["parameters"]["required"]) <= set(tool["function"]["parameters"]["properties"])


def test_list_tables(db):
    """list_tables names every table with its columns, in a few short lines."""
    env = env_for(db)
    text = env.call("list_tables", {})
    assert "customers: customer_id, first_name" in text and len(text.splitlines()) == 7
    assert env.num_tool_calls == 1 and env.num_tool_errors == 0


def test_describe_table(db):
    """describe_table shows row count, types, primary and foreign keys and 3 sample rows; any case works."""
    text = env_for(db).call("describe_table", {"table": "Orders"})
    assert text.startswith("table orders (")
    assert "order_id INTEGER primary key" in text and "customer_id INTEGER -> customers.customer_id" in text
    assert "(3 rows)" in text and len(text) < 800


def test_run_sql_formats_a_small_table(db):
    """run_sql returns a header, rows, and a row count; NULLs are visible."""
    text = env_for(db).call("run_sql", {"query": "SELECT 1 AS a, NULL AS b, 2.5 AS c"})
    assert text == "a | b | c\n1 | NULL | 2.5\n(1 row)"


def test_run_sql_truncates_rows_and_characters(db):
    """Large results are cut to max_rows and max_chars, and the observation says so."""
    text = env_for(db, max_rows=5).call("run_sql", {"query": "SELECT * FROM customers"})
    assert len(text.splitlines()) == 7 and "showing the first 5" in text
    text = env_for(db, max_chars=200).call("run_sql", {"query": "SELECT email FROM customers LIMIT 100"})
    assert len(text) < 260 and text.endswith("(truncated to 200 characters)")


def test_submit_answer_ends_the_episode(db):
    """submit_answer scores by execution match and ends the episode; later calls are errors."""
    env = env_for(db)
    assert env.call("submit_answer", {"query": "SELECT count(customer_id) FROM customers"}) == "Answer submitted."
    assert env.done and env.correct and env.submitted_sql == "SELECT count(customer_id) FROM customers"
    assert env.call("run_sql", {"query": "SELECT 1"}).startswith("Error: the answer was already submitted")
    wrong = env_for(db)
    wrong.call("submit_answer", {"query": "SELECT COUNT(*) FROM orders"})
    assert wrong.done and not wrong.correct and wrong.gold_error is None


@pytest.mark.parametrize("name, arguments, expected", [
    ("drop_table", {}, "unknown tool 'drop_table'"),
    (None, {}, "unknown tool None"),
    ("run_sql", {}, 'run_sql takes "query"'),
    ("run_sql", {"sql": "SELECT 1"}, 'run_sql takes "query"'),
    ("run_sql", {"query": 42}, 'run_sql takes "query"'),
    ("run_sql", {"query": "SELECT 1", 2: "x"}, 'run_sql takes "query"'),
    ("run_sql", "SELECT 1", 'run_sql takes "query"'),
    ("list_tables", {"table": "x"}, "list_tables takes no arguments"),
    ("describe_table", {"table": "custmers"}, "no table named 'custmers'; the tables are"),
    ("run_sql", {"query": "SELECT nme FROM customers"}, "no such column: nme"),
    ("run_sql", {"query": "SELEC 1"}, "syntax error"),
    ("run_sql", {"query": "DELETE FROM customers"}, "not allowed"),
    ("run_sql", {"query": ""}, "the query is empty"),
])
def test_tool_errors_are_observations(db, name, arguments, expected):
    """Agent mistakes come back as a short 'Error: ...' text the agent can act on, never as exceptions."""
    env = env_for(db)
    text = env.call(name, arguments)
    assert text.startswith("Error: ") and expected in text and len(text) < 300
    assert env.num_tool_calls == 1 and env.num_tool_errors == 1 and not env.done


def test_broken_gold_is_recorded_not_raised(db):
    """A task whose own gold SQL fails is a data bug: call() still returns, and the env records it."""
    env = env_for(db, gold="SELECT * FROM no_such_table")
    assert env.call("submit_answer", {"query": "SELECT 1"}) == "Answer submitted."
    assert not env.correct and "no such table" in env.gold_error


def test_a_question_without_gold_sql_is_submitted_not_scored(db):
    """A user's question (ask.py --db) has no gold SQL: the submission ends the episode and is
    recorded, and nothing is scored or reported as a broken gold."""
    env = env_for(db, gold=None)
    assert env.call("submit_answer", {"query": "SELECT COUNT(*) FROM customers"}) == "Answer submitted."
    assert env.done and env.submitted_sql == "SELECT COUNT(*) FROM customers"
    assert not env.correct and env.gold_error is None and env.submit_error is None


def test_behaviour_is_counted(db):
    """The environment records what the agent did, not only whether it was right: describe_table
    calls (a wrong name included) and whether the submitted query itself failed to run. A query
    that runs but answers wrong, or returns too many rows, is a wrong answer, not a failed one."""
    env = env_for(db)
    env.call("describe_table", {"table": "customers"})
    env.call("describe_table", {"table": "custmers"})
    env.call("run_sql", {"query": "SELECT COUNT(*) FROM customer"})
    env.call("submit_answer", {"query": "SELECT COUNT(*) FROM customer"})
    assert env.num_describe_calls == 2 and env.done and not env.correct
    assert "no such table: customer" in env.submit_error
    for query, correct in [("SELECT COUNT(*) FROM orders", False), ("SELECT * FROM customers", False),
                           ("SELECT COUNT(*) FROM customers", True)]:
        ran = env_for(db)
        ran.call("submit_answer", {"query": query})
        assert ran.submit_error is None and ran.num_describe_calls == 0 and ran.correct is correct


def test_tables_read_finds_what_a_query_reads_without_running_it(db):
    """tables_read names every table a query reads (COUNT(*), joins, subqueries; not CTE names or
    aliases), in the order the query names them, and compiles the query without running it: an
    endless query answers at once. A query that does not compile is an SQLError."""
    assert sql_env.tables_read(db, "SELECT COUNT(*) FROM customers") == ["customers"]
    assert sql_env.tables_read(db, "SELECT COUNT(*) FROM orders AS o JOIN stores AS s ON o.store_id = s.store_id "
                                   "WHERE s.city = 'Paris'") == ["orders", "stores"]
    assert sql_env.tables_read(db, "SELECT first_name FROM customers WHERE customer_id NOT IN "
                                   "(SELECT customer_id FROM orders)") == ["customers", "orders"]
    assert sql_env.tables_read(db, "WITH x AS (SELECT * FROM Products) SELECT COUNT(*) FROM x") == ["products"]
    assert sql_env.tables_read(db, "SELECT 1") == []
    start = time.monotonic()
    endless = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT COUNT(*) FROM r, orders"
    assert sql_env.tables_read(db, endless) == ["orders"] and time.monotonic() - start < 1.0
    for bad in ["SELECT * FROM customer", "SELEC 1", "DELETE FROM orders"]:
        with pytest.raises(SQLError):
            sql_env.tables_read(db, bad)


# ----------------------------------------------------------------------------- execution match
@pytest.mark.parametrize("pred, gold, expected", [
    ("SELECT name FROM categories", "SELECT name FROM categories ORDER BY category_id", True),  # same order
    ("SELECT name FROM categories ORDER BY name DESC", "SELECT name FROM categories", True),  # order free
    ("SELECT name FROM categories ORDER BY name DESC", "SELECT name FROM categories ORDER BY name", False),
    ("SELECT 1 UNION ALL SELECT 1 UNION ALL SELECT 2", "SELECT 2 UNION ALL SELECT 1 UNION ALL SELECT 1", True),
    ("SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 2", "SELECT 2 UNION ALL SELECT 1 UNION ALL SELECT 1", False),
    ("SELECT 1 UNION SELECT 2", "SELECT 1 UNION ALL SELECT 1 UNION ALL SELECT 2", False),  # duplicates count
    ("SELECT 0.1 + 0.2", "SELECT 0.3", True),  # float tolerance
    ("SELECT 3", "SELECT 3.0", True),
    ("SELECT 0.3001", "SELECT 0.3", False),
    ("SELECT '3'", "SELECT 3", False),  # text is not a number
    ("SELECT NULL", "SELECT NULL", True),
    ("SELECT NULL", "SELECT 0", False),
    ("SELECT 1, 2", "SELECT 1", False),  # column counts
    ("SELECT 2 AS b, 1 AS a", "SELECT 1 AS a, 2 AS b", True),  # column order and names are free
    ("SELECT * FROM categories WHERE 0", "SELECT name FROM categories WHERE 0", True),  # both empty
    ("SELECT name FROM categories WHERE 0", "SELECT name FROM categories", False),
    ("SELECT nme FROM categories", "SELECT name FROM categories", False),  # errors are wrong
    ("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT COUNT(*) FROM r",
     "SELECT 1", False),  # timeouts are wrong
])
def test_execution_match(db, pred, gold, expected):
    """Spider test-suite semantics: multiset unless gold orders, floats to tolerance, NULL == NULL."""
    assert execution_match(db, pred, gold, timeout_s=0.5) is expected


def test_gold_results_are_cached(db):
    """The gold query runs once per database file, however many rollouts are scored against it."""
    sql_env._gold_rows.cache_clear()
    for _ in range(3):
        execution_match(db, "SELECT 1", "SELECT COUNT(*) FROM orders")
    assert sql_env._gold_rows.cache_info().hits == 2


def test_broken_gold_raises(db):
    """A failing gold query is a data bug, reported loudly with its path, not scored as 'wrong'."""
    with pytest.raises(SQLError, match="the gold query failed"):
        execution_match(db, "SELECT 1", "SELECT * FROM nowhere")


# ----------------------------------------------------------------------------- the sandbox
HOSTILE = [
    "INSERT INTO categories VALUES (99, 'Weapons')",
    "UPDATE products SET price = 0",
    "DELETE FROM orders",
    "REPLACE INTO categories VALUES (1, 'x')",
    "WITH x AS (SELECT 1) INSERT INTO categories SELECT 100, 'y' FROM x",
    "DROP TABLE customers",
    "CREATE TABLE evil (a)",
    "CREATE TEMP TABLE evil (a)",
    "CREATE TRIGGER t AFTER INSERT ON orders BEGIN DELETE FROM orders; END",
    "ALTER TABLE customers ADD COLUMN evil TEXT",
    "ATTACH DATABASE '{tmp}/evil.sqlite' AS evil",
    "VACUUM INTO '{tmp}/copy.sqlite'",
    "VACUUM",
    "REINDEX",
    "ANALYZE",
    "BEGIN IMMEDIATE",
    "SAVEPOINT s",
    "PRAGMA writable_schema = ON",
    "PRAGMA query_only = OFF",
    "PRAGMA journal_mode = WAL",
    "SELECT load_extension('{tmp}/evil.so')",
    "SELECT 1; DROP TABLE customers",
    "SELECT 1\x00; DROP TABLE customers",
    "SELECT '\ud800'",
    "SELECT * FROM customers; DELETE FROM customers",
    "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT COUNT(*) FROM r",
    "SELECT COUNT(*) FROM order_items AS a, order_items AS b, order_items AS c",
    "SELECT a.*, b.* FROM order_items AS a, order_items AS b",
    "SELECT zeroblob(1000000000)",
    "SELECT hex(randomblob(400000))",
    "SELECT group_concat(a.email || b.email) FROM customers AS a, customers AS b",
    "SELECT substr(quote(zeroblob(60000)), 1) FROM customers",
    "SELECT " + "(" * 5000 + "1" + ")" * 5000,
    "SELECT '" + "x" * 200_000 + "'",
]


@pytest.mark.parametrize("sql", HOSTILE)
def test_hostile_statement_is_refused_or_stopped(db, tmp_path, sql):
    """Agent SQL is hostile: each statement is refused or stopped in time, and the file is untouched."""
    before = sha256(db)
    start = time.monotonic()
    with pytest.raises(SQLError):
        run_query(db, sql.format(tmp=tmp_path), timeout_s=1.0)
    assert time.monotonic() - start < 3.0
    assert sha256(db) == before and os.listdir(tmp_path) == []


# One built-in call that runs for seconds inside a single instruction: does a run of 99,999 'a'
# match '%' + 49,990 'a' + 'b'? LIKE tries each of ~50,000 starts and compares up to 49,990
# characters at each (no value passes MAX_VALUE_BYTES, the pattern stays under SQLite's 50,000
# limit). In-process it took 5.2 s on an idle 2-core machine, and the progress handler never ran.
STUCK_IN_ONE_CALL = "SELECT printf('%.*c', 99999, 'a') LIKE printf('%%%.*cb', 49990, 'a')"


def test_one_long_builtin_call_is_beyond_the_progress_handler():
    """Why the worker must be killable: the statement runs fewer than the 1000 instructions
    between two progress-handler calls, so an in-process limit is never asked; its time is all
    inside one call. Counted on the same program with a shorter pattern (only a literal differs),
    not timed: it holds on any CPU."""
    con = sqlite3.connect(":memory:")
    assert len(con.execute("EXPLAIN " + STUCK_IN_ONE_CALL).fetchall()) < 100
    calls = []
    con.set_progress_handler(lambda: calls.append(1), 1000)
    assert con.execute(STUCK_IN_ONE_CALL.replace("49990", "500")).fetchall() == [(0,)] and calls == []


def test_a_query_stuck_in_one_call_is_stopped_at_the_deadline(db):
    """The time limit holds for any statement: run_query raises, and the run_sql tool answers with
    an error observation, within the limit plus a margin that does not depend on the CPU's speed
    (the statement alone runs for seconds); the next query answers right."""
    start = time.monotonic()
    with pytest.raises(SQLError, match="ran longer than 0.2 s and was stopped"):
        run_query(db, STUCK_IN_ONE_CALL, timeout_s=0.2)
    assert time.monotonic() - start < 0.2 + 2.0
    assert run_query(db, "SELECT COUNT(*) FROM categories")[1][0][0] > 0
    start = time.monotonic()
    text = env_for(db, timeout_s=0.2).call("run_sql", {"query": STUCK_IN_ONE_CALL})
    assert text == "Error: the query ran longer than 0.2 s and was stopped" and time.monotonic() - start < 0.2 + 2.0


def test_a_worker_killed_mid_query_fails_that_query_clearly_and_is_replaced(db):
    """A worker that dies (killed from outside, crashed) gives its query a clear SQLError at
    once, never a hang or a raw exception; it is reaped (no zombie), and the next query starts a
    new worker and answers right."""
    run_query(db, "SELECT 1")
    old = sql_env._worker[1]
    killer = threading.Timer(0.3, os.kill, (old.pid, signal.SIGKILL))   # inside the long LIKE
    killer.start()
    start = time.monotonic()
    with pytest.raises(SQLError, match="the process running it died"):
        run_query(db, STUCK_IN_ONE_CALL, timeout_s=30)
    assert time.monotonic() - start < 3.0
    killer.join()
    with pytest.raises(ChildProcessError):
        os.waitpid(old.pid, os.WNOHANG)          # already reaped
    assert run_query(db, "SELECT COUNT(*) FROM categories")[1][0][0] > 0
    assert sql_env._worker[1].pid != old.pid


def test_a_forked_process_gets_its_own_worker_and_reaps_it(db):
    """A process forked as the evaluator forks (parallel.forked: multiprocessing, "fork") starts a
    worker of its own rather than writing to its parent's pipe, where the two would read each
    other's answers; when it exits, past atexit, its worker is stopped and reaped, not left a zombie."""
    assert run_query(db, "SELECT 1")[1] == [(1,)]
    parent_worker = sql_env._worker[1].pid
    receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)

    def child():
        send.send((run_query(db, "SELECT 2")[1], sql_env._worker[1].pid))

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    answer, child_worker = receive.recv() if receive.poll(30) else (None, None)
    process.join()
    assert answer == [(2,)] and child_worker not in (None, parent_worker)
    with pytest.raises(ProcessLookupError):
        os.kill(child_worker, 0)                 # gone: a zombie would still take signal 0
    assert run_query(db, "SELECT 3")[1] == [(3,)] and sql_env._worker[1].pid == parent_worker


def test_read_only_introspection_is_allowed(db):
    """Reads that help the agent still work: schema pragmas, sqlite_master, bounded recursive CTEs."""
    assert run_query(db, "PRAGMA table_info(customers)")[1][0][1] == "customer_id"
    assert run_query(db, "SELECT COUNT(*) FROM sqlite_master")[1][0][0] >= 6
    assert run_query(db, "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r LIMIT 5) "
                         "SELECT SUM(n) FROM r  -- a comment\n;")[1] == [(15,)]


def test_missing_database_is_a_clear_error(tmp_path):
    with pytest.raises(SQLError, match="no database file at"):
        run_query(str(tmp_path / "nope.sqlite"), "SELECT 1")


def test_database_tables_names_what_is_wrong_with_a_file(db, tmp_path):
    """Asking about a database checks it first: its tables, or one clear line for a missing file,
    a file that is not SQLite, and a database with no table; none of them is changed."""
    assert {"customers", "orders"} <= set(sql_env.database_tables(db))
    (tmp_path / "notes.sqlite").write_text("hello, not a database")
    sqlite3.connect(tmp_path / "empty.sqlite").execute("PRAGMA user_version = 1").connection.close()
    before = {p.name: sha256(p) for p in tmp_path.iterdir()}
    for name, message in [("nope.sqlite", "no database file at"), ("notes.sqlite", "is not a SQLite database"),
                          ("empty.sqlite", "holds no tables")]:
        with pytest.raises(SQLError, match=message) as e:
            sql_env.database_tables(str(tmp_path / name))
        assert "\n" not in str(e.value)
    assert {p.name: sha256(p) for p in tmp_path.iterdir()} == before


# ----------------------------------------------------------------------------- loaders
def make_db(path):
    path.parent.mkdir(parents=True)
    con = sqlite3.connect(path)
    con.executescript("CREATE TABLE singer (id INTEGER PRIMARY KEY, name TEXT, age INT);"
                      "INSERT INTO singer VALUES (1, 'Ann', 30), (2, 'Bo', 41);")
    con.commit()
    con.close()


@pytest.fixture
def spider(tmp_path):
    make_db(tmp_path / "database" / "concert" / "concert.sqlite")
    (tmp_path / "tables.json").write_text("[]")
    entries = [{"db_id": "concert", "question": "How many singers?", "query": "SELECT count(*) FROM singer"},
               {"db_id": "concert", "question": "Oldest?", "query": "SELECT name FROM singer ORDER BY age DESC LIMIT 1"}]
    (tmp_path / "train_spider.json").write_text(json.dumps(entries))
    (tmp_path / "dev.json").write_text(json.dumps(entries[:1]))
    return tmp_path


@pytest.fixture
def bird(tmp_path):
    make_db(tmp_path / "dev_databases" / "music" / "music.sqlite")
    entries = [{"db_id": "music", "question": "Names of singers over 35?", "evidence": "over 35 means age > 35",
                "SQL": "SELECT name FROM singer WHERE age > 35", "difficulty": "moderate"}]
    (tmp_path / "dev.json").write_text(json.dumps(entries))
    return tmp_path


def test_load_spider(spider):
    """A Spider folder loads as tasks with runnable gold SQL and estimated tiers."""
    tasks = load_tasks(str(spider), "train")
    assert [t.difficulty for t in tasks] == ["medium", "hard"] and len(load_tasks(str(spider), "dev")) == 1
    assert execution_match(tasks[0].db_path, "SELECT COUNT(id) FROM singer", tasks[0].gold_sql)


def test_load_bird(bird):
    """A BIRD folder loads with its evidence and its own difficulty labels."""
    (task,) = load_tasks(str(bird), "dev")
    assert task.evidence == "over 35 means age > 35" and task.difficulty == "medium"
    assert execution_match(task.db_path, "SELECT name FROM singer WHERE age >= 36", task.gold_sql)


def test_the_validation_slice_is_train_tasks_spread_over_the_split(spider):
    """Split val: VAL_SIZE of the train split's tasks, the same ones on every call, spread over
    tiers and schema renderings (not the first 64); a train split too small for it is a clear error."""
    train, val = load_tasks(split="train"), load_tasks(split="val")
    by_id = {t.id: t for t in train}
    assert len(val) == sql_env.VAL_SIZE and all(by_id[t.id] == t for t in val)
    assert [t.id for t in val] == [t.id for t in load_tasks(split="val")] == sorted(t.id for t in val)
    assert {t.difficulty for t in val} == set(sql_env.TIERS) and {t.db_path for t in val} == {t.db_path for t in train}
    assert val[-1].id != train[sql_env.VAL_SIZE - 1].id
    with pytest.raises(ValueError, match="2 train tasks, too few"):
        load_tasks(str(spider), "val")


def test_loader_errors_name_the_path(spider, tmp_path):
    """Bad folders give one clear error that names the file, not a traceback from deep inside."""
    with pytest.raises(FileNotFoundError, match="no data folder"):
        load_tasks(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="neither a Spider folder"):
        load_tasks(str(spider / "database" / "concert"))
    with pytest.raises(ValueError, match="splits train, dev, test, not 'validation'"):
        load_tasks(str(spider), "validation")
    with pytest.raises(FileNotFoundError, match=re.escape(str(spider / "test.json"))):
        load_tasks(str(spider), "test")
    (spider / "dev.json").write_text("[{")
    with pytest.raises(ValueError, match="malformed JSON in " + re.escape(str(spider / "dev.json"))):
        load_tasks(str(spider), "dev")
    (spider / "dev.json").write_text(json.dumps([{"db_id": "concert", "question": "q"}]))
    with pytest.raises(ValueError, match="entry 0"):
        load_tasks(str(spider), "dev")
    (spider / "dev.json").write_text(json.dumps([{"db_id": "gone", "question": "q", "query": "SELECT 1"}]))
    with pytest.raises(FileNotFoundError, match=re.escape(str(spider / "database" / "gone" / "gone.sqlite"))):
        load_tasks(str(spider), "dev")
    with pytest.raises(ValueError, match="splits train, test"):
        load_tasks(None, "dev")


def test_tour_runs(tmp_path):
    """`python sql_env.py` prints the schema, questions per tier and the split sizes."""
    result = subprocess.run([sys.executable, "sql_env.py"], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.abspath(sql_env.__file__)),
                            env={**os.environ, "AGENTRL_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert all(f"[{tier}]" in result.stdout for tier in sql_env.TIERS)
    assert "train: " in result.stdout and "test: " in result.stdout
