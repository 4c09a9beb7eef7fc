"""The built-in corpus is built once per machine into the cache (~/.cache/titanlike or $TITANLIKE_CACHE),
keyed by the Python that wrote it and the builder's version, once even when runs ask at the same time."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from titanlike import cache
from titanlike.data import corpus as data
from titanlike.data.corpus import build_default_corpus
from titanlike.data.loader import resolve_paths
from titanlike.data.shards import DataError, Shard, write_shard


def test_cache_folder_is_home_or_the_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("TITANLIKE_CACHE", str(tmp_path / "elsewhere"))
    assert cache.cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("TITANLIKE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "titanlike"


def test_the_embedded_corpus_comes_from_the_cache_not_the_run_folder(tmp_path, monkeypatch, corpus):
    monkeypatch.setenv("TITANLIKE_CACHE", str(Path(corpus[0]).parent))
    assert resolve_paths("", "") == corpus  # the test run's cache (conftest), built once
    v = sys.version_info
    assert Path(corpus[0]).name == f"stdlib-{sys.implementation.name}{v.major}.{v.minor}.{v.micro}-v1-train.bin"
    assert Shard(corpus[0]).count > 1_000_000 and Shard(corpus[1]).count > 10_000
    assert resolve_paths("mine.bin", "val.bin") == ("mine.bin", "val.bin")


def fake_builder(calls: list):
    def build(train: Path, val: Path) -> None:
        calls.append(train.name)
        time.sleep(0.3)  # long enough for every other thread to be waiting on the lock meanwhile
        write_shard(train, np.arange(100, dtype=np.uint16))
        write_shard(val, np.arange(10, dtype=np.uint16))
    return build


def test_parallel_requests_build_once(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(data, "_write_stdlib_shards", fake_builder(calls))
    results = []
    threads = [threading.Thread(target=lambda: results.append(build_default_corpus(tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 4 and len(set(results)) == 1
    assert Shard(results[0][0]).count == 100
    build_default_corpus(tmp_path)  # and later runs reuse it
    assert len(calls) == 1


def test_a_new_builder_version_builds_anew(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(data, "_write_stdlib_shards", fake_builder(calls))
    first = build_default_corpus(tmp_path)
    monkeypatch.setattr(data, "CORPUS_VERSION", data.CORPUS_VERSION + 1)
    second = build_default_corpus(tmp_path)
    assert len(calls) == 2 and first != second and all(Path(p).exists() for p in first + second)


def test_an_unwritable_cache_is_one_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TITANLIKE_CACHE", str(blocker / "cache"))
    with pytest.raises(DataError, match=r"cannot write the built-in corpus to .*a_file/cache .*point "
                                        r"TITANLIKE_CACHE at a writable folder, or give --data.path"):
        resolve_paths("", "")
