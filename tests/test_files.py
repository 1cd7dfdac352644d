"""Tests for files.py: a write that fails leaves the old file whole and no temp file behind."""
import os

import pytest

import files


def test_atomic_path_replaces_on_success_and_keeps_the_old_file_on_failure(tmp_path):
    """A reader sees the old content or the new, never a half-written file; no temp file lingers."""
    path = tmp_path / "sub" / "metrics.jsonl"
    files.write_text_atomic(path, "old\n")
    with pytest.raises(RuntimeError):
        with files.atomic_path(path) as tmp:
            open(tmp, "w").write("half")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old\n" and os.listdir(path.parent) == ["metrics.jsonl"]
    files.write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n" and os.listdir(path.parent) == ["metrics.jsonl"]


def test_atomic_folder_appears_whole_and_replaces_an_older_one(tmp_path):
    """A checkpoint folder is either the complete new one or the previous one."""
    folder = tmp_path / "step_0001"
    with files.atomic_folder(folder) as tmp:
        (tmp_path / tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with files.atomic_folder(folder) as tmp:
            (tmp_path / tmp / "b").write_text("2")
            raise RuntimeError("killed mid-write")
    assert sorted(os.listdir(folder)) == ["a"] and os.listdir(tmp_path) == ["step_0001"]
    with files.atomic_folder(folder) as tmp:
        (tmp_path / tmp / "b").write_text("2")
    assert sorted(os.listdir(folder)) == ["b"] and os.listdir(tmp_path) == ["step_0001"]


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "c"))
    assert files.cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()


def test_read_jsonl_raises_on_a_bad_line_unless_asked_to_skip_and_count(tmp_path):
    """metrics.jsonl is read strictly (a bad line is an error); the report reads a file a kill may
    have cut short: it skips lines that are not JSON objects and counts them, blank lines aside."""
    import json
    path = tmp_path / "step_0001.jsonl"
    path.write_text('{"a": 1}\n\n[1]\n{"b": 2}\n{"step": 2, "gro')
    assert files.read_jsonl(path, skip_unreadable=True) == ([{"a": 1}, {"b": 2}], 2)
    with pytest.raises(json.JSONDecodeError):
        files.read_jsonl(path)
    path.write_text('{"a": 1}\n[1]\n')
    assert files.read_jsonl(path) == [{"a": 1}, [1]]
