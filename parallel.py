"""Data parallelism for train.py: the same loop on K processes, launched by torchrun.

    torchrun --nproc_per_node=4 train.py --groups-per-step 16          # 4 GPUs of one machine
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 train.py ...

torchrun starts the processes and tells each its place (RANK, WORLD_SIZE, LOCAL_RANK and where
to meet); `start` joins them into one torch.distributed group: NCCL between GPUs, gloo on CPUs.
Without torchrun (or with one process) nothing here does anything, and train.py runs as always.

What is synchronized, and what is not:
- Tasks: every process draws the step's tasks with the same seed and takes its own contiguous
  share (`shard`); it rolls them out with a seed of its own, scores them with its own judge
  (or its requests go to the one HTTP endpoint), and computes its groups' advantages: a group
  lives whole on one process, and its advantages need nothing from the others.
- The update: the loss is normalized by the whole step's counts (`grpo_step`), so the losses
  of all processes add up to the loss of one process holding every group; the LoRA gradients
  are then summed in one all-reduce (`sum_gradients`), and every process takes the same
  optimizer step from the same state, so the adapters stay identical.
- Metrics: after the update the step's groups, rewards and figures are gathered (`gather_step`);
  every process updates its per-tier success rates from all of them (so the next step's draw
  agrees), and rank 0 logs them as one process would. Evaluations split the held-out tasks the
  same way and gather the outcomes.
- Files: only rank 0 writes (metrics, trajectories, checkpoints, plot, adapters, judge cache)
  and prints. On --resume rank 0 reads the checkpoint and sends it to the others (`share_state`),
  so machines need no shared disk.
- Failures: a process whose peer died or stalled gets an error from its next collective, at once
  or after DIST_TIMEOUT_S seconds, and stops with a message saying so (`CollectiveFailed`; with
  NCCL, torch's watchdog may end the process itself on a timeout); torchrun then ends the job.
  Nothing waits forever.

One more helper, apart from torchrun: `forked` runs a function on shares of a list in processes
forked from this one, one thread each (train.py --eval-processes: on a CPU, evaluations use every
core better that way; its docstring says why). What this process and its forked ones hold together
is their summed PSS (`tree_pss_kib`, `PeakMemory`): a page they share counted once.

Simplification: the supervised warm start (--sft-steps) is not split: every process runs the
same one, and share_state then hands rank 0's result to all.
"""
import contextlib
import ctypes
import dataclasses
import datetime
import io
import multiprocessing
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

import grpo
import lora

DIST_TIMEOUT_S = 1800   # seconds a process waits for the others at a collective before it stops the job


class CollectiveFailed(SystemExit):
    """Another process died or stalled: this one stops too, with a message that says so."""


def start():
    """Join the processes torchrun started; returns this process's device (None in one process:
    the default device). A GPU per process, by LOCAL_RANK, with NCCL; gloo on CPUs."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    timeout = datetime.timedelta(seconds=DIST_TIMEOUT_S)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        return device
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def stop():
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def joined():
    """`with joined() as device:` start, then the block with only rank 0's prints shown, then stop
    (the group is left as it is if the block raises: the process is ending)."""
    device = start()
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(sys.stdout if is_main() else devnull):
        yield device
    stop()


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main():
    return rank() == 0


def _collective(function, *args, **kwargs):
    """Run one torch.distributed call; a failure (a peer that died, or a timeout) becomes a clear stop."""
    try:
        return function(*args, **kwargs)
    except RuntimeError as e:     # gloo raises RuntimeError, NCCL its subclass DistBackendError
        raise CollectiveFailed(
            f"rank {rank()} of {world_size()}: a collective failed, most likely because another process "
            f"died or stalled (its own output says why); stopping. The last checkpoint is intact: "
            f"rerun with --resume.\n{e}") from e


def shard(items):
    """This process's contiguous share of `items`; in rank order the shares are `items` again."""
    return share_of(items, rank(), world_size())


def share_of(items, i, count):
    """Share i of `count` contiguous shares of `items`, their sizes differing by at most one."""
    return items[len(items) * i // count: len(items) * (i + 1) // count]


def gather(item):
    """[item of rank 0, item of rank 1, ...] on every process ([item] in one process)."""
    if world_size() == 1:
        return [item]
    gathered = [None] * world_size()
    _collective(dist.all_gather_object, gathered, item)
    return gathered


def all_reduce(tensor):
    """Sum `tensor` in place over the processes."""
    _collective(dist.all_reduce, tensor)


def sum_gradients(optimizer, numbers, all_reduce=all_reduce):
    """Replace each LoRA gradient by its sum over the processes, and sum `numbers` with them, in one
    all-reduce of one flat tensor; returns the summed numbers, so every process takes the same
    decision after it. A parameter without a gradient (a process that forwarded nothing) adds
    zeros. DistributedDataParallel would synchronize every backward, but each process runs its own
    number of micro-batches. The sum is the same everywhere: identical steps, identical weights."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads]
                     + [torch.tensor(numbers, dtype=grads[0].dtype, device=grads[0].device)])
    all_reduce(flat)                                              # (P + len(numbers),), summed in place
    for p, g in zip(params, flat[:-len(numbers)].split([g.numel() for g in grads])):
        p.grad = g.view_as(p)
    return flat[-len(numbers):].tolist()


def grpo_step(model, optimizer, batch, config, scaler, reference=None):
    """grpo.grpo_step on this process's share of the step (batch: its groups), as one process
    holding every group would take it: the loss normalized by the whole step's counts (summed
    here), the gradients summed over the processes (sum_gradients). Every process steps, with a
    share or with nothing, so the adapters stay identical; a step with no trainable row anywhere is
    skipped everywhere."""
    everyone = gather((batch.num_sequences, batch.num_tokens, batch.max_tokens))
    whole = dataclasses.replace(batch, num_sequences=sum(n for n, _, _ in everyone),   # Dr. GRPO's constant:
                                num_tokens=sum(t for _, t, _ in everyone),         # the largest
                                max_tokens=max(m for _, _, m in everyone))
    if not whole.num_sequences:
        return {"skipped": True, "skip_reason": "no trainable group"}
    return grpo.grpo_step(model, optimizer, whole, config, scaler, reference, sum_processes=sum_gradients)


def merge_update_stats(per_process):
    """One record of grpo.grpo_step's stats from every process's: counts and losses add up (the
    losses were normalized by the whole step's counts), ratios and clip fractions are means over
    forwarded tokens, the entropy estimate a mean over trained tokens; the gradient norm and the
    skip decision are the same on every process."""
    def token_mean(key, weight):
        weights = sum(s.get(weight, 0) for s in per_process)
        return sum(s[key] * s.get(weight, 0) for s in per_process if s.get(key) is not None) / max(1, weights)

    merged = dict(per_process[0])
    for key in ("loss", "sequences", "tokens", "forwarded_sequences", "forwarded_tokens"):
        if key in merged:
            merged[key] = sum(s[key] for s in per_process)
    for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "kl_old", "kl"):
        if any(s.get(key) is not None for s in per_process):    # None where a process forwarded nothing
            merged[key] = token_mean(key, "forwarded_tokens")
    if "entropy" in merged:
        merged["entropy"] = token_mean("entropy", "tokens")
    merged["skip_reason"] = next((s["skip_reason"] for s in per_process if s.get("skip_reason")), "")
    return merged


def gather_step(step):
    """A training step (train.Step) as one process holding all its groups would have seen it: every
    process's rolled-out and kept groups, with their rewards, judge results and advantages, in rank
    order (the order of the step's tasks), group counts and judge failures added up, the update's
    stats merged, and each time the slowest process's (the others wait for it at the update). In
    one process: the step as it is."""
    if world_size() == 1:
        return step
    shares = gather(step)

    def joined(name):
        return [x for share in shares for x in getattr(share, name)]

    return dataclasses.replace(
        step, pass_rates=joined("pass_rates"), groups=joined("groups"), rewards=joined("rewards"),
        results=joined("results"), advantages=joined("advantages"),
        judge_failed=sum(s.judge_failed for s in shares),
        counts={key: sum(s.counts[key] for s in shares) for key in step.counts},
        stats=merge_update_stats([s.stats for s in shares]),
        times={key: max(s.times[key] for s in shares) for key in step.times})


def forked(function, items, processes):
    """[function(share) for each of `processes` contiguous shares of `items`] (fewer when there are
    fewer items), each share run in its own process forked from this one, all at once, with one
    thread each: on a CPU, a local way to use every core (train.py --eval-processes), apart from
    torchrun's.

    Why it pays: a decode forward's matmuls (a few dozen rows against each weight) gain little from
    a second thread, and Python's share of a step runs on one core while the other waits; two
    processes of one thread keep both cores busy. Why fork: a child starts with the model already
    loaded, its pages shared with this process (evaluate.evaluate merges the LoRA before forking,
    so the merged weights are shared too). Why one thread: GNU OpenMP in a forked child hangs at
    its first parallel region once the parent has used one, so a child must never start a team.
    A child that raises sends its traceback, and the parent raises it; a child that dies (killed
    for memory) is an error that says so; if the parent is interrupted, its children are stopped."""
    context = multiprocessing.get_context("fork")
    processes = max(1, min(processes, len(items)))
    release_freed_memory()    # what this process freed goes back to the system, not into every child's count
    children, results, failure = [], [], None
    try:
        for i in range(processes):
            receive, send = context.Pipe(duplex=False)
            child = context.Process(target=_run_forked, args=(function, share_of(items, i, processes), send),
                                    daemon=True)
            child.start()
            send.close()                      # the child holds the only writing end: EOF if it dies
            children.append((child, receive))
        for child, receive in children:
            try:
                ok, value = receive.recv()
            except (EOFError, OSError):
                ok, value = False, "it died without a result (killed: out of memory?)"
            child.join()
            if not ok:
                failure = failure or (f"a forked process (pid {child.pid}, exit code {child.exitcode}) "
                                      f"failed: {value}")
            results.append(value)
    finally:
        for child, receive in children:
            receive.close()
            if child.is_alive():
                child.terminate()
                child.join()
    if failure:
        raise RuntimeError(failure)
    return results


def _run_forked(function, share, send):
    torch.set_num_threads(1)
    try:
        send.send((True, function(share)))
    except BaseException:
        send.send((False, traceback.format_exc()))
    finally:
        send.close()


def release_freed_memory():
    """Hand the heap memory this process freed back to the system (glibc's malloc_trim; elsewhere
    nothing). glibc keeps freed blocks for reuse: after a training step that is most of a GiB this
    process holds, and counts, while its forked evaluators run."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):    # not glibc
        pass


MADV_PAGEOUT = 21       # madvise: reclaim these pages now (Linux >= 5.4)


def release_file_pages(tensors) -> int:
    """Hand back the pages of CPU `tensors` that map a file (weights loaded from safetensors are
    mapped, not copied): they leave this process's resident set, and the next read brings them back
    from the file (madvise MADV_PAGEOUT: a page written in place is kept, or swapped, never lost).
    Anonymous memory is left alone: paging it out would mean swap. Returns the bytes released; 0
    off Linux."""
    try:
        with open("/proc/self/maps") as f:         # address range, perms, offset, device, inode, path
            files = [tuple(int(x, 16) for x in fields[0].split("-")) for fields in map(str.split, f)
                     if len(fields) >= 6 and fields[4] != "0"]
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page, released = os.sysconf("SC_PAGE_SIZE"), 0
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        begin, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        for start, stop in files:
            # the whole pages inside both the tensor and the file's mapping: no other tensor's bytes
            first, last = -(-max(begin, start) // page) * page, min(end, stop) // page * page
            if last > first and madvise(first, last - first, MADV_PAGEOUT) == 0:
                released += last - first
    return released


def tree_pss_kib(root_pid=None) -> int:
    """The summed PSS (proportional set size: a page shared by k processes counts 1/k in each) of
    `root_pid` (default: this process) and every process below it, in KiB; 0 without Linux's /proc."""
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(pid))
    total, todo = 0, [root_pid or os.getpid()]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            continue
    return total


class PeakMemory(threading.Thread):
    """The largest summed PSS of this process and its children (the forked evaluators, the SQL
    worker) seen since `start()`, sampled every `every` seconds by a daemon thread: `peak_gib`.
    A sample costs the kernel a walk of every page table (~0.1 s for a few GiB): a run's peaks
    last minutes (an evaluation's end, an update), so a few seconds apart costs little and misses little."""

    def __init__(self, every=5.0):
        super().__init__(daemon=True)
        self.every, self.peak_kib = every, 0

    def run(self):
        while True:
            self.peak_kib = max(self.peak_kib, tree_pss_kib())
            time.sleep(self.every)

    @property
    def peak_gib(self) -> float:
        return self.peak_kib / 2**20


def share_state(model, optimizer, scaler, extra=None):
    """Make every process hold rank 0's LoRA weights, optimizer and loss-scaler state and torch RNG
    state; returns rank 0's `extra` (the resumed step, ...). Sent as one torch.save'd blob, read
    onto the CPU and loaded onto each process's own device."""
    if world_size() == 1:
        return extra
    blob = None
    if is_main():
        buffer = io.BytesIO()
        torch.save({"lora": [p.detach().cpu() for p in lora.lora_parameters(model)],
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "rng": torch.get_rng_state(), "extra": extra}, buffer)
        blob = buffer.getvalue()
    box = [blob]
    _collective(dist.broadcast_object_list, box, src=0)
    if is_main():
        return extra
    state = torch.load(io.BytesIO(box[0]), map_location="cpu", weights_only=False)
    with torch.no_grad():
        for p, value in zip(lora.lora_parameters(model), state["lora"], strict=True):
            p.copy_(value)
    optimizer.load_state_dict(state["optimizer"])   # moves the state onto the parameters' device
    if state["scaler"]:          # empty when saved by a disabled scaler (no fp16): nothing to restore
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"])
    return state["extra"]
