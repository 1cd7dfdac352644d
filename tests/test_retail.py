"""Tests for retail.py: the embedded database, its schema renderings, the question set, and the
held-out splits.

Everything writes under pytest's tmp folders (AGENTRL_CACHE is pointed there), nothing is downloaded.
"""
import hashlib
import os
import re
import sqlite3
import time
from collections import Counter

import pytest

import retail
import sql_env
from sql_env import load_tasks, run_query


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()

def test_database_is_deterministic(tmp_path):
    """Same seed, same bytes: runs and papers can name the data by its seed."""
    a, b, c = (retail.build_database(str(tmp_path / name), seed) for name, seed in
               [("a.sqlite", 0), ("b.sqlite", 0), ("c.sqlite", 1)])
    assert sha256(a) == sha256(b)
    assert sha256(a) != sha256(c)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")], "temp file left behind"


def test_default_database_is_rebuilt_when_corrupt(db):
    """A truncated or garbage cache file is detected and rebuilt to the same bytes, not used."""
    good = sha256(db)
    with open(db, "r+b") as f:
        f.truncate(4096)
    assert retail.database_path() == db and sha256(db) == good
    os.remove(db)
    assert retail.database_path() == db and sha256(db) == good


def test_database_is_realistic(db):
    """>= 6 tables with keys, thousands of rows, and every kind of value the agent must handle."""
    con = sqlite3.connect(db)
    tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    assert len(tables) >= 6
    assert sum(con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in tables) in range(1000, 10_000)
    assert sum(len(con.execute(f"PRAGMA foreign_key_list({t})").fetchall()) for t in tables) >= 6
    kinds = set()
    for t in tables:
        for c in con.execute(f"PRAGMA table_info({t})").fetchall():
            kinds |= {k for k, in con.execute(f"SELECT DISTINCT typeof({c[1]}) FROM {t}")}
            kinds |= {"date" for _ in con.execute(f"SELECT 1 FROM {t} WHERE {c[1]} GLOB '20[0-9][0-9]-[01][0-9]-*'")}
    assert kinds == {"integer", "real", "text", "null", "date"}


def test_split_sizes_and_tiers(splits):
    """Enough questions in every tier of every split: the trainer samples tasks by tier."""
    assert len(splits["train"]) >= 1000 and len(splits["test"]) >= 200 and len(splits["test_schema"]) >= 200
    for tasks in splits.values():
        counts = Counter(t.difficulty for t in tasks)
        assert set(counts) == set(sql_env.TIERS) and min(counts.values()) >= 40
    ids = [t.id for tasks in splits.values() for t in tasks]
    assert len(ids) == len(set(ids))


def test_question_set_is_deterministic_and_fast(cache, splits):
    """Regenerating the question set gives the same tasks, and quickly (tests and train.py call it)."""
    retail.questions.cache_clear()
    start = time.time()
    again = load_tasks(split="train")
    assert time.time() - start < 10
    assert [(t.id, t.question, t.gold_sql) for t in again] == [(t.id, t.question, t.gold_sql) for t in splits["train"]]


def test_every_gold_query_runs_and_is_not_empty(splits):
    """A question whose gold SQL fails or returns nothing cannot be answered right."""
    for task in [t for tasks in splits.values() for t in tasks]:
        columns, rows = run_query(task.db_path, task.gold_sql)
        assert rows and any(v not in (None, 0) for v in rows[0]), task


def test_ambiguous_gold_queries_are_rejected(db):
    """Ties under ORDER BY ... LIMIT make the answer depend on the engine: such queries are dropped."""
    con = sqlite3.connect(db)
    assert retail.is_clear(con, "SELECT name FROM products ORDER BY price DESC LIMIT 1")
    assert not retail.is_clear(con, "SELECT status FROM orders ORDER BY order_id > 0 LIMIT 1")  # all tied
    assert not retail.is_clear(con, "SELECT COUNT(*) FROM orders WHERE status = 'no such status'")  # 0
    assert not retail.is_clear(con, "SELECT name FROM products WHERE price < 0")  # empty


def literals(sql):
    """The values a query mentions: quoted strings and numbers, minus LIMIT counts and date formats.
    A customer is one value, its full name (first names alone are shared by many customers)."""
    sql = re.sub(r"first_name = '(\w+)' AND (c\.)?last_name = '(\w+)'", r"name = '\1 \3'", sql)
    sql = re.sub(r"LIMIT \d+", "", sql)
    return {s for s in re.findall(r"'[^']*'|\b\d+\b", sql) if not s.startswith("'%")}


def test_test_split_is_held_out(cache):
    """No test question, gold query or value appears in train, so test accuracy is not memorization.
    Compared on rendering 0, where the regex above reads the original column names."""
    train, test = retail.questions()["train"], retail.questions()["test"]
    assert not {q.text for q in train} & {q.text for q in test}
    assert not {q.golds[0] for q in train} & {q.golds[0] for q in test}
    train_values = set().union(*(literals(q.golds[0]) for q in train))
    test_values = set().union(*(literals(q.golds[0]) for q in test))
    assert test_values and not train_values & test_values


def test_test_wordings_never_appear_in_train(splits):
    """Each template's last wording (and every held-out template) is used only in test."""
    def pattern(wording):
        return re.compile(re.sub(r"\\\{\w+\\\}", ".+", re.escape(wording)) + "$")
    test_only = [pattern(w.split(" | ")[-1]) for *_, w in retail.TEMPLATES]
    test_only += [pattern(w) for *_, w in retail.HELD_OUT_TEMPLATES]
    for task in splits["train"]:
        assert not any(p.match(task.question) for p in test_only), task.question
    assert all(any(p.match(t.question) for p in test_only) for t in splits["test"])


def constructs(sql):
    sql = re.sub(r"'[^']*'", "''", sql)
    return set(re.findall(r"\b[A-Z][A-Z_]+\b|\b[a-z_]+\(", sql)) | {f"{sql.count(' JOIN ')} joins"}


def test_test_needs_no_construct_unseen_in_train(cache):
    """Test combines SQL skills that train teaches; a construct never seen in train measures nothing."""
    train = set().union(*(constructs(q.golds[0]) for q in retail.questions()["train"]))
    test = set().union(*(constructs(q.golds[0]) for q in retail.questions()["test"]))
    assert test <= train, test - train
    assert len(retail.HELD_OUT_TEMPLATES) >= 1


# ----------------------------------------------------------------------------- schema renderings
def result(con, sql):
    """A query's answer as the scorer compares it: a list under ORDER BY, else a multiset."""
    rows = con.execute(sql).fetchall()
    return rows if "ORDER BY" in sql else Counter(rows)


def test_every_gold_result_is_the_same_under_every_rendering(cache):
    """Each question's gold SQL, made from its template for every rendering, returns on that
    rendering's database what rendering 0's returns: the renderings are one world under other
    names, so a question keeps its answer whichever schema it is asked on."""
    cons = [sqlite3.connect(retail.database_path(rendering=r)) for r in range(len(retail.RENDERINGS))]
    hand_written = retail.HELD_OUT_RENDERING + 1
    everything = retail.questions()["train"] + retail.questions()["test"]
    for i, q in enumerate(everything):
        assert len(set(q.golds[:hand_written])) == hand_written, f"two renderings gave the same SQL: {q.golds}"
        expected = result(cons[0], q.golds[0])
        renderings = range(1, len(cons)) if i % 8 == 0 else range(1, hand_written)   # the generated: every 8th question
        for r in renderings:
            assert result(cons[r], q.golds[r]) == expected, (q.golds[0], q.golds[r])


@pytest.mark.parametrize("split, generated", [("train_mixed", retail.MIXED_RENDERINGS),
                                              ("train_wide", retail.WIDE_RENDERINGS)])
def test_train_mixed_asks_train_over_generated_renderings_with_the_same_answers(splits, split, generated):
    """train_mixed (and train_wide) is train's questions, in train's order, spread evenly over the
    training renderings and its own generated ones (never the held-out one), each gold query
    answering on its rendering what train's gold query answers on its own."""
    paths = {retail.database_path(rendering=r): r for r in retail.TRAIN_RENDERINGS + generated}
    counts = Counter(t.db_path for t in splits[split])
    assert set(counts) == set(paths) and max(counts.values()) - min(counts.values()) <= 1
    assert len(generated) >= 16 and retail.HELD_OUT_RENDERING not in generated
    assert not set(retail.MIXED_RENDERINGS) & set(retail.WIDE_RENDERINGS)
    cons = {}
    for plain, mixed in zip(splits["train"], splits[split], strict=True):
        assert (plain.question, plain.difficulty) == (mixed.question, mixed.difficulty)
        for task in (plain, mixed):
            cons.setdefault(task.db_path, sqlite3.connect(task.db_path))
        assert result(cons[mixed.db_path], mixed.gold_sql) == result(cons[plain.db_path], plain.gold_sql), mixed.gold_sql


def test_generated_renderings_mix_the_training_words_under_new_names(cache):
    """Each generated rendering takes every table's words from one training rendering, in one style
    (snake_case or CamelCase) and with one prefix (or none); together they are a combination no
    other rendering has, and no table is named as a held-out one."""
    def tables(rendering):
        return frozenset(name.lower() for name in retail.names(rendering)[0].values())
    held_out = tables(retail.HELD_OUT_RENDERING)
    everyone = [tables(r) for r in range(len(retail.RENDERINGS))]
    assert len(set(everyone)) == len(everyone), "two renderings name their tables alike"
    drawn = set()
    for r in retail.MIXED_RENDERINGS:
        assert not tables(r) & held_out
        specs = retail.RENDERINGS[r][1]
        ways = {(style, prefix) for style in ("snake", "camel") for prefix in retail.NAME_PREFIXES
                if all(any(specs[table] == retail.restyle_table(retail.RENDERINGS[t][1][table], style, prefix)
                           for t in retail.TRAIN_RENDERINGS) for table in retail.COLUMNS)}
        assert len(ways) == 1, (retail.RENDERINGS[r][0], ways)   # one style and one prefix for every table
        drawn |= ways
    assert {style for style, _ in drawn} == {"snake", "camel"} and len({prefix for _, prefix in drawn}) >= 5
    assert retail.restyle("CustomerId", "snake") == "customer_id"
    assert retail.restyle("order_items", "camel", "crm") == "CrmOrderItems"
    assert retail.restyle_table("tbl_order ord_id cust_id", "camel", "dw") == "DwTblOrder OrdId CustId"


def test_wide_renderings_rename_tables_with_new_words_and_keep_their_columns(cache):
    """Each train_wide rendering is a mixed one (one training rendering's entry per table, one style,
    one prefix) in which some tables are renamed with a TABLE_WORDS word, columns untouched: most
    tables in all, in every rendering at least one. No such word is a hand-written table's word,
    so the held-out names stay unseen."""
    hand_written = {retail.restyle(entry.split()[0], "snake") for _, spec in retail.RENDERINGS[:retail.HELD_OUT_RENDERING + 1]
                    for entry in spec.values()}
    words = {table: set(retail.TABLE_WORDS[table].split()) for table in retail.COLUMNS}
    assert not set().union(*words.values()) & hand_written
    held_out = {name.lower() for name in retail.names(retail.HELD_OUT_RENDERING)[0].values()}
    renamed = 0
    for r in retail.WIDE_RENDERINGS:
        specs = retail.RENDERINGS[r][1]
        assert not {name.lower() for name in retail.names(r)[0].values()} & held_out
        ways = set()
        for style in ("snake", "camel"):
            for prefix in retail.NAME_PREFIXES:
                kept, new = 0, 0
                for table in retail.COLUMNS:
                    first, *columns = specs[table].split()
                    for t in retail.TRAIN_RENDERINGS:
                        drawn = retail.restyle_table(retail.RENDERINGS[t][1][table], style, prefix).split()
                        if drawn == [first] + columns:
                            kept += 1
                            break
                        if drawn[1:] == columns and any(first == retail.restyle(w, style, prefix) for w in words[table]):
                            new += 1
                            break
                if kept + new == len(retail.COLUMNS):
                    ways.add((style, prefix, new))
        assert len(ways) == 1, (retail.RENDERINGS[r][0], ways)
        ((_, _, new),) = ways
        assert new >= 1, retail.RENDERINGS[r][0]
        renamed += new
    assert renamed > 0.6 * len(retail.WIDE_RENDERINGS) * len(retail.COLUMNS)


def test_held_out_rendering_shares_no_table_name_with_training(cache):
    """The held-out schema's tables are named as in no training rendering (SQLite names ignore
    case), so remembering a training schema cannot answer test_schema: only reading it can."""
    def tables(rendering):
        return {name.lower() for name in retail.names(rendering)[0].values()}
    held_out = tables(retail.HELD_OUT_RENDERING)
    assert len(held_out) == 7 and retail.HELD_OUT_RENDERING not in retail.TRAIN_RENDERINGS
    for r in retail.TRAIN_RENDERINGS:
        assert not held_out & tables(r), retail.RENDERINGS[r][0]
    with sqlite3.connect(retail.database_path(rendering=retail.HELD_OUT_RENDERING)) as con:
        actual = {row[0].lower() for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert actual == held_out


def test_renderings_keep_keys_and_rename_foreign_keys_to_match(cache):
    """Every rendering is the same schema: the same row counts, primary keys and foreign keys,
    each foreign key naming its rendering's table and a column that exists there."""
    shapes = []
    for r in range(len(retail.RENDERINGS)):
        con, tables = sqlite3.connect(retail.database_path(rendering=r)), retail.names(r)[0]
        shape = []
        for logical, physical in tables.items():
            columns = {c[1] for c in con.execute(f"PRAGMA table_info({physical})")}
            keys = con.execute(f"PRAGMA foreign_key_list({physical})").fetchall()
            for key in keys:                     # (id, seq, table, from, to, ...)
                target = {c[1] for c in con.execute(f"PRAGMA table_info({key[2]})")}
                assert key[2] in tables.values() and key[3] in columns and key[4] in target, (r, physical, key)
            shape.append((con.execute(f"SELECT COUNT(*) FROM {physical}").fetchone()[0], len(columns), len(keys),
                          sum(c[5] > 0 for c in con.execute(f"PRAGMA table_info({physical})"))))
        shapes.append(shape)
    assert all(shape == shapes[0] for shape in shapes)


def test_splits_use_their_renderings(splits):
    """train spreads over the training renderings about evenly and never touches the held-out one;
    test is rendering 0 (today's names, comparable with earlier results); test_schema asks the
    test questions, in the same order, on the held-out rendering."""
    paths = {r: retail.database_path(rendering=r) for r in range(len(retail.RENDERINGS))}
    counts = Counter(t.db_path for t in splits["train"])
    assert set(counts) == {paths[r] for r in retail.TRAIN_RENDERINGS}
    assert max(counts.values()) - min(counts.values()) <= 1
    assert {t.db_path for t in splits["test"]} == {paths[0]}
    assert {t.db_path for t in splits["test_schema"]} == {paths[retail.HELD_OUT_RENDERING]}
    pairs = list(zip(splits["test"], splits["test_schema"]))
    assert len(splits["test"]) == len(splits["test_schema"])
    assert all(a.question == b.question and a.difficulty == b.difficulty and a.gold_sql != b.gold_sql for a, b in pairs)


def test_markers_resolve_or_fail_loudly():
    """A template names tables and columns with markers; an alias must be declared, a name must
    exist: a typo in a template is an error at generation, not a query that silently fails."""
    template = "SELECT [c.first_name], COUNT(*) FROM [customers] AS c WHERE [customers.city] = '{city}'"
    assert retail.resolve(template, 0) == "SELECT c.first_name, COUNT(*) FROM customers AS c WHERE city = '{city}'"
    assert retail.resolve(template, 2) == "SELECT c.given_name, COUNT(*) FROM clients AS c WHERE town = '{city}'"
    for bad in ["SELECT [x.first_name] FROM [customers] AS c", "SELECT [customers.nope] FROM [customers]"]:
        with pytest.raises((AssertionError, KeyError)):
            retail.resolve(bad, 1)
