"""Round trips local <-> S3 <-> HTTP for both formats, and sharded safetensors checkpoints.

Every hop is checked bit for bit: tensors against the original state dict and, where a
file is rewritten, the file bytes against the first file.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from integ_helpers import STATE, assert_same, s3_options, same_bits

from tensorstream import ShardedDeserializer, TensorDeserializer, TensorSerializer
from tensorstream.errors import FormatError

pytestmark = pytest.mark.integration


def test_tensors_local_s3_http_local(tmp_path, checkpoint, s3_server, http_server) -> None:
    opts = s3_options(s3_server)
    original = checkpoint.tensors.local.read_bytes()
    uri = f"s3://{checkpoint.bucket}/trip/model.tensors"
    with TensorDeserializer(checkpoint.tensors.local, "cpu") as local:
        with TensorSerializer(uri, storage=opts) as ser:  # local -> S3
            ser.write_state_dict(dict(local))
    with TensorDeserializer(uri, "cpu", num_readers=4, storage=opts) as from_s3:  # S3 -> memory
        assert_same(from_s3, STATE)
    body = s3_server.client().get_object(Bucket=checkpoint.bucket, Key="trip/model.tensors")
    assert body["Body"].read() == original
    (http_server.root / "trip").mkdir(exist_ok=True)
    (http_server.root / "trip/model.tensors").write_bytes(original)
    with TensorDeserializer(http_server.url("trip/model.tensors"), "cpu", num_readers=8) as web:
        with TensorSerializer(tmp_path / "again.tensors") as ser:  # HTTP -> local
            ser.write_state_dict(dict(web))
    assert (tmp_path / "again.tensors").read_bytes() == original


def test_safetensors_local_s3_http_local(tmp_path, checkpoint) -> None:
    from safetensors.torch import save_file

    original = checkpoint.safetensors.local.read_bytes()
    with TensorDeserializer(
        checkpoint.safetensors.s3, "cpu", num_readers=4, storage=checkpoint.options
    ) as from_s3:
        assert_same(from_s3, STATE)
        save_file({k: v.data for k, v in from_s3.items()}, str(tmp_path / "s3.safetensors"))
    with TensorDeserializer(checkpoint.safetensors.http, "cpu", num_readers=4) as web:
        assert_same(web, STATE)
        save_file({k: v.data for k, v in web.items()}, str(tmp_path / "http.safetensors"))
    assert (tmp_path / "s3.safetensors").read_bytes() == original
    assert (tmp_path / "http.safetensors").read_bytes() == original


# -- sharded safetensors -------------------------------------------------------------

SHARDS = {
    "model-00001-of-00002.safetensors": ["embed.weight", "positions", "mask"],
    "model-00002-of-00002.safetensors": [
        "layer.0.attn.weight",
        "layer.0.mlp.weight",
        "layer.0.norm.weight",
        "layer.1.mlp.weight",
        "scale",
    ],
}
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, http_server, s3_server):
    """(local dir, http index URL, s3 index URI, options) of STATE in two shards."""
    from safetensors.torch import save_file

    local = tmp_path_factory.mktemp("sharded")
    weight_map = {}
    for shard, names in SHARDS.items():
        save_file({n: STATE[n] for n in names}, str(local / shard))
        weight_map.update(dict.fromkeys(names, shard))
    total = sum(t.nbytes for t in STATE.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (local / INDEX).write_text(json.dumps(index))
    shutil.copytree(local, http_server.root / "sharded")
    bucket = s3_server.make_bucket("sharded")
    client = s3_server.client()
    for path in local.iterdir():
        client.upload_file(str(path), bucket, f"ckpt/{path.name}")
    return (
        local,
        http_server.url(f"sharded/{INDEX}"),
        f"s3://{bucket}/ckpt/{INDEX}",
        s3_options(s3_server),
    )


def test_sharded_local_directory_and_index(sharded) -> None:
    local, _, _, _ = sharded
    with TensorDeserializer(local, "cpu") as d:
        assert isinstance(d, ShardedDeserializer)
        assert len(d.shards) == 2
        assert_same(d, STATE)
    with TensorDeserializer(str(local / INDEX), "cpu", num_readers=4) as d:
        assert_same(d, STATE)


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_sharded_remote_with_filter_and_dtype(sharded, scheme) -> None:
    _, http_index, s3_index, opts = sharded
    uri, storage = (http_index, None) if scheme == "http" else (s3_index, opts)
    with TensorDeserializer(uri, "cpu", num_readers=4, storage=storage) as d:
        assert_same(d, STATE)
        assert d.total_tensor_bytes == sum(t.nbytes for t in STATE.values())
    keep = {"layer.0.attn.weight", "scale"}
    with TensorDeserializer(
        uri, "cpu", filter_func=keep.__contains__, dtype=torch.float32, lazy_load=True,
        storage=storage,
    ) as d:  # fmt: skip
        assert list(d.shards) == ["model-00002-of-00002.safetensors"]  # shard 1 never opened
        assert sorted(d) == sorted(keep)
        assert torch.equal(d["layer.0.attn.weight"], STATE["layer.0.attn.weight"].float())
        assert same_bits(d["scale"], STATE["scale"].float())


def test_sharded_index_naming_a_missing_tensor(tmp_path, sharded) -> None:
    local, _, _, _ = sharded
    for path in local.iterdir():
        shutil.copy(path, tmp_path / path.name)
    index = json.loads((local / INDEX).read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(FormatError, match="ghost.weight"):
        TensorDeserializer(tmp_path, "cpu")


def test_sharded_index_outside_its_directory_is_refused(tmp_path) -> None:
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    with pytest.raises(FormatError, match="outside"):
        TensorDeserializer(tmp_path / INDEX, "cpu")
