"""parallel.py and train.py under data parallelism: two CPU processes joined by gloo, launched
the way torchrun launches them (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment).

Each process runs in a working folder of its own with a relative --out, as on two machines
without a shared disk: whatever rank 1 writes would land in its folder, which must stay empty,
and on --resume rank 1 can only get the checkpoint from rank 0. A small launcher script (written
below) runs train.main in each process with a scripted judge (random tiny models answer nothing
right, so correctness alone would give no gradient), its scorer passed in as train.main's `score`,
and a collective timeout of 60 s, and records, for the test to check, each
step's groups and rewards, the loss configuration and the final LoRA weights.
"""
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import grpo
import lora
import parallel
from files import read_jsonl

REPO = Path(__file__).resolve().parents[1]

LAUNCHER = '''
import json, os, pickle, re, sys
sys.path.insert(0, sys.argv[1])
import torch
import grpo, lora, parallel, train

rank, record = int(os.environ["RANK"]), os.environ["RECORD_DIR"]
launch = os.environ["LAUNCH"]


class ScriptedJudge:
    """Scores trajectory k of a group as k / n: every group is trainable."""
    cache_id = "scripted"

    def complete(self, messages):
        ids = [int(i) for i in re.search(r"Trajectory ids: ([\\d, ]+)", messages[1]["content"]).group(1).split(",")]
        return json.dumps({"scores": [{"trajectory_id": i, "explanation": "", "score": i / len(ids)} for i in ids]})


real_step, real_apply, models, steps = grpo.grpo_step, lora.apply_lora, [], []


def score_groups(groups, *args, **kwargs):
    if os.environ.get("FAIL_RANK") == str(rank):
        raise RuntimeError(f"injected failure in rank {rank}")
    rewards, results, failed = train.score_groups(groups, *args, **kwargs)
    steps.append((groups, rewards))
    return rewards, results, failed


def grpo_step(model, optimizer, batch, config, *args, **kwargs):
    with open(os.path.join(record, "config.pkl"), "wb") as f:
        pickle.dump(config, f)
    return real_step(model, optimizer, batch, config, *args, **kwargs)


def apply_lora(model, *args, **kwargs):
    models.append(model)
    return real_apply(model, *args, **kwargs)


train.make_judge = lambda *args: ScriptedJudge()
grpo.grpo_step, lora.apply_lora = grpo_step, apply_lora
parallel.DIST_TIMEOUT_S = 60
train.main(sys.argv[2:], score=score_groups)
with open(os.path.join(record, f"{launch}_rank{rank}.pkl"), "wb") as f:
    pickle.dump({"steps": steps, "lora": [p.detach().clone() for p in lora.lora_parameters(models[0])]}, f)
'''


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, name, argv, fail_rank=None, timeout=600):
    """Run train.py on 2 processes, each in tmp_path/rank{R}; returns [(returncode, stderr)] per rank.
    A launch that outlives `timeout` (generous: about 15 s of CPU each, on a machine that may be
    shared) is killed and fails the test, so nothing hangs."""
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    (tmp_path / "record").mkdir(exist_ok=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", RECORD_DIR=str(tmp_path / "record"), LAUNCH=name, FAIL_RANK=str(fail_rank))
    processes = []
    t0 = time.time()
    for rank in range(2):
        folder = tmp_path / f"rank{rank}"
        folder.mkdir(exist_ok=True)
        processes.append(subprocess.Popen([sys.executable, str(script), str(REPO), *argv], cwd=folder,
                                          env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in processes:
            _, err = p.communicate(timeout=max(1, timeout - (time.time() - t0)))
            results.append((p.returncode, err))
    except subprocess.TimeoutExpired:
        for p in processes:
            p.kill()
        pytest.fail(f"launch {name}: the processes did not end within {timeout} s")
    return results


def tiny_args(model_dir, *extra):
    """3 groups a step over 2 processes: rank 0 rolls out 1, rank 1 rolls out 2. Temperature 1.0: the
    rollouts the tolerance below was measured on."""
    return ["--model", model_dir, "--out", "run", "--groups-per-step", "3", "--group-size", "3", "--max-turns", "2",
            "--max-new-tokens", "12", "--max-context", "1024", "--eval-size", "3", "--micro-batch-size", "2",
            "--lr", "1e-2", "--seed", "3", "--sft-steps", "0", "--eval-split", "test", "--temperature", "1.0", *extra]


def test_two_processes_train_resume_and_equal_one_process(tiny_model_dir, splits, tmp_path):
    """Two processes run step 1, stop, and resume for step 2. Both must end with bit-identical LoRA
    weights; step 2 must equal one process's update over both processes' groups from the step-1
    checkpoint (the summed gradients and the whole-step normalizer are the one-process ones); the
    metrics must count every process's groups and held-out tasks; and rank 1 must write nothing."""
    for name, extra in [("first", ["--steps", "1"]), ("resumed", ["--steps", "2", "--resume"])]:
        results = launch(tmp_path, name, tiny_args(tiny_model_dir, *extra))
        assert [code for code, _ in results] == [0, 0], "\n".join(err[-3000:] for _, err in results)
    assert list((tmp_path / "rank1").iterdir()) == [], "only rank 0 writes"
    out = tmp_path / "rank0" / "run"
    records = read_jsonl(out / "metrics.jsonl")
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["submitted_groups"] == 3 and not r["skipped"] for r in steps)
    assert all(r["trainable_groups"] == 3 and r["sequences"] == 9 for r in steps), steps
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and all(r["eval_tasks"] == 3 for r in evals), "3 tasks: 1 + 2"
    logged = [json.loads(line) for line in open(out / "trajectories" / "step_0002.jsonl")]
    assert len(logged) == 9

    record = {rank: pickle.load(open(tmp_path / "record" / f"resumed_rank{rank}.pkl", "rb")) for rank in range(2)}
    for a, b in zip(record[0]["lora"], record[1]["lora"], strict=True):
        assert torch.equal(a, b), "the two processes' adapters differ"
    (groups0, rewards0), = record[0]["steps"]
    (groups1, rewards1), = record[1]["steps"]
    assert len(groups0) == 1 and len(groups1) == 2, "a contiguous share each"
    assert groups0[0].trajectories[0].token_ids != groups1[0].trajectories[0].token_ids

    # one process, the step-1 checkpoint, both processes' groups of step 2, one update
    model, _ = lora.load_model(tiny_model_dir)
    lora.load_adapter(model, out / "checkpoints" / "step_0001")
    before = [p.detach().clone() for p in lora.lora_parameters(model)]
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-2, weight_decay=0.0)
    optimizer.load_state_dict(torch.load(out / "checkpoints" / "step_0001" / "trainer_state.pt",
                                         weights_only=False)["optimizer"])
    config = pickle.load(open(tmp_path / "record" / "config.pkl", "rb"))   # the one train.py passed
    batch, _ = grpo.make_batch(groups0 + groups1, rewards0 + rewards1)
    # trajectories/ logs every process's trajectories with the advantages they were trained on, a turn each
    trained = [[a[start] for start, _ in t.turns] for g, advantages in zip(batch.groups, batch.advantages)
               for t, a in zip(g.trajectories, advantages)]
    assert all(trained) and [len(t["advantage"]) for t in logged] == [len(a) for a in trained]
    assert [a for t in logged for a in t["advantage"]] == pytest.approx([a for turns in trained for a in turns])
    stats = grpo.grpo_step(model, optimizer, batch, config, torch.amp.GradScaler("cpu", enabled=False))
    assert not stats["skipped"] and stats["loss"] == pytest.approx(steps[1]["loss"], abs=1e-6)
    for ours, theirs in zip(lora.lora_parameters(model), record[0]["lora"], strict=True):
        # the same update up to rounding: each process forwards the prompt its own groups share once
        # and then their runs of shared tokens (each group's tree), so its sums split
        # elsewhere and run in another order (6e-8 apart with neither), and AdamW magnifies rounding
        # where a gradient is near 0: measured 1.1e-4 in one element of 1,024; the move is > 1e-3
        torch.testing.assert_close(ours.detach(), theirs, rtol=0, atol=2e-4)
    moved = max((a - b).abs().max().item() for a, b in zip(record[0]["lora"], before))
    assert moved > 1e-3, "step 2 must move the adapter, or the comparison shows nothing"


def test_a_failing_process_ends_the_job(tiny_model_dir, splits, tmp_path):
    """A process that raises must not leave the other waiting forever: rank 1 fails in its first
    step; rank 0 must stop on its own (no launcher kills it here, unlike torchrun) with a message
    that names the cause, its last checkpoint intact."""
    (code0, err0), (code1, err1) = launch(tmp_path, "failing", tiny_args(tiny_model_dir, "--steps", "2"), fail_rank=1)
    assert code1 != 0 and "injected failure in rank 1" in err1
    assert code0 != 0 and "rank 0 of 2: a collective failed" in err0 and "--resume" in err0, err0[-3000:]
    assert (tmp_path / "rank0" / "run" / "checkpoints" / "latest").read_text() == "step_0000"


# ----------------------------------------------------------------------------- in one process
def test_shards_are_contiguous_and_cover_everything(monkeypatch):
    """Every item goes to exactly one process, in order, shares differing by at most one."""
    items = list(range(7))
    shares = []
    for r in range(3):
        monkeypatch.setattr(parallel, "rank", lambda r=r: r)
        monkeypatch.setattr(parallel, "world_size", lambda: 3)
        shares.append(parallel.shard(items))
    assert sum(shares, []) == items and sorted(map(len, shares)) == [2, 2, 3]


def test_one_process_is_left_alone():
    """Without torchrun nothing joins, shards are everything, and share_state leaves the model."""
    assert parallel.start() is None and parallel.world_size() == 1 and parallel.is_main()
    assert parallel.shard([1, 2]) == [1, 2] and parallel.gather("x") == ["x"]
    step = object()
    assert parallel.gather_step(step) is step
    assert parallel.DIST_TIMEOUT_S == 1800


def test_merged_stats_by_hand():
    """Two processes' update stats: losses and counts add up, clip fractions are means over the
    forwarded tokens (10 and 30 tokens: 0.1 and 0.5 give 0.4), the entropy over trained tokens."""
    a = {"loss": 0.25, "sequences": 2, "tokens": 20, "forwarded_sequences": 1, "forwarded_tokens": 10,
         "clip_frac_low": 0.1, "clip_frac_high": 0.0, "ratio_mean": 1.0, "kl": None, "entropy": 1.0,
         "grad_norm": 3.0, "skipped": False, "skip_reason": ""}
    b = dict(a, loss=-0.5, sequences=3, tokens=60, forwarded_sequences=3, forwarded_tokens=30, clip_frac_low=0.5,
             entropy=2.0)
    merged = parallel.merge_update_stats([a, b])
    assert merged["loss"] == -0.25 and merged["sequences"] == 5 and merged["forwarded_tokens"] == 40
    assert merged["clip_frac_low"] == pytest.approx(0.4) and merged["entropy"] == pytest.approx(1.75)
    assert merged["grad_norm"] == 3.0 and merged["kl"] is None and not merged["skipped"]


def test_merged_stats_when_rank_0_forwarded_nothing():
    """A process that forwarded nothing reports None for its token means (grpo.grpo_step); the merge
    takes the others' (kl_old too), not rank 0's None."""
    a = {"loss": 0.0, "sequences": 1, "tokens": 5, "forwarded_sequences": 0, "forwarded_tokens": 0,
         "clip_frac_low": None, "clip_frac_high": None, "ratio_mean": None, "kl_old": None, "kl": None,
         "entropy": 1.0, "grad_norm": 2.0, "skipped": False, "skip_reason": ""}
    b = dict(a, forwarded_sequences=2, forwarded_tokens=8, clip_frac_low=0.25, clip_frac_high=0.0, ratio_mean=1.0,
             kl_old=1e-3)
    merged = parallel.merge_update_stats([a, b])
    assert (merged["clip_frac_low"], merged["ratio_mean"], merged["kl_old"]) == (0.25, 1.0, pytest.approx(1e-3))
    assert merged["kl"] is None


# ----------------------------------------------------------------------------- forked (--eval-processes)
def test_forked_runs_each_share_in_a_child_of_one_thread_in_order():
    results = parallel.forked(lambda share: (share, os.getpid(), torch.get_num_threads()), list(range(7)), 3)
    assert [share for share, _, _ in results] == [[0, 1], [2, 3], [4, 5, 6]]
    assert len({pid for _, pid, _ in results} | {os.getpid()}) == 4 and {t for _, _, t in results} == {1}
    assert [share for share, _, _ in parallel.forked(lambda share: (share, 0, 0), [1, 2], 4)] == [[1], [2]]   # no empty share


def test_forked_raises_what_a_child_raised_and_says_when_one_died():
    def fails_on_four(share):
        if 4 in share:
            raise ValueError("no share with a four")
        return share
    with pytest.raises(RuntimeError, match="ValueError: no share with a four"):
        parallel.forked(fails_on_four, list(range(6)), 2)
    with pytest.raises(RuntimeError, match="died without a result"):
        parallel.forked(lambda share: os._exit(3), [1, 2], 2)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="summed PSS is read from Linux's /proc")
def test_peak_memory_sums_this_process_and_its_forked_ones():
    """parallel.PeakMemory samples the summed PSS of this process and its children: two forked
    processes that each write 128 MiB of their own raise the peak by about 256 MiB (their copies of
    this process's pages, shared, count once)."""
    memory = parallel.PeakMemory(every=0.05)
    memory.start()
    time.sleep(0.3)
    before = memory.peak_gib

    def hold_128_mib(share):
        block = torch.ones(32 * 2**20)          # 128 MiB, every page written
        time.sleep(1.0)
        return float(block[-1])
    assert parallel.forked(hold_128_mib, [1, 2], 2) == [1.0, 1.0]
    added = memory.peak_gib - before
    assert 0.2 < added < 0.4, (before, memory.peak_gib)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_freed_memory_hands_a_fragmented_heap_back():
    """Blocks below glibc's mmap threshold live on the heap; freed between blocks still in use, they
    stay resident until malloc_trim hands their pages back (parallel.release_freed_memory)."""
    def resident_mib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    blocks = [bytearray(b"x" * 100_000) for _ in range(3000)]      # ~290 MB, 100 kB each: heap, not mmap
    kept = blocks[::50]                                             # 60 still used, spread over the heap
    del blocks
    freed = resident_mib()
    parallel.release_freed_memory()
    assert freed - resident_mib() > 150, (freed, resident_mib())
    assert all(len(b) == 100_000 for b in kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/pagemap, madvise")
def test_release_file_pages_drops_a_mapped_weight_and_reads_it_back(tmp_path):
    """A tensor loaded from safetensors maps its file: parallel.release_file_pages takes its pages
    out of this process (/proc/self/pagemap's present bit) and the next read has the same values;
    an anonymous tensor, and a mapped one written in place, keep theirs."""
    from safetensors.torch import load_file, save_file

    def present_pages(tensor):
        page = os.sysconf("SC_PAGE_SIZE")
        first, last = -(-tensor.data_ptr() // page), (tensor.data_ptr() + tensor.nbytes) // page
        with open("/proc/self/pagemap", "rb") as f:        # 8 bytes a page, bit 63: present
            f.seek(first * 8)
            entries = f.read((last - first) * 8)
        return sum(entries[i + 7] >> 7 for i in range(0, len(entries), 8))
    save_file({"weight": torch.randn(512, 1024), "written": torch.randn(256, 1024)}, tmp_path / "w.safetensors")
    loaded, anonymous = load_file(tmp_path / "w.safetensors"), torch.randn(256, 1024)
    weight, written = loaded["weight"], loaded["written"]
    expected = weight.clone()
    written += 1.0
    kept = written.clone()
    assert present_pages(weight) > 120                    # 2 MiB, read by clone(): resident
    released = parallel.release_file_pages([weight, written, anonymous])
    assert released >= weight.nbytes - 2 * os.sysconf("SC_PAGE_SIZE")
    assert present_pages(weight) == 0 and present_pages(anonymous) > 60
    assert torch.equal(weight, expected) and torch.equal(written, kept)
    assert present_pages(weight) > 120
