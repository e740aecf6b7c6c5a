"""Failure modes at the TensorDeserializer level, provoked by the fault proxy.

Cut connections resume to identical tensors; 503s are retried; a stall is bounded by
the timeout (then retried or given up with RetriesExhaustedError); an object replaced
while loading raises SourceChangedError. Budgets are short so each test takes seconds.
"""

from __future__ import annotations

import os
import time

import pytest
from integ_helpers import STATE, assert_same, same_bits

from tensorstream import StorageOptions, TensorDeserializer
from tensorstream.errors import RetriesExhaustedError, SourceChangedError

pytestmark = pytest.mark.integration

FAST = {"timeout": 0.5, "max_retries": 4, "retry_deadline": 10.0}


@pytest.fixture(params=["http", "s3"])
def route(request, checkpoint, http_server, s3_server, fault_proxy):
    """(proxy, uri, storage) for the .tensors checkpoint through a fault proxy."""
    if request.param == "http":
        proxy = fault_proxy(http_server.base_url)
        return proxy, f"{proxy.url}/{checkpoint.tensors.relpath}", StorageOptions(**FAST)
    proxy = fault_proxy(s3_server.endpoint)
    storage = StorageOptions(
        s3_endpoint=proxy.url,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key=s3_server.secret_key,
        s3_region=s3_server.region,
        **FAST,
    )
    return proxy, checkpoint.tensors.s3, storage


def test_cut_mid_tensor_gives_identical_tensors(route) -> None:
    proxy, uri, storage = route
    d = TensorDeserializer(uri, "cpu", lazy_load=True, storage=storage)
    proxy.set_mode("cut", after_bytes=900_000, times=4)  # one 5 MiB GET, cut four times
    proxy.reset_stats()
    assert same_bits(d["embed.weight"], STATE["embed.weight"])
    assert proxy.stats.faults == 4
    assert proxy.stats.requests == 5  # resumed from the last byte each time
    assert_same(d, STATE)
    d.close()


def test_eager_load_through_cuts(route) -> None:
    proxy, uri, storage = route
    proxy.set_mode("cut", after_bytes=1_500_000, times=3)
    with TensorDeserializer(uri, "cpu", num_readers=4, storage=storage) as d:
        assert_same(d, STATE)
    assert proxy.stats.faults == 3


def test_503s_are_retried(route) -> None:
    proxy, uri, storage = route
    proxy.set_mode("status", status=503, times=3)
    with TensorDeserializer(uri, "cpu", num_readers=4, verify_hash=True, storage=storage) as d:
        assert_same(d, STATE)
    assert proxy.stats.faults == 3


def test_stall_is_bounded_then_succeeds(route) -> None:
    proxy, uri, storage = route
    proxy.set_mode("stall", after_bytes=200_000, times=2)  # stalls until the proxy closes
    started = time.monotonic()
    with TensorDeserializer(uri, "cpu", num_readers=4, storage=storage) as d:
        assert_same(d, STATE)
    assert time.monotonic() - started < 10
    assert proxy.stats.faults == 2


def test_endless_stall_gives_up_in_bounded_time(route) -> None:
    proxy, uri, storage = route
    d = TensorDeserializer(uri, "cpu", lazy_load=True, storage=storage)
    proxy.set_mode("stall", after_bytes=100)  # every request, forever
    started = time.monotonic()
    with pytest.raises(RetriesExhaustedError) as info:
        d["embed.weight"]
    assert time.monotonic() - started < 15
    assert "embed" in str(info.value) or "s3://" in str(info.value) or "http" in str(info.value)
    d.close()


def test_http_object_replaced_mid_load(checkpoint, http_server) -> None:
    path = http_server.root / "integ/replaced.tensors"
    path.write_bytes(checkpoint.tensors.local.read_bytes())
    d = TensorDeserializer(http_server.url("integ/replaced.tensors"), "cpu", lazy_load=True)
    first = d["layer.0.norm.weight"]  # loads fine from the version seen at open
    new = path.with_suffix(".new")
    new.write_bytes(checkpoint.tensors.local.read_bytes() + b"more")
    os.replace(new, path)
    with pytest.raises(SourceChangedError, match="replaced.tensors"):
        d["embed.weight"]
    assert first.shape == STATE["layer.0.norm.weight"].shape
    d.close()


def test_s3_object_replaced_mid_load(checkpoint, s3_server) -> None:
    key = "integ/replaced.tensors"
    client = s3_server.client()
    client.upload_file(str(checkpoint.tensors.local), checkpoint.bucket, key)
    uri = f"s3://{checkpoint.bucket}/{key}"
    d = TensorDeserializer(uri, "cpu", lazy_load=True, storage=checkpoint.options)
    d["mask"]
    client.put_object(Bucket=checkpoint.bucket, Key=key, Body=b"something else entirely")
    with pytest.raises(SourceChangedError, match="replaced.tensors"):
        d["embed.weight"]
    d.close()
