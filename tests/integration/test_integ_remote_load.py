"""TensorDeserializer over HTTP (nginx) and S3 (SeaweedFS): readers, lazy, verify, filter, dtype.

Both formats (tensorizer ``.tensors`` and safetensors) stream through the same path;
every load is compared bit for bit with the state dict that was written.
"""

from __future__ import annotations

import logging

import pytest
import torch
from integ_helpers import STATE, assert_same, same_bits

from tensorstream import StorageOptions, TensorDeserializer
from tensorstream.errors import (
    AccessDeniedError,
    HashMismatchError,
    RangeNotSupportedError,
    SourceNotFoundError,
)

pytestmark = pytest.mark.integration


def _uri(checkpoint, scheme: str, fmt: str) -> tuple[str, StorageOptions | None]:
    served = checkpoint.file(fmt)
    if scheme == "local":
        return str(served.local), None
    if scheme == "http":
        return served.http, None
    return served.s3, checkpoint.options


@pytest.mark.parametrize("fmt", ["tensors", "safetensors"])
@pytest.mark.parametrize("scheme", ["http", "s3"])
@pytest.mark.parametrize("num_readers", [1, 4, 8])
def test_remote_load_is_bit_identical(checkpoint, scheme, fmt, num_readers) -> None:
    uri, storage = _uri(checkpoint, scheme, fmt)
    with TensorDeserializer(uri, "cpu", num_readers=num_readers, storage=storage) as d:
        assert_same(d, STATE)
        assert d.total_bytes_read == sum(t.nbytes for t in STATE.values())


@pytest.mark.parametrize("fmt", ["tensors", "safetensors"])
@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_lazy_load_fetches_each_tensor_with_one_ranged_get(
    checkpoint, http_server, s3_server, fault_proxy, scheme, fmt
) -> None:
    served = checkpoint.file(fmt)
    if scheme == "http":
        proxy = fault_proxy(http_server.base_url)
        uri, storage = f"{proxy.url}/{served.relpath}", None
    else:
        proxy = fault_proxy(s3_server.endpoint)
        uri = served.s3
        storage = StorageOptions(
            s3_endpoint=proxy.url,
            s3_access_key_id=s3_server.access_key,
            s3_secret_access_key=s3_server.secret_key,
            s3_region=s3_server.region,
        )
    with TensorDeserializer(uri, "cpu", lazy_load=True, num_readers=8, storage=storage) as d:
        proxy.reset_stats()
        for name in ("layer.0.mlp.weight", "embed.weight", "mask"):
            before = proxy.stats.requests
            assert same_bits(d[name], STATE[name])
            assert proxy.stats.requests == before + 1, name
        d["mask"]  # already loaded: no request
        assert proxy.stats.requests == 3
        assert_same(d, STATE)
        assert proxy.stats.requests == len(STATE)


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_verify_hash_filter_and_dtype(checkpoint, scheme) -> None:
    uri, storage = _uri(checkpoint, scheme, "tensors")
    keep = {"embed.weight", "layer.0.attn.weight", "positions"}
    with TensorDeserializer(
        uri,
        "cpu",
        num_readers=4,
        verify_hash=True,
        filter_func=keep.__contains__,
        dtype=torch.float16,
        storage=storage,
    ) as d:
        assert sorted(d) == sorted(keep)
        assert d["embed.weight"].dtype == torch.float16
        assert torch.equal(d["embed.weight"], STATE["embed.weight"].to(torch.float16))
        assert torch.equal(d["layer.0.attn.weight"], STATE["layer.0.attn.weight"].half())
        assert same_bits(d["positions"], STATE["positions"])  # integers keep their dtype
        assert d.total_bytes_read == sum(STATE[k].nbytes for k in keep)


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_safetensors_filter_dtype_lazy(checkpoint, scheme) -> None:
    uri, storage = _uri(checkpoint, scheme, "safetensors")
    keep = {"layer.0.mlp.weight", "scale", "mask"}
    with TensorDeserializer(
        uri, "cpu", lazy_load=True, filter_func=keep.__contains__, dtype=torch.float32,
        storage=storage,
    ) as d:  # fmt: skip
        assert sorted(d) == sorted(keep)
        assert torch.equal(d["layer.0.mlp.weight"], STATE["layer.0.mlp.weight"].float())
        assert torch.equal(d["scale"], STATE["scale"].float())
        assert same_bits(d["mask"], STATE["mask"])


def test_corrupted_bytes_over_http_fail_verification(checkpoint, http_server) -> None:
    data = bytearray(checkpoint.tensors.local.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor's data
    (http_server.root / "integ/corrupt.tensors").write_bytes(bytes(data))
    with pytest.raises(HashMismatchError, match="scale|mask|positions"):
        TensorDeserializer(http_server.url("integ/corrupt.tensors"), "cpu", verify_hash=True)


def test_s3_credentials_from_vllm_environment(checkpoint, s3_env) -> None:
    with TensorDeserializer(checkpoint.tensors.s3, "cpu") as d:  # no StorageOptions at all
        assert_same(d, STATE)


def test_wrong_s3_secret_is_access_denied(checkpoint, s3_server) -> None:
    bad = StorageOptions(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key="not-the-secret",
        s3_region=s3_server.region,
    )
    with pytest.raises(AccessDeniedError) as info:
        TensorDeserializer(checkpoint.tensors.s3, "cpu", storage=bad)
    assert "not-the-secret" not in str(info.value)
    assert checkpoint.tensors.s3 in str(info.value)


def test_unknown_s3_key_is_access_denied(checkpoint, s3_server) -> None:
    bad = StorageOptions(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id="nobody",
        s3_secret_access_key="nothing",
        s3_region=s3_server.region,
    )
    with pytest.raises(AccessDeniedError):
        TensorDeserializer(checkpoint.safetensors.s3, "cpu", storage=bad)


def test_http_forbidden_and_missing(checkpoint, http_server) -> None:
    with pytest.raises(AccessDeniedError, match="403"):
        TensorDeserializer(http_server.forbidden_url(checkpoint.tensors.relpath), "cpu")
    with pytest.raises(SourceNotFoundError, match="404"):
        TensorDeserializer(http_server.url("integ/no-such.tensors"), "cpu")


@pytest.mark.parametrize("fmt", ["tensors", "safetensors"])
def test_server_without_range_falls_back_to_one_reader(checkpoint, fmt, caplog) -> None:
    url = checkpoint.file(fmt).norange
    with caplog.at_level(logging.WARNING, logger="tensorstream"):
        with TensorDeserializer(url, "cpu") as d:
            assert_same(d, STATE)
    assert any("Range" in r.getMessage() for r in caplog.records)
    with pytest.raises(RangeNotSupportedError, match="num_readers=4"):
        TensorDeserializer(url, "cpu", num_readers=4)
    with TensorDeserializer(url, "cpu", num_readers=1) as d:
        assert_same(d, STATE)
