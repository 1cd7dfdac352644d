"""Files that are never half-written, read back whole, and the folder where generated files live.

Every file the project writes (adapters, checkpoints, metrics snapshots, the embedded database,
judge answers, the converted embedded model) goes through a temporary name beside its final one
and is renamed into place: a rename within a folder is atomic, so a reader, or a run resumed
after a kill, sees the old file or the new one, never a torn one.

    with atomic_path("runs/x/config.json") as tmp:     # write anything to tmp, by any library
        Path(tmp).write_text("{}")
    with atomic_folder("runs/x/checkpoints/step_0001") as tmp:
        ...                                              # fill the folder; it appears whole

This module imports nothing of the project's, so every other module may use it.
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


def read_jsonl(path) -> list:
    """A JSON-lines file (a run's metrics.jsonl), one value a line, the file closed again."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


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
