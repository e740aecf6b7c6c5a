"""Rank files: ``serialize_sharded`` writes one file per rank plus a sidecar; a URI with a
rank field loads rank r's file, checked against the sidecar (world size, plan, presence)."""

from __future__ import annotations

import json

import pytest
import torch

import tensorstream
from tensorstream import TensorDeserializer
from tensorstream.deserialize.shard import ShardSpec
from tensorstream.errors import ConfigError, ShardMismatchError
from tensorstream.serialize.sharded import serialize_sharded

PLAN = {"*.col.weight": 0, "*.row.weight": 1}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "a.col.weight": torch.randn(6, 4, generator=g),
        "a.row.weight": torch.randn(4, 6, generator=g),
        "a.norm.weight": torch.randn(4, generator=g),
    }


def _check_rank(d, rank: int, world: int) -> None:
    state = _state()
    assert torch.equal(d["a.col.weight"], state["a.col.weight"].chunk(world, 0)[rank])
    assert torch.equal(d["a.row.weight"], state["a.row.weight"].chunk(world, 1)[rank])
    assert torch.equal(d["a.norm.weight"], state["a.norm.weight"])


@pytest.mark.parametrize("world", [2, 3])
def test_rank_files_local_round_trip(tmp_path, world):
    files = serialize_sharded(_state(), tmp_path, world_size=world, plan=PLAN)
    assert [p.rsplit("/", 1)[-1] for p in files] == [
        f"model-rank-{r:03d}.tensors" for r in range(world)
    ]
    sidecar = json.loads((tmp_path / "tensor-parallel.json").read_text())
    assert sidecar["world_size"] == world and sidecar["plan"] == [[k, v] for k, v in PLAN.items()]
    template = str(tmp_path / "model-rank-%03d.tensors")
    for rank in range(world):
        spec = ShardSpec(rank, world, PLAN)
        with TensorDeserializer(template, device="cpu", shard=spec, verify_hash=True) as d:
            _check_rank(d, rank, world)  # whole tensors in a rank file: hashes checked


def test_rank_files_on_s3(tmp_path, s3_server, s3_bucket):
    storage = tensorstream.StorageOptions(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key=s3_server.secret_key,
    )
    template = f"s3://{s3_bucket}/tp/model-rank-{{rank:03d}}.tensors"
    serialize_sharded(_state(), template, world_size=2, plan=PLAN, storage=storage)
    for rank in range(2):
        spec = ShardSpec(rank, 2)  # the plan comes from the sidecar
        with TensorDeserializer(template, device="cpu", shard=spec, storage=storage) as d:
            _check_rank(d, rank, 2)


@pytest.fixture
def rank_set(tmp_path):
    serialize_sharded(_state(), tmp_path, world_size=2, plan=PLAN)
    return tmp_path


def test_world_size_mismatch(rank_set):
    with pytest.raises(ShardMismatchError, match="written for 2 ranks.*world size 3"):
        TensorDeserializer(
            str(rank_set / "model-rank-%03d.tensors"), device="cpu", shard=ShardSpec(0, 3)
        )


def test_plan_mismatch(rank_set):
    with pytest.raises(ShardMismatchError, match="split with plan.*rank 1 expects"):
        TensorDeserializer(
            str(rank_set / "model-rank-%03d.tensors"),
            device="cpu",
            shard=ShardSpec(1, 2, {"*.col.weight": 1}),
        )


def test_missing_rank_file(rank_set):
    (rank_set / "model-rank-001.tensors").unlink()
    with pytest.raises(
        ShardMismatchError, match="rank 1's file .*model-rank-001.tensors is missing"
    ):
        TensorDeserializer(
            str(rank_set / "model-rank-%03d.tensors"), device="cpu", shard=ShardSpec(1, 2)
        )


def test_missing_sidecar(rank_set):
    (rank_set / "tensor-parallel.json").unlink()
    with pytest.raises(ShardMismatchError, match="tensor-parallel.json.*is missing"):
        TensorDeserializer(
            str(rank_set / "model-rank-%03d.tensors"), device="cpu", shard=ShardSpec(0, 2)
        )


def test_mixed_set_refused(rank_set, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    state = {k: torch.cat([v, v]) if k == "a.norm.weight" else v for k, v in _state().items()}
    serialize_sharded(state, other, world_size=2, plan=PLAN)
    (rank_set / "model-rank-001.tensors").write_bytes(
        (other / "model-rank-001.tensors").read_bytes()
    )
    with pytest.raises(ShardMismatchError, match="set is mixed"):
        TensorDeserializer(
            str(rank_set / "model-rank-%03d.tensors"), device="cpu", shard=ShardSpec(1, 2)
        )


def test_uneven_split_refused_before_writing(tmp_path):
    with pytest.raises(ConfigError, match=r"a\.col\.weight: dim 0 of size 6 .* 4 shards"):
        serialize_sharded(_state(), tmp_path, world_size=4, plan=PLAN)
    assert not list(tmp_path.iterdir())


def test_rank_files_over_http(tmp_path, http_server):
    directory = http_server.root / "tp-rank-files"
    serialize_sharded(_state(), directory, world_size=2, plan=PLAN)
    # the server's URL builder escapes % as %25, as any URL must
    template = http_server.url("tp-rank-files/model-rank-%03d.tensors")
    assert "%2503d" in template
    for rank in range(2):
        with TensorDeserializer(template, device="cpu", shard=ShardSpec(rank, 2, PLAN)) as d:
            _check_rank(d, rank, 2)
