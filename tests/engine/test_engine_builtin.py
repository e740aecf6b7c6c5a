"""The built-in model's cache: complete, atomic, converted once even under concurrency."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tensorstream.engine import builtin


def test_materialised_directory_is_a_plain_hf_checkpoint(smollm2_dir):
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert not any(name.endswith(".gguf") for name in names)
    assert builtin.find_builtin_gguf().suffix == ".gguf"
    # A second call finds the cache and returns at once.
    started = time.perf_counter()
    assert builtin.materialize_builtin() == smollm2_dir
    assert time.perf_counter() - started < 1.0


def test_crash_leaves_no_half_cache(tmp_path, monkeypatch):
    def crash(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("simulated crash mid-conversion")

    monkeypatch.setattr(builtin, "_convert_gguf", crash)
    target = tmp_path / "models" / "smol"
    with pytest.raises(RuntimeError, match="simulated crash"):
        builtin.materialize_builtin(target)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == ["smol.lock"]  # no temp dir left behind


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    calls = []

    def fake_convert(gguf, out_dir):
        calls.append(out_dir)
        time.sleep(0.3)  # long enough for the other thread to queue on the lock
        for name in builtin._REQUIRED_FILES:
            (out_dir / name).write_text("{}")

    monkeypatch.setattr(builtin, "_convert_gguf", fake_convert)
    target = tmp_path / "smol"
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(builtin.materialize_builtin(target)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [target, target] and len(calls) == 1


def test_cache_location_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TENSORSTREAM_CACHE", str(tmp_path))
    assert builtin.builtin_cache_dir() == tmp_path / "models" / "smollm2-135m-instruct"
    monkeypatch.delenv("TENSORSTREAM_CACHE")
    assert builtin.builtin_cache_dir().parts[-4:] == (
        ".cache",
        "tensorstream",
        "models",
        "smollm2-135m-instruct",
    )
