"""Ask a trained agent questions about any SQLite database: one greedy episode per question,
each tool call and a short view of its observation printed as the engine records them.

    python ask.py --db shop.sqlite --adapter runs/default "How many orders were placed in May?"
    python ask.py --db shop.sqlite --adapter runs/default  # questions from standard input, one a line

The question has no gold SQL (Task.gold_sql is None): nothing is scored. The submitted query is
run again in the read-only sandbox and its rows are printed. A bad path or an adapter for another
base model gets one line of error before anything else happens.
"""
import argparse
import json
import textwrap

import lora
from agentrl import Limits, ToolCallError, Trajectory, parse_tool_call
from engine import Sampling, rollout_group
from sql_env import SQLEnv, SQLError, Task, database_tables

NO_ANSWER = {   # why an episode ended without a submitted query, in words
    "no_tool_call": "the agent answered in prose instead of calling a tool",
    "max_turns": "the agent used all its turns without submitting (--max-turns)",
    "max_new_tokens": "a turn ran past --max-new-tokens",
    "max_context": "the conversation outgrew --max-context",
    "non_finite_logits": "the model's logits were not finite (numeric overflow)",
}


def short_view(text, max_lines=6, width=100) -> str:
    """The first lines of a text, each cut to `width` characters, saying how many were left out."""
    lines = text.split("\n")
    shown = [line if len(line) <= width else line[:width - 3] + "..." for line in lines[:max_lines]]
    return "\n".join(shown + ([f"... ({len(lines) - max_lines} more lines)"] if len(lines) > max_lines
                              else []))


def show_message(message, turn) -> str:
    """A recorded message as the terminal shows it: a tool call as `turn. name  arguments`, an
    observation as an indented short view, a turn without a usable call as what it says."""
    if message["role"] == "tool":
        return textwrap.indent(short_view(message["content"]), "       ")
    try:
        name, args = parse_tool_call(message["content"])
    except ToolCallError as e:
        return (f"  {turn:>2}. no usable tool call ({e}):\n"
                + textwrap.indent(short_view(message["content"], 3), "       "))
    plain = all(isinstance(v, str) for v in args.values())
    return (f"  {turn:>2}. {name}  " + (" ".join(args.values()) if plain else json.dumps(args))).rstrip()


def ask(model, tokenizer, db_path, question, limits=Limits(max_turns=4, max_new_tokens=256)) -> Trajectory:
    """One greedy episode on a question about any SQLite database, printed as it happens (each tool
    call, a short view of each observation), then the submitted query and its result rows, run
    again in the sandbox, or "no answer" and why. The question has no gold SQL: nothing is scored."""
    task = Task("ask", db_path, question, gold_sql=None)
    trajectory = rollout_group(model, tokenizer, task, 1, Sampling(greedy=True), limits).trajectories[0]
    turn = 0
    for message in trajectory.messages[trajectory.turns[0][1]:]:     # after the prompt
        turn += message["role"] == "assistant"
        print(show_message(message, turn), flush=True)
    if trajectory.submitted_sql is None:
        print(f"no answer: {NO_ANSWER.get(trajectory.stop_reason, trajectory.stop_reason)}")
    else:
        result = SQLEnv(task).call("run_sql", {"query": trajectory.submitted_sql})
        print(f"answer: {trajectory.submitted_sql}\n" + textwrap.indent(result, "  "))
    return trajectory


def questions_from_stdin():
    """Questions typed (or piped) one a line, until the end of input; blank lines are skipped."""
    while True:
        try:
            line = input("question> ")
        except EOFError:
            print()
            return
        if line.strip():
            yield line.strip()


def main(argv=None) -> list[Trajectory]:
    p = argparse.ArgumentParser(description="Ask an agent questions about a SQLite database: "
                                            "one greedy episode per question, printed as it happens.")
    p.add_argument("question", nargs="?",
                   help="the question; without one, questions are read from standard input")
    p.add_argument("--db", required=True,
                   help="the SQLite file to ask about (opened read-only, in the sandbox)")
    p.add_argument("--adapter",
                   help="an adapter folder, or a run folder (its final adapter, else latest checkpoint)")
    p.add_argument("--model",
                   help="the base model (hub id or folder); default: the adapter's, else the embedded one")
    p.add_argument("--max-turns", type=int, default=4, help="assistant turns per episode")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per turn")
    p.add_argument("--max-context", type=int, default=4096, help="tokens per episode, prompt included")
    args = p.parse_args(argv)
    if min(args.max_turns, args.max_new_tokens, args.max_context) < 1:
        p.error("--max-turns, --max-new-tokens and --max-context must be >= 1")
    if args.question is not None and not args.question.strip():
        p.error("the question is empty")
    try:       # a bad path gets one line, before any model is loaded
        tables = database_tables(args.db)
        adapter = lora.find_adapter(args.adapter) if args.adapter else None
    except (SQLError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    model_name = args.model or (lora.adapter_base_model(adapter) if adapter else None)
    try:
        model, tokenizer = lora.load_model(model_name)
    except lora.ModelUnavailable as e:
        raise SystemExit(f"error: {e}") from None
    if adapter:
        try:
            lora.load_adapter(model, adapter)
        except (AssertionError, RuntimeError) as e:     # the adapter was trained on another base model
            raise SystemExit(f"error: the adapter {adapter} does not fit "
                             f"{model_name or lora.EMBEDDED_NAME}: {e}") from None
    print(f"database: {args.db} ({len(tables)} table{'s' * (len(tables) != 1)})"
          f" | model: {model_name or lora.EMBEDDED_NAME} | adapter: {adapter or 'none'}")
    limits = Limits(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                    max_context=args.max_context)
    trajectories = []
    for question in [args.question] if args.question is not None else questions_from_stdin():
        print(f"question: {question}")
        trajectories.append(ask(model, tokenizer, args.db, question, limits))
    return trajectories


if __name__ == "__main__":
    main()
