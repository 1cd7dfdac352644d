"""Files that are never half-written, read back whole, and the folder where generated files live.

Every file the project writes (adapters, checkpoints, metrics snapshots, the embedded database,
judge answers, the converted embedded model) goes through a temporary name beside its final one
and is renamed into place: a rename within a folder is atomic, so a reader, or a run resumed
after a kill, sees the old file or the new one, never a torn one.

    with atomic_path("runs/x/config.json") as tmp:     # write anything to tmp, by any library
        Path(tmp).write_text("{}")
    with atomic_folder("runs/x/checkpoints/step_0001") as tmp:
        ...                                              # fill the folder; it appears whole

It also holds `common_prefix_length`, the one longest-common-prefix helper (the rollout's shared
prompt, the report's shared messages). It imports nothing of the project's, so every other
module may use it.
"""
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    """Root for generated files (embedded database, converted model): $AGENTRL_CACHE, else
    ~/.cache/agentrl; created on first use."""
    path = Path(os.environ.get("AGENTRL_CACHE") or Path.home() / ".cache" / "agentrl")
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def atomic_path(path):
    """Yield a temporary file path beside `path`; when the block ends normally, rename it onto
    `path`; when it raises, remove it. The parent folder is created if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_json(path):
    """The JSON value a file holds (a run's config.json), the file closed again."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_jsonl(path, skip_unreadable=False):
    """A JSON-lines file (a run's metrics.jsonl), one value a line, the file closed again; a line
    that is not JSON raises json.JSONDecodeError. skip_unreadable: return (the lines that are JSON
    objects, how many other non-blank lines were skipped) instead, for a reader that must not fail
    on a line a kill cut short (report.py)."""
    with open(path, encoding="utf-8") as f:
        if not skip_unreadable:
            return [json.loads(line) for line in f]
        records, unreadable = [], 0
        for line in filter(str.strip, f):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict):
                records.append(record)
            else:
                unreadable += 1
        return records, unreadable


def common_prefix_length(sequences, limit=None) -> int:
    """How many leading items every sequence shares, at most `limit`: [[1, 2, 3], [1, 2, 4]] -> 2."""
    length = min(map(len, sequences)) if limit is None else min(limit, *map(len, sequences))
    first = sequences[0]
    for other in sequences[1:]:
        length = next((i for i in range(length) if other[i] != first[i]), length)
    return length


def write_text_atomic(path, text: str):
    """`Path(path).write_text(text)`, atomically."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


@contextmanager
def atomic_folder(path):
    """Yield a temporary folder beside `path`; when the block ends normally, it replaces `path`
    (an older folder of that name is removed first); when it raises, it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        yield tmp
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
