"""TensorSerializer to S3: a streamed multipart upload, visible only after close, aborted on error.

Parts are 5 MiB (``StorageOptions.s3_part_size``) so the ~9 MiB checkpoint takes the
multipart path (an 8 MiB first part kept for the header patch, then parts 2..N).
"""

from __future__ import annotations

import pytest
import torch
from integ_helpers import STATE, assert_same, s3_options

from tensorstream import StorageOptions, TensorDeserializer, TensorSerializer
from tensorstream.errors import AccessDeniedError, ConfigError

pytestmark = pytest.mark.integration

MIB = 1 << 20
#: Beyond the 8 MiB first part plus one 5 MiB part: the upload is under way before close.
BIG = {**STATE, "extra": torch.arange(2 * MIB, dtype=torch.int32)}


def _keys(server, bucket: str) -> list[str]:
    return [o["Key"] for o in server.client().list_objects_v2(Bucket=bucket).get("Contents", [])]


def _uploads(server, bucket: str) -> list[dict]:
    return server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def test_write_to_s3_appears_only_on_close(s3_server, s3_bucket, tmp_path) -> None:
    uri = f"s3://{s3_bucket}/out/model.tensors"
    ser = TensorSerializer(uri, storage=s3_options(s3_server, s3_part_size=5 * MIB))
    ser.write_state_dict(BIG)
    assert _keys(s3_server, s3_bucket) == []  # parts uploaded, object not yet visible
    assert len(_uploads(s3_server, s3_bucket)) == 1
    ser.close()
    assert _keys(s3_server, s3_bucket) == ["out/model.tensors"]
    assert _uploads(s3_server, s3_bucket) == []
    body = s3_server.client().get_object(Bucket=s3_bucket, Key="out/model.tensors")["Body"].read()
    local = tmp_path / "model.tensors"
    with TensorSerializer(local) as ser:
        ser.write_state_dict(BIG)
    assert body == local.read_bytes()  # same bytes as the local writer
    with TensorDeserializer(uri, "cpu", num_readers=4, storage=s3_options(s3_server)) as d:
        assert_same(d, BIG)


def test_exception_inside_with_aborts_the_upload(s3_server, s3_bucket) -> None:
    uri = f"s3://{s3_bucket}/out/broken.tensors"
    with pytest.raises(RuntimeError, match="boom"):
        with TensorSerializer(uri, storage=s3_options(s3_server, s3_part_size=5 * MIB)) as ser:
            ser.write_state_dict(BIG)
            assert len(_uploads(s3_server, s3_bucket)) == 1  # a multipart upload was under way
            raise RuntimeError("boom")
    assert _keys(s3_server, s3_bucket) == []
    assert _uploads(s3_server, s3_bucket) == []


def test_small_write_with_env_credentials(s3_env, s3_bucket) -> None:
    uri = f"s3://{s3_bucket}/small.tensors"
    small = {k: STATE[k] for k in ("mask", "scale", "positions")}
    with TensorSerializer(uri) as ser:  # single PutObject, credentials from S3_* variables
        ser.write_state_dict(small)
    with TensorDeserializer(uri, "cpu") as d:
        assert_same(d, small)


def test_write_with_wrong_secret_is_access_denied(s3_server, s3_bucket) -> None:
    bad = StorageOptions(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key="wrong",
        s3_region=s3_server.region,
    )
    with pytest.raises(AccessDeniedError):
        with TensorSerializer(f"s3://{s3_bucket}/denied.tensors", storage=bad) as ser:
            ser.write_state_dict({"mask": STATE["mask"]})
    assert _keys(s3_server, s3_bucket) == []


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_writing_to_http_is_refused(scheme) -> None:
    with pytest.raises(ConfigError, match="cannot write to http"):
        TensorSerializer(f"{scheme}://127.0.0.1:9/model.tensors")


def test_part_size_below_s3_minimum_is_refused(s3_server, s3_bucket) -> None:
    with pytest.raises(ConfigError, match="part_size"):
        TensorSerializer(
            f"s3://{s3_bucket}/x.tensors", storage=s3_options(s3_server, s3_part_size=MIB)
        )
