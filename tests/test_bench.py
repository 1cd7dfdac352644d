"""Tests for the bench package: the statistics its learning claims rest on, on examples whose
answer is known; the instruments of its speed figures; each train.py-driven benchmark end to end
on the tiny model; and its place in the layout (the core never imports it).

Run: python -m pytest -q tests/test_bench.py
"""
import json
import os
import re
import sys
import time

import pytest

import train
import engine
import evaluate
from bench import accelerations, common, learn, rollout, update
from bench.__main__ import main
from files import read_json, read_jsonl


@pytest.mark.parametrize("n, c, k, expected", [
    (8, 0, 8, 0.0), (8, 8, 1, 1.0), (8, 1, 1, 1 / 8), (8, 1, 8, 1.0),
    (4, 2, 2, 1 - 1 / 6),          # C(2, 2) / C(4, 2): both draws among the 2 wrong ones
])
def test_pass_at_k(n, c, k, expected):
    assert learn.pass_at_k(n, c, k) == pytest.approx(expected)


def test_chosen_variants_keep_the_order_asked_and_refuse_unknown_names():
    from types import SimpleNamespace
    variants = {"a": 1, "b": 2, "c": 3}
    assert common.chosen_variants(SimpleNamespace(variants=None), variants) == ["a", "b", "c"]
    assert common.chosen_variants(SimpleNamespace(variants="c,a"), variants) == ["c", "a"]
    with pytest.raises(SystemExit, match="unknown"):
        common.chosen_variants(SimpleNamespace(variants="a,z"), variants)


def test_query_template_keeps_the_query_and_blanks_its_values():
    one = "SELECT COUNT(*) FROM orders WHERE city = 'Lyon' AND total > 180.5 AND name = 'O''Brien'"
    other = "SELECT COUNT(*) FROM orders WHERE city = 'Paris' AND total > 80 AND name = 'Smith'"
    assert learn.query_template(one) == learn.query_template(other) == \
        "SELECT COUNT(*) FROM orders WHERE city = ? AND total > ? AND name = ?"
    assert learn.query_template("SELECT t2.x FROM t2") == "SELECT t2.x FROM t2"    # names keep their digits


def test_template_moves_names_the_templates_a_difference_comes_from():
    """Three templates: A gains 3 of its 3 questions, B gains one and loses one (net 0, but it
    moved), C stays; task 9 is only in `before` and is not counted."""
    templates = {0: "A", 1: "A", 2: "A", 3: "B", 4: "B", 5: "C", 6: "C", 9: "C"}
    before = {0: 0, 1: 0, 2: 0, 3: 1, 4: 0, 5: 1, 6: 0, 9: 1}
    after = {0: 1, 1: 1, 2: 1, 3: 0, 4: 1, 5: 1, 6: 0}
    lines = learn.template_moves(before, after, templates).splitlines()
    assert lines == ["templates moved: 2 of 3, most:", "  +3/-0 of 3  A", "  +1/-1 of 2  B"]
    assert learn.template_moves(before, before, templates) == "templates moved: 0 of 3"
    assert learn.template_moves(before, after, templates, most=1).splitlines()[1:] == ["  +3/-0 of 3  A"]


def _evaluation(step, outcomes_by_split, ids_by_split):
    """An evaluation record as evaluate.evaluate_splits writes it: eval_* for the first split, SPLIT_* after."""
    record = {"step": step, "eval_split": next(iter(outcomes_by_split))}
    for i, (split, outcomes) in enumerate(outcomes_by_split.items()):
        prefix = "eval" if i == 0 else split
        ids = ids_by_split[split][:len(outcomes)]
        record.update({f"{prefix}_task_ids": ids, f"{prefix}_outcomes": outcomes, f"{prefix}_tasks": len(ids),
                       f"{prefix}_accuracy": outcomes.count("1") / len(ids), f"{prefix}_failed_submit_rate": 0.5})
    return record


def test_pair_compares_the_last_evaluation_of_a_run_with_an_eval_only_folder(splits, tmp_path, capsys):
    """The run's last evaluation (not its first, not a step record) against an --eval-only record
    of a subset: paired on the 10 tasks both ran, on the one split both have."""
    import json
    from types import SimpleNamespace
    ids = {split: [t.id for t in tasks] for split, tasks in splits.items()}
    run, only = tmp_path / "run", tmp_path / "only"
    run.mkdir(), only.mkdir()
    lines = [_evaluation(0, {"test": "0" * 20, "test_schema": "0" * 20}, ids), {"step": 1, "reward_mean": 0.5},
             _evaluation(1, {"test": "1" * 4 + "0" * 16, "test_schema": "1" * 20}, ids)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run / "config.json").write_text(json.dumps({"data": "default"}))
    (only / "eval_only.json").write_text(json.dumps({"adapter": "x", "data": "default",
                                                     **_evaluation(0, {"test": "1" * 10}, ids)}) + "\n")
    learn.bench_pair(SimpleNamespace(paths=[str(run), str(only)]))
    out = capsys.readouterr().out
    # before: 4 of the shared 10 solved; after: all 10, so 6 gained, none lost, +60 points, p = 2 / 2^6
    assert "test: 0.400 -> 1.000 on 10 tasks: +60.0 points" in out and "6 gained, 0 lost" in out
    templates = len({learn.query_template(t.gold_sql) for t in splits["test"][:10]})
    assert f"by template ({templates} templates)" in out
    assert f"p={2 / 64:.3f}" in out and "test_schema" not in out
    assert "(20 tasks)" in out and "(10 tasks)" in out      # failed-submission rates are each of their own tasks
    learn.bench_pair(SimpleNamespace(paths=[f"{run}@0", str(run)]))      # RUN@STEP: where RL started, then the end
    out = capsys.readouterr().out
    assert "test: 0.000 -> 0.200 on 20 tasks: +20.0 points" in out and "test_schema: 0.000 -> 1.000" in out
    with pytest.raises(SystemExit, match="at step 7"):
        learn.evaluation_record(f"{run}@7")


def test_pair_of_several_runs_averages_them_task_by_task(splits, tmp_path, capsys):
    """Two seeds against one start on 10 tasks: the first gains tasks 0-3, the second gains 0-1 and
    loses 8-9. Each is printed as its own pair; their mean is (4 + 0) / 2 = +2 tasks of 10."""
    import json
    from types import SimpleNamespace
    ids = {split: [t.id for t in tasks] for split, tasks in splits.items()}
    folders = {name: tmp_path / name for name in ("start", "seed0", "seed1")}
    for name, outcomes in (("start", "0000000011"), ("seed0", "1111000011"), ("seed1", "1100000000")):
        folders[name].mkdir()
        (folders[name] / "eval_only.json").write_text(json.dumps({"data": "default", **_evaluation(0, {"test": outcomes}, ids)}) + "\n")
    learn.bench_pair(SimpleNamespace(paths=[str(folders[n]) for n in ("start", "seed0", "seed1")]))
    out = capsys.readouterr().out
    assert "0.200 -> 0.600 on 10 tasks: +40.0 points" in out and "4 gained, 0 lost" in out
    assert "0.200 -> 0.200 on 10 tasks: +0.0 points" in out and "2 gained, 2 lost" in out
    assert out.count("templates moved:") == 2                       # under each run's own line
    assert "mean of 2 runs: 0.200 -> 0.400 on 10 tasks: +20.0 points" in out
    assert "the runs: +40.0, +0.0 (spread 40.0)" in out
    start = [0] * 8 + [1, 1]
    mean_after = [1, 1, 0.5, 0.5, 0, 0, 0, 0, 0.5, 0.5]
    _, (low, high), _ = evaluate.paired_difference(start, mean_after)     # the interval of the averaged outcomes
    assert f"[{100 * low:+.1f}, {100 * high:+.1f}] by task" in out.splitlines()[-1]


def test_pair_refuses_what_it_cannot_pair(splits, tmp_path):
    import json
    from types import SimpleNamespace
    ids = {split: [t.id for t in tasks] for split, tasks in splits.items()}
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for folder, record in ((a, _evaluation(0, {"test": "01"}, ids)), (b, _evaluation(0, {"test_schema": "01"}, ids)),
                           (c, {"data": "elsewhere", **_evaluation(0, {"test": "01"}, ids)})):
        folder.mkdir()
        (folder / "eval_only.json").write_text(json.dumps(record) + "\n")
    with pytest.raises(SystemExit, match="no split evaluated in all"):
        learn.bench_pair(SimpleNamespace(paths=[str(a), str(b)]))
    with pytest.raises(SystemExit, match="different data"):
        learn.bench_pair(SimpleNamespace(paths=[str(a), str(c)]))
    with pytest.raises(SystemExit, match="no evaluation there"):
        learn.bench_pair(SimpleNamespace(paths=[str(a), str(tmp_path / "missing")]))
    with pytest.raises(SystemExit, match="two evaluations"):
        learn.bench_pair(SimpleNamespace(paths=[str(a)]))


def test_profiled_seconds_finds_the_matmuls_and_the_attention_of_a_forward(tiny_llama):
    """The rollout bench splits the forwards' time by these two ops: a forward must go through
    both (else the split would put everything in 'the rest'), each inside the profiled wall time."""
    import time
    import torch
    ids = torch.randint(0, 100, (4, 24))
    start = time.perf_counter()
    with torch.no_grad():
        parts = rollout.profiled_seconds(lambda: tiny_llama(input_ids=ids, attention_mask=torch.ones_like(ids)),
                                       {"matmuls": "aten::linear", "attention": "aten::scaled_dot_product_attention",
                                        "absent": "aten::no_such_op"})
    wall = time.perf_counter() - start
    assert parts["matmuls"] > 0 and parts["attention"] > 0 and parts["absent"] == 0
    assert parts["matmuls"] + parts["attention"] < wall


def test_forward_work_counts_the_flops_torch_counts(tiny_llama):
    """The floor's FLOPs (rollout.forward_work, from bench.common.CountingForward's counters) are the
    ones torch's FLOP counter sees in the same forwards: a 120-token prompt fed to 3 rows (a flush),
    then one token a row against the cache (norm weights count as matmul weights: well under 1%).
    Eager attention, whose matmuls the counter sees (it counts nothing for SDPA on a CPU)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    import kvcache
    tiny_llama.set_attn_implementation("eager")
    forward, cache = common.CountingForward(tiny_llama), kvcache.KVCache(tiny_llama.config)
    mask = torch.ones((3, 120), dtype=torch.long)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        logits = forward(torch.randint(0, 100, (3, 120)), mask, cache)
        forward(torch.randint(0, 100, (3, 1)), torch.cat([mask, torch.ones((3, 1), dtype=torch.long)], 1), cache)
    stats = forward.stats
    assert logits.shape == (3, tiny_llama.config.vocab_size)           # the last column's logits of each row
    assert (stats["forwards"], stats["flush_forwards"], stats["fed_tokens"], stats["flush_fed_tokens"]) == (2, 1, 363, 360)
    assert (stats["logit_rows"], stats["cache_columns"], stats["query_key_pairs"]) == (6, 3 * 120 + 3 * 121, 360 * 120 + 3 * 121)
    assert 0 < stats["flush_forward_s"] < stats["forward_s"]
    work, flush = rollout.forward_work(tiny_llama, stats), rollout.forward_work(tiny_llama, stats, "flush_")
    assert work["matmul_flops"] + work["attention_flops"] == pytest.approx(counter.get_total_flops(), rel=0.005)
    assert 0 < flush["matmul_flops"] < work["matmul_flops"] and 0 < flush["attention_flops"] < work["attention_flops"]
    assert rollout.floor_seconds(work, bandwidth=1.0, flops=1e30)["all"] == work["matmul_bytes"] + work["attention_bytes"]


def test_counted_rollout_counts_the_forwards_and_changes_no_trajectory(tiny_llama, smol_tokenizer):
    """bench.common.counted_rollout: the same trajectories as rollout_groups alone (the same seed),
    its counters add up (every sampled token came from a logit row; the flushes fed the prompts),
    and agentrl's CachedForward is itself again afterwards."""
    import agentrl
    import sql_env
    tasks = sql_env.load_tasks()[:2]
    sampling, limits = engine.Sampling(seed=3), agentrl.Limits(max_turns=2, max_new_tokens=6, max_context=1024)
    plain = engine.rollout_groups(tiny_llama, smol_tokenizer, tasks, 2, sampling, limits)
    original = engine.CachedForward
    groups, stats = common.counted_rollout(tiny_llama, smol_tokenizer, tasks, 2, sampling, limits)
    assert engine.CachedForward is original
    assert [[t.token_ids for t in g.trajectories] for g in groups] == [[t.token_ids for t in g.trajectories] for g in plain]
    generated = sum(sum(t.assistant_mask) for g in groups for t in g.trajectories)
    assert stats["generated_tokens"] == generated > 0
    assert stats["forwards"] > stats["flush_forwards"] >= 1 and stats["logit_rows"] >= stats["forwards"]
    prompt = max(g.trajectories[0].assistant_mask.index(1) for g in groups)   # the longest prompt, fed at a flush
    assert stats["prompt_tokens"] == stats["flush_fed_tokens"] >= prompt
    # a token is fed once for all the rows that agree up to it (a prompt: once for its 2 rows), never twice
    assert stats["fed_tokens"] < sum(len(t.token_ids) for g in groups for t in g.trajectories)
    assert stats["fed_tokens"] <= stats["fed_columns"] and stats["flush_fed_tokens"] < stats["fed_tokens"]
    assert 0 < stats["forward_s"] <= stats["total_s"]


def test_weight_stream_rates_read_the_weights_a_decode_forward_multiplies(tiny_llama):
    """The rollout bench's "what keeps the weight matmuls above it" streams exactly the weights a
    decode forward multiplies, each once: torch's FLOP counter sees 2 FLOPs per weight per row in
    one token a row through the engine's forward with the LoRA merged (its A and B folded away, the
    tied lm_head counted once, the embedding's lookup no matmul; SDPA, which the counter does not
    count on a CPU). Every rate is a positive number."""
    import math
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    import kvcache
    import lora
    lora.apply_lora(tiny_llama, r=4)
    rows = 3
    rates = rollout.weight_stream_rates(tiny_llama, rows)
    forward, cache = common.CountingForward(tiny_llama), kvcache.KVCache(tiny_llama.config)
    with torch.no_grad(), lora.lora_merged(tiny_llama), FlopCounterMode(display=False) as counter:
        forward(torch.randint(0, 100, (rows, 1)), torch.ones((rows, 1), dtype=torch.long), cache)
    assert (forward.stats["forwards"], forward.stats["fed_tokens"], forward.stats["flush_forwards"]) == (1, rows, 0)
    assert counter.get_total_flops() == 2 * rows * rates["weights"]
    assert all(math.isfinite(rates[k]) and rates[k] > 0 for k in ("rows", "one row", "read", "gflops"))


def test_allocator_bench_runs_both_ways_and_prints_their_ratio(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """python -m bench allocator end to end on the tiny model: two fresh train.py runs (activations
    kept, then recomputed), each row with its peak resident set and its updates, each run with its
    own flags, then the ratio line against the first."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(update, "ALLOCATOR_RUN", ["--sft-steps", "0", "--steps", "1", "--eval-size", "1", "--eval-split", "test"])
    monkeypatch.setattr("sys.argv", ["bench", "allocator", "--model", tiny_model_dir, "--groups-per-step", "1",
                                     "--group-size", "2", "--max-turns", "1", "--max-new-tokens", "4", "--judge", "none"])
    main()
    out = capsys.readouterr().out
    names = ["all kept", "recomputed"]
    rows = re.findall(r"^(all kept|recomputed) +([\d.]+) GiB .* (\d+)$", out, re.M)
    assert [name for name, _, _ in rows] == names, out
    assert all(float(peak) > 0.1 and updates == "1" for _, peak, updates in rows), out
    configs = [read_json(os.path.join("runs", "bench_allocator", f"variant_{i}", "config.json")) for i in range(2)]
    assert [c["grad_checkpointing"] for c in configs] == [False, True]
    for name in names[1:]:
        assert re.search(rf"{re.escape(name)} / all kept: peak [\d.]+x \| run time [\d.]+x", out), out


def test_accelerations_bench_takes_each_one_out_and_puts_it_back(tiny_model_dir, monkeypatch, capsys):
    """python -m bench accelerations end to end on the tiny model: the baseline rolls out first and
    last, each acceleration is taken out for its own row only (the core's names are the originals
    after), and taking out the prompts' prefix or the rows fed once feeds the engine more tokens."""
    import agentrl
    import forward
    import lora
    originals = [engine.common_prefix_length, engine._distinct_histories, engine.pack_left, lora.lora_merged,
                 forward.tree_logprobs]
    monkeypatch.setattr(accelerations, "STEP", dict(accelerations.STEP, tasks=2, group=2, kept=1, max_turns=2,
                                                    max_new_tokens=4))
    monkeypatch.setattr("sys.argv", ["bench", "accelerations", "--model", tiny_model_dir])
    main()
    out = capsys.readouterr().out
    rows = {name.strip(): (part, fed, float(gain)) for name, part, fed, gain in re.findall(
        r"^(.{32}) *(both|rollout|update) +(\d+|-) +\S+ +[\d.]+s +[\d.]+x +[\d.]+s +([\d.]+)x", out, re.M)}
    assert list(rows) == list(accelerations.TAKEN_OUT), out
    assert rows["all on"][2] == 1.0 and re.search(r"rollout [\d.]+ and [\d.]+ s", out), out
    fed = int(rows["all on"][1])
    assert int(rows["prompts' common prefix once"][1]) > fed and int(rows["rows that agree fed once"][1]) > fed, out
    assert all(rows[name][1] == "-" for name in rows if rows[name][0] == "update"), out
    assert [engine.common_prefix_length, engine._distinct_histories, engine.pack_left, lora.lora_merged,
            forward.tree_logprobs] == originals


def test_scale_bench_times_one_process_and_two(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """python -m bench scale end to end on the tiny model, both variants: each a fresh train.py run
    (python -m bench train-run: scripted rewards passed to train.main, in each torchrun process
    too), every step updated from the groups the scripted rewards train (--trained-groups 1: the
    first of each process's groups), each row with its times and the update's distance from the
    sampler (none when both compute in fp32), then the ratio line against the first."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["bench", "scale", "--variants", "1-process,torchrun-2",
                                     "--model", tiny_model_dir, "--steps", "2", "--max-new-tokens", "8",
                                     "--trained-groups", "1"])
    main()
    out = capsys.readouterr().out
    rows = re.findall(r"^ +([\w-]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +(\d+) +([\d.e+-]+) +([\d.]+) +\d+$",
                      out, re.M)
    assert [name for name, *_ in rows] == ["1-process", "torchrun-2"], out
    assert all(float(per_minute) > 0 and updates == "2" for _, per_minute, *_, updates, _, _ in rows), out
    assert [float(kl_old) < 1e-6 for *_, kl_old, _ in rows] == [True, True], out
    configs = [read_json(os.path.join("runs", "bench_scale", name, "config.json")) for name, *_ in rows]
    assert [(c["steps"], c["max_new_tokens"]) for c in configs] == [(2, 8), (2, 8)]     # the flags given win
    steps = [json.loads(line) for name, *_ in rows for line in open(os.path.join("runs", "bench_scale", name, "metrics.jsonl"))
             if "reward_mean" in line]
    assert [(r["trainable_groups"], r["submitted_groups"]) for r in steps] == [(1, 2)] * 2 + [(2, 2)] * 2
    assert re.search(r"torchrun-2 / 1-process: [\d.]+x steps per minute \| rollout [\d.]+x faster", out), out


def assert_a_rerun_trains_nothing(out, start, end, monkeypatch, capsys):
    """Run the same benchmark again: every run finished with the same flags, so none trains, and the
    table (out from `start` to `end`) is printed the same."""
    table = out[out.index(start):out.index(end)]
    runs = []
    monkeypatch.setattr(train, "main", lambda argv: runs.append(argv))
    main()
    out = capsys.readouterr().out
    assert runs == [] and out[out.index(start):out.index(end)] == table


def test_learn_runs_every_arm_and_pairs_two_grpo_seeds_with_each(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """python -m bench learn end to end on the tiny model with --grpo-seeds 2: one SFT start; GRPO twice
    (seeds 0 and 1), RFT and the SFT control, each from the start's adapter; a table row per arm on
    both held-out splits; each GRPO run paired with the start, and the runs' mean with the start,
    RFT and the control; the control's SFT steps are the GRPO runs' mean time over an SFT step."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["bench", "learn", "--sft-steps", "1", "--grpo-steps", "1", "--grpo-seeds", "2",
                                     "--eval-size", "2", "--pass-tasks", "1", "--pass-k", "2", "--model", tiny_model_dir,
                                     "--groups-per-step", "1", "--group-size", "2", "--max-turns", "4",
                                     "--max-new-tokens", "130", "--max-context", "1024", "--micro-batch-size", "2"])
    main()
    out = capsys.readouterr().out
    folder = os.path.join("runs", "bench_learn")
    configs = {arm: read_json(os.path.join(folder, arm, "config.json")) for arm in ("sft", "grpo", "grpo_seed1", "rft", "control")}
    start = os.path.join(folder, "sft", "final")
    assert [(c["seed"], c["update"]) for c in (configs["grpo"], configs["grpo_seed1"], configs["rft"])] == [(0, "grpo"), (1, "grpo"), (0, "rft")]
    assert all(c["adapter"] == start and c["sft_steps"] == 0 for arm, c in configs.items() if arm not in ("sft", "control"))
    assert configs["control"]["adapter"] == start and configs["control"]["steps"] == 0
    assert all(c["eval_processes"] == 2 and c["eval_dtype"] == "bf16" for c in configs.values())   # forked, bf16

    def seconds(arm, key):
        return [r["time_step"] for r in read_jsonl(os.path.join(folder, arm, "metrics.jsonl")) if key in r]
    grpo_s = (sum(seconds("grpo", "reward_mean")) + sum(seconds("grpo_seed1", "reward_mean"))) / 2
    extra = max(1, round(grpo_s / seconds("sft", "sft_step")[0]))
    assert configs["control"]["sft_steps"] == extra
    control = f"SFT +{extra} (control)"
    rows = re.findall(r"^(SFT start|GRPO 1 seed \d|RFT 1|SFT \+\d+ \(control\)) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)$", out, re.M)
    assert [name for name, *_ in rows] == ["SFT start", "GRPO 1 seed 0", "GRPO 1 seed 1", "RFT 1", control], out
    for split in ("test", "test_schema"):
        for pair in ("GRPO 1 seed 0 - SFT start", "GRPO 1 seed 1 - SFT start", "RFT 1 - SFT start", f"{control} - SFT start"):
            assert re.search(rf"^  {split} +{re.escape(pair)}: [\d.]+ -> [\d.]+ on 2 tasks", out, re.M), (pair, out)
        for other in ("SFT start", "RFT 1", control):
            assert re.search(rf"^  {split} +GRPO 1 \(its 2 runs\) - {re.escape(other)}: mean of 2 runs: .* on 2 tasks: .*"
                             r"\| the runs: [+-][\d.]+, [+-][\d.]+ \(spread [\d.]+\)$", out, re.M), (other, out)
    assert "GRPO 1 seed 0 signal:" in out and "GRPO 1 seed 1 signal:" in out
    assert re.search(r"headroom of the start on 1 tasks of each split at temperature 1: test pass@1 [\d.]+, pass@2 [\d.]+ \| "
                     r"test_schema pass@1 [\d.]+, pass@2 [\d.]+$", out, re.M)
    assert os.path.isfile(os.path.join(folder, "learn.png"))
    assert_a_rerun_trains_nothing(out, "learn:", "curves:", monkeypatch, capsys)

    # --grpo-seeds 1: the first seed's run alone, reused, and paired with every other arm itself; the
    # control is matched to that run's time (trained again only if that changes its steps)
    trained = []
    monkeypatch.setattr(train, "main", lambda argv: trained.append(argv))
    monkeypatch.setattr("sys.argv", sys.argv + ["--grpo-seeds", "1"])
    main()
    out = capsys.readouterr().out
    assert all(argv[argv.index("--out") + 1] == os.path.join(folder, "control") for argv in trained), trained
    control = f"SFT +{max(1, round(sum(seconds('grpo', 'reward_mean')) / seconds('sft', 'sft_step')[0]))} (control)"
    rows = re.findall(r"^(SFT start|GRPO 1|RFT 1|SFT \+\d+ \(control\)) +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M)
    assert rows == ["SFT start", "GRPO 1", "RFT 1", control], out
    for split in ("test", "test_schema"):
        for other in ("SFT start", "RFT 1", control):
            assert re.search(rf"^  {split} +GRPO 1 - {re.escape(other)}: [\d.]+ -> [\d.]+ on 2 tasks", out, re.M), (other, out)
    assert "its 2 runs" not in out and "mean of its runs" not in out and "GRPO 1 signal:" in out


def test_credit_runs_four_arms_per_seed_from_one_start_and_pairs_them(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """python -m bench credit end to end on the tiny model: one SFT start; GRPO, step credit, and step credit
    on groups branched uniformly and by entropy, two seeds each, from the start's adapter with the same steps and group size; a
    row per arm with its sampled tokens per trajectory, times and anchors; each arm paired with the
    start, and the two credit arms with GRPO, on both held-out splits. Run again, nothing trains."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["bench", "credit", "--sft-steps", "1", "--grpo-steps", "1", "--grpo-seeds", "2",
                                     "--eval-size", "2", "--model", tiny_model_dir, "--groups-per-step", "1",
                                     "--group-size", "4", "--max-turns", "4", "--max-new-tokens", "40",
                                     "--max-context", "1024", "--micro-batch-size", "4"])
    main()
    out = capsys.readouterr().out
    folder = os.path.join("runs", "bench_learn")
    start = os.path.join(folder, "sft", "final")
    runs = {arm: read_json(os.path.join(folder, arm, "config.json"))
            for arm in ("grpo", "grpo_seed1", "credit", "credit_seed1", "branched", "branched_seed1", "entropy", "entropy_seed1")}
    assert [(c["seed"], c["step_credit"], c["branching"]) for c in runs.values()] == [
        (0, 0.0, "none"), (1, 0.0, "none"), (0, 1.0, "none"), (1, 1.0, "none"), (0, 1.0, "uniform"), (1, 1.0, "uniform"),
        (0, 1.0, "entropy"), (1, 1.0, "entropy")]
    assert all(c["adapter"] == start and (c["steps"], c["group_size"]) == (1, 4) for c in runs.values())
    rows = re.findall(r"^(SFT start|GRPO(?: \+ step credit)?(?:, branched|, entropy)?) +([\d.]+) +([\d.]+)(?: +([\d.]+) +(\d+) +(\d+) "
                      r"+([\d.]+) +([\d.]+) +(\d+)%)?$", out, re.M)
    assert [name for name, *_ in rows] == ["SFT start", "GRPO", "GRPO + step credit", "GRPO + step credit, branched",
                                           "GRPO + step credit, entropy"], out
    assert all(float(tokens) > 0 for _, _, _, tokens, *_ in rows[1:]), out
    for split in ("test", "test_schema"):
        for pair in ("GRPO - SFT start", "GRPO + step credit - SFT start", "GRPO + step credit - GRPO",
                     "GRPO + step credit, branched - GRPO", "GRPO + step credit, entropy - GRPO"):
            assert re.search(rf"^  {split} +{re.escape(pair)}: mean of 2 runs: .* on 2 tasks: .* by template", out, re.M), pair
    assert_a_rerun_trains_nothing(out, "credit:", "paired (each arm", monkeypatch, capsys)


def test_sweep_runs_a_start_per_rank_and_a_run_per_lr_and_picks_on_validation(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """python -m bench sweep end to end on the tiny model: one SFT start per rank, one GRPO run per lr from
    its rank's start, every run evaluated on split val only (so none trains on it); a row per run,
    paired with its start; the pick is the row of the best validation accuracy. Run again, nothing trains."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["bench", "sweep", "--sweep-ranks", "2,4", "--sweep-lrs", "1e-4,1e-2", "--sft-steps", "1",
                                     "--grpo-steps", "1", "--eval-size", "3", "--model", tiny_model_dir, "--groups-per-step", "1",
                                     "--group-size", "2", "--max-turns", "4", "--max-new-tokens", "130", "--max-context", "1024",
                                     "--micro-batch-size", "2"])
    main()
    out = capsys.readouterr().out
    folder = os.path.join("runs", "bench_sweep")
    for rank in (2, 4):
        start = read_json(os.path.join(folder, f"sft_r{rank}", "config.json"))
        assert (start["lora_r"], start["sft_steps"], start["steps"], start["eval_split"]) == (rank, 1, 0, "val")
        for lr in (1e-4, 1e-2):
            run = read_json(os.path.join(folder, f"r{rank}_lr{lr:g}", "config.json"))
            assert (run["lora_r"], run["lr"], run["steps"], run["sft_steps"]) == (rank, lr, 1, 0)
            assert run["adapter"] == os.path.join(folder, f"sft_r{rank}", "final") and run["eval_split"] == "val"
    rows = re.findall(r"^ +(\d+) +([\d.e-]+) +([\d.]+) +([\d.]+)   ([+-][\d.]+) \[", out, re.M)
    assert [(int(r), float(lr)) for r, lr, *_ in rows] == [(2, 1e-4), (2, 1e-2), (4, 1e-4), (4, 1e-2)], out
    assert all(abs(100 * (float(after) - float(start)) - float(diff)) < 0.06 for *_, start, after, diff in rows), out
    best = max(rows, key=lambda row: float(row[3]))
    assert re.search(rf"best on validation: --lora-r {best[0]} --lr {best[1]} \(accuracy {best[3]},", out), out
    assert "3 validation tasks" in out
    assert_a_rerun_trains_nothing(out, "sweep:", "| whole sweep", monkeypatch, capsys)

    # a start retrained since (here: its adapter newer than the runs' own) sends its runs back to train
    start = os.path.join(folder, "sft_r2", "final", "adapter_model.safetensors")
    os.utime(start, (time.time() + 60, time.time() + 60))
    runs = []
    monkeypatch.setattr(train, "main", lambda argv: runs.append(argv[argv.index("--out") + 1]))
    main()
    assert runs == [os.path.join(folder, "r2_lr0.0001"), os.path.join(folder, "r2_lr0.01")]
    monkeypatch.setattr("sys.argv", ["bench", "sweep", "--lr", "1e-3"])
    with pytest.raises(SystemExit, match="sets --lr itself"):
        main()


def test_a_finished_run_is_reused_unless_its_flags_differ(tmp_path, monkeypatch):
    """train_unless_finished reuses a finished run of the same flags, also one written before a
    flag existed when that flag is at its default; another value, of an old flag or a new one, trains."""
    runs = []
    monkeypatch.setattr(train, "main", lambda argv: runs.append(argv))
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "adapter_model.safetensors").write_bytes(b"")
    argv = ["--steps", "2", "--out", str(out)]
    config = json.loads(json.dumps(vars(train.parse_args(argv))))
    del config["step_credit"]                       # written before --step-credit existed
    config["judge_timeout"] = 60.0                  # a flag removed since
    (out / "config.json").write_text(json.dumps(config))
    learn.train_unless_finished(argv)
    learn.train_unless_finished(argv + ["--step-credit", "0"])
    assert runs == []
    for other in (["--step-credit", "1"], ["--steps", "3"]):
        learn.train_unless_finished(argv + other)
    assert len(runs) == 2


# ---------------------------------------------------------------- the package's place in the layout
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _local_imports(path, local):
    """The names in `local` that the file at `path` imports, anywhere in it (a function's imports too)."""
    import ast
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] + [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module
                 else [])
        found |= {name for name in names if name in local}
    return found


def test_no_core_module_imports_bench():
    """The teaching path never passes through the benchmarks: no module at the root imports bench."""
    core = sorted(f for f in os.listdir(ROOT) if f.endswith(".py"))
    bench_modules = {"bench"} | {f"bench.{f[:-3]}" for f in os.listdir(os.path.join(ROOT, "bench")) if f.endswith(".py")}
    assert len(core) >= 8
    assert {f: _local_imports(os.path.join(ROOT, f), bench_modules) for f in core} == {f: set() for f in core}


def test_the_bench_modules_import_each_other_without_a_cycle():
    """bench's own imports form no cycle (and with the core none can form: the core never imports
    bench), so each module imports alone, whichever command starts first."""
    folder = os.path.join(ROOT, "bench")
    modules = {f"bench.{f[:-3]}": os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py")}
    graph = {name: _local_imports(path, modules) - {name} for name, path in modules.items()}
    assert "bench.common" in graph and graph["bench.common"] == set()
    done = set()
    while len(done) < len(graph):      # peel off the modules whose imports are all done: a cycle never peels
        ready = {name for name, imports in graph.items() if name not in done and imports <= done}
        assert ready, f"an import cycle among {sorted(set(graph) - done)}"
        done |= ready


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_footprint_reads_a_training_run_and_an_eval_only_one(tmp_path):
    """bench footprint runs `python train.py` in a checkout and reads its phases from metrics.jsonl;
    an --eval-only run writes eval_only.json instead, and is read as a run with no phase (a stand-in
    train.py here writes what each would)."""
    from bench.footprint import footprint
    (tmp_path / "train.py").write_text(
        "import json, os, sys, time\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "os.makedirs(out)\n"
        "name = 'eval_only.json' if '--eval-only' in sys.argv else 'metrics.jsonl'\n"
        "records = [{'sft_step': 1, 'time_step': 2.0}, {'eval_accuracy': 0.5},\n"
        "           {'reward_mean': 0.1, 'time_step': 3.0, 'time_rollout': 1.0}]\n"
        "with open(os.path.join(out, name), 'w') as f:\n"
        "    f.write(json.dumps(records[1]) if name == 'eval_only.json'\n"
        "            else ''.join(json.dumps(r) + '\\n' for r in records))\n"
        "time.sleep(0.5)\n")
    run = footprint(str(tmp_path), [])
    assert (run["sft_step_s"], run["grpo_step_s"], run["rollout_s"]) == (2.0, 3.0, 1.0) and run["peak_pss_gib"] > 0
    only = footprint(str(tmp_path), ["--eval-only"])
    assert only["evaluations"] == 0 and only["peak_pss_gib"] > 0 and only["run_s"] >= 0.5
    assert all(only[key] != only[key] for key in ("sft_step_s", "grpo_step_s", "rollout_s"))     # nan
