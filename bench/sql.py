"""What the SQL tool's worker process costs: `python -m bench sql`.

sql_env.run_query runs each statement in a worker process that is killed past the time limit
(the limit then holds for a statement stuck inside one built-in call). This plays one episode of
four tool calls per task (list_tables, describe_table, run_sql, submit_answer), as a trajectory
makes them, through the worker and through the same code in this process (sql_env._execute),
alternating, and prints the median of 5 rounds of each side by side, and a worker's start.
"""
import statistics
import time
from unittest import mock

import sql_env

ROUNDS = 5
STEP_EPISODES = 32     # a default GRPO step: 8 trajectories x 2 groups x 2 candidates


def in_process(db_path, sql, timeout_s=2.0, max_rows=1000, max_bytes=sql_env.MAX_RESULT_BYTES):
    return sql_env._execute(db_path, sql, timeout_s, max_rows, max_bytes)


def episode_ms(tasks, run_query):
    """Milliseconds a task's episode of four tool calls takes, with run_query answering its queries."""
    with mock.patch.object(sql_env, "run_query", run_query):
        start = time.perf_counter()
        for task in tasks:
            env = sql_env.SQLEnv(task)
            table = sql_env.tables_read(task.db_path, task.gold_sql)[0]
            for name, arguments in [("list_tables", {}), ("describe_table", {"table": table}),
                                    ("run_sql", {"query": task.gold_sql}), ("submit_answer", {"query": task.gold_sql})]:
                env.call(name, arguments)
        return (time.perf_counter() - start) / len(tasks) * 1e3


def bench_sql(args):
    tasks = sql_env.load_tasks("default", "train")[::5]
    episode_ms(tasks, sql_env.run_query)         # warm: the worker started, the gold results cached
    counted = mock.Mock(side_effect=sql_env.run_query)
    episode_ms(tasks, counted)
    queries = counted.call_count / len(tasks)
    rounds = [(episode_ms(tasks, in_process), episode_ms(tasks, sql_env.run_query)) for _ in range(ROUNDS)]
    here, worker = (statistics.median(side) for side in zip(*rounds))
    print(f"{len(tasks)} episodes of {queries:.1f} queries, median of {ROUNDS} rounds")
    print(f"{'in this process':<18}{here:>8.2f} ms an episode")
    print(f"{'in the worker':<18}{worker:>8.2f} ms an episode   {worker / here:.2f}x, "
          f"{(worker - here) / queries * 1e3:.0f} us a query, +{STEP_EPISODES * (worker - here):.0f} ms "
          f"a default GRPO step ({STEP_EPISODES} episodes)")
    start = time.perf_counter()
    sql_env._stop_worker()
    sql_env.run_query(tasks[0].db_path, "SELECT 1")
    print(f"a worker's start (a process's first query): {(time.perf_counter() - start) * 1e3:.0f} ms")
