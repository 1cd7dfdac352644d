"""A run's state on disk, so that a killed run resumes with nothing lost (train.py --resume).

    checkpoint.save(run_dir, model, optimizer, scaler, step, task_stats)   # checkpoints/step_XXXX
    step, task_stats, folder = checkpoint.load(run_dir, model, optimizer, scaler)
    checkpoint.truncate_metrics(os.path.join(run_dir, "metrics.jsonl"), step)

A checkpoint folder holds the adapter in peft's layout (lora.save_adapter) and trainer_state.pt:
the step, the optimizer's and the loss scaler's state, the torch and Python RNG states, and the
task sampler's pass rates (train.sample_tasks). It is written beside its final name and renamed
into place (files.atomic_folder), then `latest` is pointed at it, so a kill at any moment leaves
the last checkpoint whole; only the newest `keep` stay. Under torchrun rank 0 alone saves and
loads, and parallel.share_state hands what it loaded to the others.
"""
import json
import math
import os
import random
import re
import shutil
from pathlib import Path

import torch

import lora
from files import atomic_folder, write_text_atomic


def save(run_dir, model, optimizer, scaler, step, task_stats, keep=2):
    """Write run_dir/checkpoints/step_XXXX whole, point checkpoints/latest at it, and remove all
    but the newest `keep` step folders. Returns the folder."""
    final = os.path.join(run_dir, "checkpoints", f"step_{step:04d}")
    with atomic_folder(final) as tmp:
        lora.save_adapter(model, tmp)
        state = {"step": step, "optimizer": optimizer.state_dict(), "task_stats": task_stats,
                 "scaler": scaler.state_dict(),
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    write_text_atomic(os.path.join(run_dir, "checkpoints", "latest"), os.path.basename(final))
    finished = sorted(int(name[5:]) for name in os.listdir(os.path.dirname(final))
                      if re.fullmatch(r"step_\d+", name))
    for old in finished[:-keep]:
        shutil.rmtree(os.path.join(run_dir, "checkpoints", f"step_{old:04d}"), ignore_errors=True)
    return final


def load(run_dir, model, optimizer, scaler):
    """Restore the adapter, optimizer, scaler and RNG states of the checkpoint `latest` names.
    Returns (step, task_stats, folder); a folder with no checkpoint is a clear error."""
    latest = os.path.join(run_dir, "checkpoints", "latest")
    if not os.path.isfile(latest):
        raise SystemExit(f"--resume: no checkpoint in {run_dir} (expected {latest}); start without --resume")
    folder = os.path.join(run_dir, "checkpoints", Path(latest).read_text().strip())
    lora.load_adapter(model, folder)
    state = torch.load(os.path.join(folder, "trainer_state.pt"), weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    if state["scaler"]:          # empty when saved by a disabled scaler (no fp16): nothing to restore
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state["step"], state["task_stats"], folder


def truncate_metrics(path, last_step):
    """On resume, drop records of steps after the checkpoint: they are about to be redone. A line
    cut short (a run killed mid-write, a full disk) cannot be read back, and goes too."""
    if not os.path.isfile(path):
        return

    def step_of(line):
        try:
            return json.loads(line).get("step", 0)
        except json.JSONDecodeError:
            return math.inf

    with open(path) as f:
        kept = [line for line in f if step_of(line) <= last_step]
    write_text_atomic(path, "".join(kept))
