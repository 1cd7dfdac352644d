"""The environment: a SQLite database, a question, and four tools.

An episode is one `Task` (a question plus the gold SQL that answers it) and one `SQLEnv`. The
agent explores with `list_tables`, `describe_table` and `run_sql`, then ends the episode with
`submit_answer(query)`; the answer is right when its result matches the gold query's result
(`execution_match`, the rule of the Spider test-suite evaluator). Tool observations are short
plain text, fed back to a small model with a short context.

    python sql_env.py          # a tour: the schema, sample questions per tier, the held-out schema,
                               # split sizes

Top to bottom:
1. The sandbox. Agent SQL is hostile input. `run_query` opens the file read-only (URI `mode=ro`,
   `PRAGMA query_only`), lets an authorizer allow only reads (no writes, DDL, ATTACH,
   transactions, state-changing PRAGMA, load_extension), relies on SQLite's compiler to refuse a
   second statement, caps value length, row count and result size, and stops runaway queries at a
   deadline: the statement runs in a small worker process, whose progress handler stops most of
   them and which is killed when one built-in call runs on past the deadline (SQLite consults the
   handler only between instructions, and one LIKE over a long string runs for seconds inside
   one). No regex looks at agent SQL. `tables_read` asks the same authorizer which tables
   a query reads, without running it.
2. Scoring. Results compare as multisets (as lists when the gold SQL has ORDER BY), columns in
   any order, numbers to 10 significant digits, NULL equal to NULL; a query that fails or times
   out is wrong. Gold results are cached.
3. `SQLEnv`, the episode: the four tools, each answering in short text, never raising on an
   agent's mistake, and counting what the agent did (describe_table calls, a submitted query
   that fails to run: `submit_error`).
4. Loaders: the embedded retail question set (`retail.py`: splits train, test, test_schema on a
   schema never trained on, train_mixed and train_wide on many schemas), or a Spider or BIRD
   folder. Every source also has split "val": VAL_SIZE of its train tasks, for choosing
   hyperparameters without looking at the held-out splits.

Simplifications, and why they are safe: the question set is templated, so its language is narrow
(a teaching set, not a benchmark: use Spider or BIRD for claims); whether order matters is decided
by "ORDER BY" appearing anywhere in the gold SQL, as Spider's evaluator does; the tiers of
Spider/BIRD questions without a label are estimated from the gold SQL; a process has one query
worker, used by one thread at a time (the rollout calls tools one after another; a process forked
from it starts a worker of its own).
"""
import functools
import itertools
import json
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import retail

TIERS = ("easy", "medium", "hard", "extra")  # Spider's hardness levels, easiest first
MAX_VALUE_BYTES = 100_000       # longest string or blob SQLite may build (SQLITE_LIMIT_LENGTH)
MAX_RESULT_BYTES = 1_000_000    # largest result run_query returns
VAL_SIZE = 64                   # train tasks in the validation slice (split "val")
SCORE_MAX_ROWS = 100_000        # row cap when scoring: large enough for any real gold result
SCORE_MAX_BYTES = 10_000_000
GOLD_TIMEOUT_S = 30.0           # gold SQL is trusted but may be slow (BIRD)


class SQLError(Exception):
    """A query was refused, failed, or ran past a limit. The message is meant for the agent."""


class ResultTooLarge(SQLError):
    """A query ran but its result passed the row or size cap: not a failing query, a too-large answer."""


class ToolError(Exception):
    """A tool was called wrongly (unknown name, bad arguments). The message is meant for the agent."""


@dataclass
class Task:
    id: str
    db_path: str
    question: str
    gold_sql: str | None            # None: a user's question (ask.py --db), submitted but not scored
    evidence: str = ""              # a hint that comes with the question (BIRD), "" if none
    difficulty: str = "easy"        # one of TIERS
    split: str = "train"


# ----------------------------------------------------------------------------- 1. the sandbox
_READ_ONLY_PRAGMAS = {"table_info", "table_xinfo", "index_list", "index_info", "foreign_key_list"}
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE}


def _connect(db_path):
    """A read-only connection: the file is opened with mode=ro, and query_only is set on top."""
    if not os.path.isfile(db_path):
        raise SQLError(f"no database file at {db_path}")
    con = None
    try:
        con = sqlite3.connect(Path(db_path).resolve().as_uri() + "?mode=ro", uri=True)
        con.execute("PRAGMA query_only = ON")
    except sqlite3.Error as e:     # not readable, not a database
        if con is not None:
            con.close()
        raise SQLError(f"cannot open the database {db_path}: {e}") from None
    return con


def run_query(db_path, sql, timeout_s=2.0, max_rows=1000, max_bytes=MAX_RESULT_BYTES):
    """Run one read-only statement in the sandbox; return (column names, rows) or raise SQLError.

    A result over `max_rows` rows or `max_bytes` bytes is an error, never silently truncated:
    a cut result scored against the gold would look wrong (or right) for the wrong reason.
    The statement runs in this process's worker (`_execute` there); a worker that has not answered
    `_WORKER_MARGIN_S` past the deadline is killed, and the next query starts a new one."""
    if not isinstance(sql, str) or not sql.strip():
        raise SQLError("the query is empty")
    worker, reply, late = _worker_process(), None, False
    try:   # the worker keeps the cwd it started in: send an absolute path
        pickle.dump((os.path.abspath(db_path), sql, timeout_s, max_rows, max_bytes), worker.stdin)
        worker.stdin.flush()
        late = not multiprocessing.connection.wait([worker.stdout], timeout_s + _WORKER_MARGIN_S)
        reply = None if late else pickle.load(worker.stdout)
    except (OSError, EOFError, pickle.UnpicklingError):
        pass                                # it died: killed from outside, or crashed
    finally:
        if reply is None:                   # late, dead, or this process interrupted: a worker that
            _stop_worker()                  # may still answer must never answer the next query
    if late:
        raise SQLError(f"the query ran longer than {timeout_s:g} s and was stopped")
    if reply is None:
        raise SQLError(f"the query could not run: the process running it died (exit code "
                       f"{worker.returncode}); the next query starts a new one")
    kind, value = reply
    if kind == "rows":
        return value
    raise (ResultTooLarge if kind == "ResultTooLarge" else SQLError)(value)


def _execute(db_path, sql, timeout_s, max_rows, max_bytes):
    """run_query's work, done in the worker: (column names, rows), or raises SQLError."""
    con = _connect(db_path)
    refused = []  # what the authorizer turned down, for the error message

    def authorize(action, arg1, arg2, db_name, trigger):
        if (action in _ALLOWED
                or (action == sqlite3.SQLITE_FUNCTION and arg2.lower() != "load_extension")
                or (action == sqlite3.SQLITE_PRAGMA and arg1.lower() in _READ_ONLY_PRAGMAS)):
            return sqlite3.SQLITE_OK
        refused.append(action)
        return sqlite3.SQLITE_DENY

    con.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)  # e.g. zeroblob(10**9) fails early
    con.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 100_000)
    con.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    con.set_authorizer(authorize)
    deadline = time.monotonic() + timeout_s
    # SQLite calls this every 1000 virtual-machine instructions; a true value interrupts the
    # query, so a recursive CTE without end or a huge cross join stops at the deadline. One long
    # built-in call is a single instruction: run_query kills the worker for that.
    con.set_progress_handler(lambda: time.monotonic() > deadline, 1000)
    try:
        cursor = con.execute(sql)  # compiles one statement; anything left after it is refused
        if cursor.description is None:
            raise SQLError("not a query: only a single read-only SELECT statement is allowed")
        rows, size = [], 0
        while batch := cursor.fetchmany(256):
            rows += batch
            size += sum(len(v) if isinstance(v, (str, bytes)) else 8 for row in batch for v in row)
            if len(rows) > max_rows:
                raise ResultTooLarge(f"the result has more than {max_rows} rows; add a LIMIT or aggregate")
            if size > max_bytes:
                raise ResultTooLarge(f"the result is larger than {max_bytes} bytes")
        return [d[0] for d in cursor.description], rows
    except (sqlite3.Error, sqlite3.Warning, UnicodeError) as e:  # UnicodeError: unencodable text
        if time.monotonic() > deadline:
            raise SQLError(f"the query ran longer than {timeout_s:g} s and was stopped") from None
        if refused:
            raise SQLError("not allowed: only a read-only SELECT may run (no writes, schema changes, "
                           "ATTACH, transactions or PRAGMA settings)") from None
        raise SQLError(str(e)) from None
    finally:
        con.close()


# The worker: a Python process of this file alone (no torch), started on a process's first query
# and kept for the next ones. A request is run_query's arguments pickled on its stdin; the reply,
# pickled on its stdout, is ("rows", (columns, rows)) or (the error's class name, its message).
# It is keyed by the pid that started it, so a process forked from this one (parallel.forked)
# starts its own and never reads its parent's pipe.
_WORKER_MARGIN_S = 1.0  # past the deadline, what the worker has to send its answer (and, on a
                        # process's first query, to start: about 0.1 s) before it is killed
_worker = None          # (pid of the process it serves, its subprocess.Popen)


def _worker_process():
    """This process's worker: started if there is none yet, or it died."""
    global _worker
    if _worker is None or _worker[0] != os.getpid() or _worker[1].poll() is not None:
        _stop_worker()
        here = os.path.dirname(os.path.abspath(__file__))
        code = f"import sys; sys.path.insert(0, {here!r}); import sql_env; sql_env._serve()"
        _worker = os.getpid(), subprocess.Popen([sys.executable, "-c", code],
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        # stopped and reaped when this process exits: multiprocessing runs this at a normal exit and
        # also, unlike atexit, at the end of a child it forked (parallel.forked), whose worker would
        # otherwise be left to init to reap, which in a container may never happen
        multiprocessing.util.Finalize(None, _stop_worker, exitpriority=0)
    return _worker[1]


def _stop_worker():
    """Kill this process's worker and reap it (no zombie); a forked child only forgets its parent's."""
    global _worker
    if _worker is not None and _worker[0] == os.getpid():
        _worker[1].kill()
        _worker[1].communicate()    # closes both pipes and waits for it
    _worker = None


def _serve():
    """The worker's loop: answer requests until the parent closes the pipe (it exited or stopped us)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is for the parent, which then closes our pipe
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    try:
        while True:
            request = pickle.load(requests)
            try:
                reply = "rows", _execute(*request)
            except SQLError as e:
                reply = type(e).__name__, str(e)
            except Exception as e:     # anything else a query raises: its error, and the worker lives on
                reply = "SQLError", f"the query failed: {type(e).__name__}: {e}"
            pickle.dump(reply, replies)
            replies.flush()
    except (EOFError, BrokenPipeError):
        pass


def database_tables(db_path):
    """The names of the tables in a database someone wants to ask about, read through the sandbox.
    Raises SQLError with one clear line when the file is missing, is not a SQLite database, or
    holds no table."""
    sql = "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name"
    try:
        rows = run_query(db_path, sql)[1]
    except SQLError as e:
        if not os.path.isfile(db_path):
            raise
        raise SQLError(f"{db_path} is not a SQLite database ({e})") from None
    if not rows:
        raise SQLError(f"{db_path} holds no tables: there is nothing to ask about")
    return [name for name, in rows]


def tables_read(db_path, sql):
    """The tables a read-only query reads, in the order their names first appear in it. SQLite
    reports every table the compiled statement reads to an authorizer callback (SQLITE_READ,
    including COUNT(*) and subqueries, excluding CTE and alias names), so no SQL parser is needed;
    the statement is compiled under EXPLAIN, never run. Raises SQLError if it does not compile."""
    con, read = _connect(db_path), {}
    # the authorizer reports a name as the query spells it or as the schema does: report the schema's
    canonical = {name.lower(): name
                 for name, in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

    def authorize(action, arg1, arg2, db_name, trigger):
        if action == sqlite3.SQLITE_READ and arg1.lower() in canonical:    # not a CTE's own name
            read.setdefault(canonical[arg1.lower()], None)
        allowed = action in _ALLOWED or (action == sqlite3.SQLITE_FUNCTION
                                         and arg2.lower() != "load_extension")
        return sqlite3.SQLITE_OK if allowed else sqlite3.SQLITE_DENY

    con.set_authorizer(authorize)
    try:
        con.execute("EXPLAIN " + sql).fetchall()   # the bytecode listing: compiles the query, runs nothing
    except (sqlite3.Error, sqlite3.Warning) as e:
        raise SQLError(str(e)) from None
    finally:
        con.close()

    def first_mention(table):   # only orders the answer; a name not written in the query goes last
        found = re.search(rf"\b{re.escape(table)}\b", sql, re.IGNORECASE)
        return found.start() if found else len(sql)
    return sorted(read, key=first_mention)


# ----------------------------------------------------------------------------- 2. scoring
def _canonical(value):
    """A hashable form under which equal answers are equal: 3 == 3.0, floats to 10 digits."""
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < 2**53 else float(f"{value:.10g}")
    return value


def _results_match(gold, pred, ordered):
    """Spider test-suite equality of two row lists, allowing the columns in any order."""
    if len(gold) != len(pred) or (gold and len(gold[0]) != len(pred[0])):
        return False
    if not gold:
        return True
    gold_cols, pred_cols = [Counter(c) for c in zip(*gold)], [Counter(c) for c in zip(*pred)]
    # Each gold column may be matched by any predicted column holding the same multiset of values.
    options = [[j for j, p in enumerate(pred_cols) if p == g] for g in gold_cols]
    for perm in itertools.product(*options):
        if len(set(perm)) < len(perm):
            continue
        rows = [tuple(row[j] for j in perm) for row in pred]
        if (rows == gold) if ordered else (Counter(rows) == Counter(gold)):
            return True
    return False


def _file_stamp(path):
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size  # a rebuilt database invalidates its cached results


@functools.lru_cache(maxsize=65536)
def _gold_rows(db_path, gold_sql, stamp):
    try:
        rows = run_query(db_path, gold_sql, GOLD_TIMEOUT_S, SCORE_MAX_ROWS, SCORE_MAX_BYTES)[1]
    except SQLError as e:
        raise SQLError(f"the gold query failed on {db_path}: {e}\n{gold_sql}") from None
    return [tuple(map(_canonical, row)) for row in rows]


def execution_outcome(db_path, pred_sql, gold_sql, timeout_s=2.0):
    """(correct, error): correct when pred_sql returns the same result as gold_sql; error is why
    pred_sql failed to run (None when it ran, right or wrong). Raises SQLError only if the gold fails."""
    gold = _gold_rows(db_path, gold_sql, _file_stamp(db_path))
    try:  # more rows than the gold is wrong anyway: cap there, so a huge result costs nothing
        pred = run_query(db_path, pred_sql, timeout_s, len(gold), SCORE_MAX_BYTES)[1]
    except ResultTooLarge:
        return False, None                              # it ran; its answer is too big to be right
    except SQLError as e:
        return False, str(e)
    pred = [tuple(map(_canonical, row)) for row in pred]
    return _results_match(gold, pred, ordered="order by" in gold_sql.lower()), None  # Spider's rule


def execution_match(db_path, pred_sql, gold_sql, timeout_s=2.0):
    """True when pred_sql returns the same result as gold_sql. Raises SQLError only if the gold fails."""
    return execution_outcome(db_path, pred_sql, gold_sql, timeout_s)[0]


# ----------------------------------------------------------------------------- 3. the episode
def _tool(name, description, **args):
    properties = {arg: {"type": "string", "description": text} for arg, text in args.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters":
            {"type": "object", "properties": properties, "required": list(args)}}}


TOOLS = [
    _tool("list_tables", "List the tables of the database and their columns."),
    _tool("describe_table", "Show one table's columns, types, keys and 3 sample rows.",
          table="the table name"),
    _tool("run_sql", "Run one read-only SQLite SELECT query and see its result.", query="the SQL query"),
    _tool("submit_answer", "Submit the SQL query that answers the question. This ends the episode.",
          query="the final SQL query"),
]
_TOOL_ARGS = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in TOOLS}


def _quote(name):
    return '"' + name.replace('"', '""') + '"'


def _cell(value):
    text = ("NULL" if value is None else str(round(value, 4)) if isinstance(value, float)
            else f"<{len(value)} bytes>" if isinstance(value, bytes) else str(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _format_rows(columns, rows, max_rows):
    """A result as a small pipe-separated table that says when rows were left out."""
    lines = [" | ".join(columns)] + [" | ".join(map(_cell, row)) for row in rows[:max_rows]]
    if len(rows) > max_rows:
        lines.append(f"... ({len(rows)} rows, showing the first {max_rows})")
    else:
        lines.append(f"({len(rows)} row{'' if len(rows) == 1 else 's'})")
    return "\n".join(lines)


class SQLEnv:
    """One episode: a task, the tools, and the outcome. `call` never raises on agent mistakes."""

    tools = TOOLS

    def __init__(self, task, max_rows=20, max_chars=1500, timeout_s=2.0):
        self.task, self.max_rows, self.max_chars, self.timeout_s = task, max_rows, max_chars, timeout_s
        self.done, self.submitted_sql, self.correct = False, None, False
        self.num_tool_calls = self.num_tool_errors = 0
        self.gold_error = None  # set if the task's own gold SQL failed: a data bug, not an agent error
        # the behaviour, counted: does the agent look before it queries, and submit what failed?
        self.num_describe_calls = 0   # describe_table calls, a wrong table name included
        # why the submitted query failed to run (None: it ran, or no submission);
        #   a query whose last run failed fails again, so this counts that too
        self.submit_error = None

    def call(self, name, arguments):
        """Run tool `name` with `arguments` (a dict) and return the observation text."""
        self.num_tool_calls += 1
        self.num_describe_calls += name == "describe_table"
        try:
            text = self._dispatch(name, arguments)
        except (ToolError, SQLError) as e:
            self.num_tool_errors += 1
            text = f"Error: {e}"
        if len(text) > self.max_chars:
            text = text[:self.max_chars] + f"\n... (truncated to {self.max_chars} characters)"
        return text

    def _dispatch(self, name, arguments):
        if self.done:
            raise ToolError("the answer was already submitted; the episode is over")
        if not isinstance(name, str) or name not in _TOOL_ARGS:
            raise ToolError(f"unknown tool {name!r}; the tools are {', '.join(_TOOL_ARGS)}")
        arguments = {} if arguments is None else arguments
        usage = f"{name} takes " + (", ".join(f'"{a}" (a string)' for a in _TOOL_ARGS[name])
                                    or "no arguments")
        if not isinstance(arguments, dict) or set(arguments) != set(_TOOL_ARGS[name]):
            raise ToolError(f"{usage}, got {json.dumps(arguments, default=str)[:200]}")
        if not all(isinstance(v, str) for v in arguments.values()):
            raise ToolError(usage)
        return getattr(self, "_" + name)(**arguments)

    def _query(self, sql, max_rows=1000):
        return run_query(self.task.db_path, sql, self.timeout_s, max_rows)

    def _tables(self):
        sql = "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name"
        return [row[0] for row in self._query(sql)[1]]

    def _list_tables(self):
        return "\n".join(f"{t}: " + ", ".join(col[1]
                                              for col in self._query(f"PRAGMA table_info({_quote(t)})")[1])
                         for t in self._tables())

    def _describe_table(self, table):
        by_name = {t.lower(): t for t in self._tables()}
        t = by_name.get(table.strip().strip('"`[]').lower())
        if t is None:
            raise ToolError(f"no table named {table!r}; the tables are {', '.join(by_name.values())}")
        refs = {fk[3]: f"{fk[2]}.{fk[4]}" if fk[4] else fk[2]
                for fk in self._query(f"PRAGMA foreign_key_list({_quote(t)})")[1]}
        lines = [f"table {t} ({self._query(f'SELECT COUNT(*) FROM {_quote(t)}')[1][0][0]} rows)"]
        for _, column, type_, _, _, pk in self._query(f"PRAGMA table_info({_quote(t)})")[1]:
            lines.append(f"  {column} {type_ or 'ANY'}" + (" primary key" if pk else "")
                         + (f" -> {refs[column]}" if column in refs else ""))
        columns, rows = self._query(f"SELECT * FROM {_quote(t)} LIMIT 3")
        return "\n".join(lines) + "\nsample rows:\n" + _format_rows(columns, rows, 3)

    def _run_sql(self, query):
        return _format_rows(*self._query(query), self.max_rows)

    def _submit_answer(self, query):
        self.done, self.submitted_sql = True, query
        if self.task.gold_sql is None:       # a question with no known answer: nothing to score against
            return "Answer submitted."
        try:
            self.correct, self.submit_error = execution_outcome(self.task.db_path, query, self.task.gold_sql,
                                                                self.timeout_s)
        except SQLError as e:
            self.gold_error = str(e)
        return "Answer submitted."


# ----------------------------------------------------------------------------- 4. loaders
SPIDER_FILES = {"train": ("train_spider.json", "database"), "dev": ("dev.json", "database"),
                "test": ("test.json", "test_database")}
BIRD_FILES = {"train": ("train.json", "train_databases"), "dev": ("dev.json", "dev_databases")}
BIRD_TIERS = {"simple": "easy", "moderate": "medium", "challenging": "hard"}


def _estimate_tier(sql):
    """Spider-like hardness from the gold SQL's shape, for questions that come without a tier."""
    s = " ".join(sql.lower().split())
    if s.count("select") > 1 or s.count(" join ") > 1:
        return "extra"
    if any(k in s for k in ("group by", "order by", "having", " limit ")):
        return "hard"
    if re.search(r" join | and | or |\b(count|sum|avg|min|max) ?\(", s):
        return "medium"
    return "easy"


def _load(root, files, split, sql_key, name):
    if split not in files:
        raise ValueError(f"{name} has splits {', '.join(files)}, not {split!r}")
    root = Path(root)
    path, db_folder = root / files[split][0], root / files[split][1]
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{name}: missing file {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{name}: malformed JSON in {path}: {e}") from None
    if not isinstance(entries, list):
        raise ValueError(f"{name}: {path} must hold a JSON list of questions")
    keys, tasks = ("db_id", "question", sql_key), []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in keys):
            raise ValueError(f"{name}: entry {i} of {path} lacks a string {', '.join(keys)}")
        db = db_folder / entry["db_id"] / f"{entry['db_id']}.sqlite"
        if not db.is_file():
            raise FileNotFoundError(f"{name}: missing database {db} (entry {i} of {path})")
        tier = BIRD_TIERS.get(entry.get("difficulty")) or _estimate_tier(entry[sql_key])
        tasks.append(Task(f"{name.lower()}-{split}-{i:05d}", str(db), entry["question"], entry[sql_key],
                          entry.get("evidence") or "", tier, split))
    return tasks


def load_spider(root, split="train"):
    """Spider layout: train_spider.json / dev.json (with "query"), database/<db_id>/<db_id>.sqlite."""
    return _load(root, SPIDER_FILES, split, "query", "Spider")


def load_bird(root, split="dev"):
    """BIRD layout: dev.json / train.json (with "SQL", "evidence"), dev_databases/<db_id>/<db_id>.sqlite."""
    return _load(root, BIRD_FILES, split, "SQL", "BIRD")


def load_tasks(source=None, split="train", seed=0):
    """Tasks of one split: the embedded set (source None or "default"), or a Spider or BIRD folder.
    Split "val" is VAL_SIZE tasks of the source's train split (at most a quarter of it), drawn with
    a seed of their own, so they spread over its templates and databases and sit at the same
    positions whatever `seed`; they keep their train ids and order."""
    if split == "val":
        train = load_tasks(source, "train", seed)
        size = min(VAL_SIZE, len(train) // 4)
        if not size:
            raise ValueError(f"{source or 'default'}: {len(train)} train tasks, "
                             f"too few to hold a quarter out as split val")
        return [train[i] for i in sorted(random.Random(0).sample(range(len(train)), size))]
    if source in (None, "default"):
        if split not in retail.SPLITS:
            raise ValueError(f"the embedded question set has splits {', '.join(retail.SPLITS)}, "
                             f"not {split!r}")
        questions = retail.split_questions(split, seed)
        # one file per rendering
        dbs = {r: retail.database_path(seed, r) for r in sorted({q[3] for q in questions})}
        return [Task(f"retail-{split}-{i:04d}", dbs[rendering], question, gold_sql, difficulty=tier,
                     split=split)
                for i, (tier, question, gold_sql, rendering) in enumerate(questions)]
    root = Path(source)
    if not root.is_dir():
        raise FileNotFoundError(f"no data folder at {root} (pass a Spider or BIRD folder, or None)")
    if (root / "database").is_dir():
        return load_spider(root, split)
    if (root / "dev_databases").is_dir() or (root / "train_databases").is_dir():
        return load_bird(root, split)
    raise ValueError(f"{root} is neither a Spider folder (with database/) nor a BIRD folder "
                     f"(with dev_databases/ or train_databases/)")


if __name__ == "__main__":
    start = time.time()
    splits = {split: load_tasks(split=split) for split in retail.SPLITS}
    print(f"embedded database at {retail.database_path()}, questions ready in {time.time() - start:.2f} s\n")
    env = SQLEnv(splits["train"][0])
    print(">>> list_tables()\n" + env.call("list_tables", {}) + "\n")
    print('>>> describe_table("orders")\n' + env.call("describe_table", {"table": "orders"}) + "\n")
    for tier in TIERS:
        for task in [t for t in splits["train"] if t.difficulty == tier][:2]:   # each on its own rendering
            print(f"[{tier}] {task.question}\n  {task.gold_sql}\n  "
                  + SQLEnv(task).call("run_sql", {"query": task.gold_sql}).replace("\n", "\n  ") + "\n")
    held_out = SQLEnv(splits["test_schema"][0])
    print(">>> list_tables() on the held-out schema (split test_schema)\n"
          + held_out.call("list_tables", {}) + "\n")
    for split, tasks in splits.items():
        counts = ", ".join(f"{tier} {sum(t.difficulty == tier for t in tasks)}" for tier in TIERS)
        print(f"{split}: {len(tasks)} questions ({counts})")
