"""The weight fetch ``LLM`` starts before torch's import (engine/prefetch.py).

Fetched bytes must load bit-identically to a direct load (local, S3, HTTP), keep
``verify_hash`` catching corruption, and a failing or abandoned fetch must raise our
errors and leave no thread behind.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

from tensorstream import TensorDeserializer, TensorSerializer
from tensorstream.engine import prefetch as prefetch_module
from tensorstream.engine.prefetch import ArenaSource, Prefetch
from tensorstream.errors import AccessDeniedError, HashMismatchError, SourceNotFoundError

SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _ours() -> list[str]:
    """Threads of the fetch and of LLM's background load (the deserializer's long-lived
    ``tensorstream-cpu`` pool is not theirs)."""
    names = ("tensorstream-prefetch", "tensorstream-weights")
    return [t.name for t in threading.enumerate() if t.name.startswith(names)]


@pytest.fixture
def small_spans(monkeypatch):
    """Several pieces and chunks even for a few-MB file, so the piece split is tested."""
    monkeypatch.setattr(prefetch_module, "_PIECE", 1 << 20)
    monkeypatch.setattr(prefetch_module, "_CHUNK", 256 << 10)


@pytest.fixture(scope="module")
def tensors_file(tmp_path_factory):
    """A ~6 MB ``.tensors`` file of mixed dtypes and odd sizes (not chunk multiples)."""
    gen = torch.Generator().manual_seed(7)
    state = {
        "a.weight": torch.randn(1000, 1001, generator=gen).to(torch.bfloat16),
        "b.weight": torch.randn(517, 1999, generator=gen),
        "c.ids": torch.randint(0, 1 << 40, (12345,), generator=gen),
        "d.half": torch.randn(333, generator=gen).half(),
    }
    path = tmp_path_factory.mktemp("overlap") / "model.tensors"
    with TensorSerializer(str(path)) as serializer:
        serializer.write_state_dict(state)
    return path


def _bytes_of(deserializer) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    out = {}
    for name, t in deserializer.items():
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        out[name] = (t.dtype, tuple(t.shape), flat.numpy().tobytes())
    return out


def _load(source, **kwargs):
    with TensorDeserializer(source, device="cpu", **kwargs) as d:
        return _bytes_of(d)


def _fetched(uri: str, readers: int | None = None, boost: bool = False, **kwargs):
    fetch = Prefetch(uri, readers=readers)
    if boost:  # all readers at once, before the first piece is read
        fetch.boost()
    try:
        source = fetch.take()
        assert isinstance(source, ArenaSource)  # really fetched, not the direct path
        try:
            return _load(source, **kwargs)
        finally:
            source.close()
    finally:
        fetch.close()


def test_fetched_over_s3_and_http_is_bit_identical(
    tensors_file, s3_env, s3_bucket, http_server, small_spans
):
    direct = _load(str(tensors_file))
    assert len(direct) == 4
    s3_env.client().upload_file(str(tensors_file), s3_bucket, "m/model.tensors")
    s3_uri = f"s3://{s3_bucket}/m/model.tensors"
    served = http_server.root / "overlap-identical.tensors"
    shutil.copy(tensors_file, served)
    http_url = http_server.url(served.name)
    for uri in (s3_uri, http_url):
        for readers in (1, 3):
            assert _fetched(uri, readers) == direct, (uri, readers)
        assert _fetched(uri, 4, boost=True) == direct
        assert _fetched(uri, 3, verify_hash=True) == direct
    # A server that ignores Range is read by one reader from the start.
    assert _fetched(http_server.norange_url(served.name), 4) == direct
    assert _ours() == []


def test_encrypted_object_fetched_decrypts_the_same(tensors_file, s3_env, s3_bucket, tmp_path):
    from tensorstream.crypto.params import DecryptionParams, EncryptionParams

    state = {
        name: t.clone() for name, t in TensorDeserializer(str(tensors_file), device="cpu").items()
    }
    secret = EncryptionParams.random()
    path = tmp_path / "encrypted.tensors"
    with TensorSerializer(str(path), encryption=secret) as serializer:
        serializer.write_state_dict(state)
    s3_env.client().upload_file(str(path), s3_bucket, "enc/model.tensors")
    uri = f"s3://{s3_bucket}/enc/model.tensors"
    key = DecryptionParams.from_key(secret.key)
    direct = _load(uri, encryption=key, verify_hash=True)
    assert direct == _load(str(tensors_file))  # decrypts to the plain tensors
    assert _fetched(uri, 2, encryption=key, verify_hash=True) == direct
    assert _ours() == []


def test_local_file_is_read_ahead_and_loads_directly(tensors_file):
    fetch = Prefetch(str(tensors_file))
    assert not fetch.remote
    assert fetch.take() is None  # the deserializer maps the file itself
    fetch.close()
    assert fetch.fetch_seconds is not None
    assert _ours() == []


def test_verify_hash_still_catches_corruption(tensors_file, s3_env, s3_bucket, tmp_path):
    data = bytearray(tensors_file.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor's data
    bad = tmp_path / "bad.tensors"
    bad.write_bytes(bytes(data))
    s3_env.client().upload_file(str(bad), s3_bucket, "bad/model.tensors")
    uri = f"s3://{s3_bucket}/bad/model.tensors"
    with pytest.raises(HashMismatchError):
        _load(uri, verify_hash=True)
    with pytest.raises(HashMismatchError):
        _fetched(uri, verify_hash=True)
    assert _ours() == []


def test_missing_object_raises_our_error_and_leaves_no_thread(s3_env, s3_bucket):
    fetch = Prefetch(f"s3://{s3_bucket}/nothing/model.tensors")
    with pytest.raises(SourceNotFoundError):
        fetch.take()
    fetch.close()
    assert _ours() == []


def test_forbidden_object_raises_our_error(http_server):
    fetch = Prefetch(http_server.forbidden_url("model.tensors"))
    with pytest.raises(AccessDeniedError):
        fetch.take()
    fetch.close()
    assert _ours() == []


def test_close_stops_a_fetch_in_flight(http_server):
    served = http_server.root / "overlap-slow.tensors"
    served.write_bytes(b"\0" * (96 << 20))  # 96 MiB at 16 MiB/s per reader: seconds
    fetch = Prefetch(http_server.slow_url(served.name), readers=3)
    time.sleep(0.3)
    assert _ours()  # still fetching
    started = time.perf_counter()
    fetch.close()
    assert time.perf_counter() - started < 1.5  # stopped at the next chunk, not the end
    assert fetch.take() is None and _ours() == []


def _serialized(tmp_path, model_dir, name):
    import transformers

    out = tmp_path / name
    out.mkdir()
    for file in SMALL_FILES:
        if (model_dir / file).is_file():
            shutil.copy(model_dir / file, out / file)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with TensorSerializer(str(out / "model.tensors")) as serializer:
        serializer.write_module(model)
    return out


def test_llm_from_s3_overlaps_and_matches_local(tmp_path, tiny, s3_env, s3_bucket):
    from tensorstream.engine import LLM, SamplingParams

    local = _serialized(tmp_path, tiny("llama"), "served")
    client = s3_env.client()
    for path in local.iterdir():
        client.upload_file(str(path), s3_bucket, f"m/{path.name}")
    params = SamplingParams(temperature=0, max_tokens=5)
    near = LLM(str(local), device="cpu")
    far = LLM(f"s3://{s3_bucket}/m", load_format="tensorizer", device="cpu")
    assert far.load_stats.fetch_seconds is not None  # the prefetch ran
    assert "fetch started before torch's import" in far.load_stats.describe()
    # Fetched bytes were read from storage, not mapped from a page cache: the load
    # reports them as read, with a rate over the fetch (the server's ready line shows it).
    stats = far.load_stats
    assert stats.mapped_bytes == 0 and stats.bytes_read == stats.bytes > 0
    assert stats.read_seconds >= stats.fetch_seconds and stats.gb_per_s > 0
    assert "GB/s" in stats.describe()
    assert near.load_stats.fetch_seconds is not None  # local: read-ahead only
    assert near.load_stats.mapped_bytes == near.load_stats.bytes  # and mapped as before
    near_state = dict(near.model.state_dict())
    for name, tensor in far.model.state_dict().items():
        assert torch.equal(tensor.view(torch.uint8), near_state[name].view(torch.uint8)), name
    assert (
        far.generate("hello world", params)[0].outputs[0].token_ids
        == near.generate("hello world", params)[0].outputs[0].token_ids
    )
    assert _ours() == []


def test_prefetch_can_be_turned_off(tmp_path, monkeypatch):
    from tensorstream.engine.loaders.tensorizer import start_prefetch

    started = start_prefetch({}, str(tmp_path), "cpu")
    assert started is not None
    started.close()
    assert start_prefetch({}, str(tmp_path), "cuda:0") is None  # device loads stage
    assert (
        start_prefetch({"deserialization_kwargs": {"lazy_load": True}}, str(tmp_path), "cpu")
        is None
    )
    monkeypatch.setenv("TENSORSTREAM_PREFETCH", "0")
    assert start_prefetch({}, str(tmp_path), "cpu") is None
    assert _ours() == []


def test_llm_missing_weights_on_s3_leaves_no_thread(tiny, s3_env, s3_bucket):
    from tensorstream.engine import LLM

    client = s3_env.client()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # no weights
        client.upload_file(str(tiny("llama") / name), s3_bucket, f"empty/{name}")
    with pytest.raises(SourceNotFoundError):
        LLM(f"s3://{s3_bucket}/empty", load_format="tensorizer", device="cpu")
    assert _ours() == []
