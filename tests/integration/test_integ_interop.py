"""Interop with real tensorizer 2.12.1 across the network.

Files tensorizer writes, uploaded to SeaweedFS and placed under nginx, load here from
S3 and HTTP; files tensorstream writes to S3 load in tensorizer through its own S3
client (``stream_io.open_stream`` with ``s3_endpoint`` and ``force_http=True``, which
presigns a URL and streams it with curl).
"""

from __future__ import annotations

import pytest
from integ_helpers import STATE, assert_same, s3_options, same_bits

from tensorstream import TensorDeserializer, TensorSerializer

pytestmark = [pytest.mark.integration, pytest.mark.interop]


@pytest.fixture(scope="module")
def tensorizer_file(tmp_path_factory, http_server, s3_server):
    """STATE written by tensorizer 2.12.1: (http URL, s3 URI, options)."""
    from tensorizer import TensorSerializer as OracleSerializer

    path = tmp_path_factory.mktemp("oracle") / "oracle.tensors"
    oracle = OracleSerializer(str(path))
    oracle.write_state_dict(STATE)
    oracle.close()
    (http_server.root / "interop").mkdir(exist_ok=True)
    (http_server.root / "interop/oracle.tensors").write_bytes(path.read_bytes())
    bucket = s3_server.make_bucket("interop")
    s3_server.client().upload_file(str(path), bucket, "oracle.tensors")
    return (
        http_server.url("interop/oracle.tensors"),
        f"s3://{bucket}/oracle.tensors",
        s3_options(s3_server),
    )


@pytest.mark.parametrize("num_readers", [1, 4])
def test_tensorizer_file_loads_from_http_and_s3(tensorizer_file, num_readers) -> None:
    url, uri, opts = tensorizer_file
    with TensorDeserializer(url, "cpu", num_readers=num_readers, verify_hash=True) as d:
        assert_same(d, STATE)
    with TensorDeserializer(
        uri, "cpu", num_readers=num_readers, verify_hash=True, storage=opts
    ) as d:
        assert_same(d, STATE)


def test_tensorizer_file_lazy_from_s3(tensorizer_file) -> None:
    _, uri, opts = tensorizer_file
    with TensorDeserializer(uri, "cpu", lazy_load=True, verify_hash=True, storage=opts) as d:
        assert same_bits(d["embed.weight"], STATE["embed.weight"])


@pytest.mark.parametrize("align", [1, 64])
def test_our_s3_file_loads_in_tensorizer(s3_server, s3_bucket, align) -> None:
    from tensorizer import TensorDeserializer as OracleDeserializer
    from tensorizer import stream_io

    uri = f"s3://{s3_bucket}/ours.tensors"
    with TensorSerializer(uri, storage=s3_options(s3_server), align=align) as ser:
        ser.write_state_dict(STATE)
    stream = stream_io.open_stream(
        uri,
        "rb",
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key=s3_server.secret_key,
        s3_endpoint=s3_server.endpoint,
        s3_region_name=s3_server.region,
        force_http=True,
    )
    with stream:
        oracle = OracleDeserializer(stream, device="cpu", verify_hash=True)
        loaded = {k: v for k, v in oracle.items()}
        oracle.close()
    assert_same(loaded, STATE)
