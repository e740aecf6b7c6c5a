"""Per-rank slices of ONE unsharded file (tensorizer and safetensors; local, HTTP, S3)
equal ``torch.chunk`` of the whole tensor bit for bit, and each rank reads about 1/N."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tensorstream
from tensorstream import TensorDeserializer, TensorSerializer
from tensorstream.deserialize.shard import ShardSpec, chunk_bounds, coalesce, plan_slice, rank_uri
from tensorstream.errors import ConfigError
from tensorstream.sources.base import Source
from tensorstream.sources.registry import open_source

PLAN = {"*.col.weight": 0, "*.col.bias": 0, "*.row.weight": 1, "*.cube": 1}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "l.col.weight": torch.randn(12, 10, generator=g),  # dim 0: 3 ranks even, 2 even
        "l.col.bias": torch.randn(12, generator=g),
        "l.row.weight": torch.randn(6, 9, generator=g).to(torch.bfloat16),  # dim 1 of 9: uneven
        "l.cube": torch.randint(0, 100, (3, 7, 5), generator=g, dtype=torch.int32),
        "l.norm.weight": torch.randn(10, generator=g),  # replicated
    }


def _expected(name: str, tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    dim = ShardSpec(rank, world, PLAN).action(name)
    if dim is None:
        return tensor
    parts = torch.chunk(tensor, world, dim)
    if rank < len(parts):
        return parts[rank]
    return tensor.narrow(dim, tensor.shape[dim], 0)  # torch.chunk gives fewer parts


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    from safetensors.torch import save_file

    base = tmp_path_factory.mktemp("shard")
    with TensorSerializer(base / "m.tensors") as out:
        out.write_state_dict(_tensors())
    save_file(_tensors(), str(base / "m.safetensors"))
    with TensorSerializer(base / "u.tensors", align=1) as out:  # tensorizer's own layout
        out.write_state_dict({"pad": torch.zeros(1, dtype=torch.uint8), **_tensors()})
    return {
        "tensorizer": base / "m.tensors",
        "safetensors": base / "m.safetensors",
        "unaligned": base / "u.tensors",
    }


def _check_all(uri, world: int, max_gap: int | None = None, **kwargs) -> None:
    whole = _tensors()
    for rank in range(world):
        with TensorDeserializer(
            uri, device="cpu", shard=ShardSpec(rank, world, PLAN, max_gap=max_gap), **kwargs
        ) as d:
            for name, tensor in whole.items():
                got, want = d[name], _expected(name, tensor, rank, world)
                assert got.dtype == want.dtype and got.shape == want.shape, (name, rank)
                assert torch.equal(got, want), (name, rank, world)


@pytest.mark.parametrize("fmt", ["tensorizer", "safetensors", "unaligned"])
@pytest.mark.parametrize("world", [2, 3])
def test_local_slices_equal_torch_chunk(files, fmt, world):
    _check_all(files[fmt], world)  # mapped copy (element-aligned data, or piece by piece)
    _check_all(files[fmt], world, max_gap=0, num_readers=2)  # ranged reads of row pieces


def test_chunk_bounds_follow_torch_chunk():
    for size in range(12):
        for world in range(1, 5):
            parts = torch.chunk(torch.arange(size), world) if size else ()
            for rank in range(world):
                start, stop = chunk_bounds(size, world, rank)
                want = parts[rank].tolist() if rank < len(parts) else []
                assert list(range(start, stop)) == want, (size, world, rank)


@pytest.mark.parametrize("fmt", ["tensorizer", "safetensors"])
def test_http_slices_equal_torch_chunk(files, fmt, http_server):
    name = f"shard-{fmt}-{files[fmt].name}"
    (http_server.root / name).write_bytes(files[fmt].read_bytes())
    _check_all(http_server.url(name), 2)
    _check_all(http_server.url(name), 3, num_readers=2)


def test_s3_slices_equal_torch_chunk(files, s3_server, s3_bucket):
    storage = tensorstream.StorageOptions(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key=s3_server.secret_key,
    )
    s3_server.client().upload_file(str(files["tensorizer"]), s3_bucket, "m.tensors")
    _check_all(f"s3://{s3_bucket}/m.tensors", 3, storage=storage)


class CountingSource(Source):
    """Wraps a real source and counts the bytes handed out (every read goes through it)."""

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.read_bytes = 0
        self.display_uri = inner.display_uri

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def preferred_readers(self) -> int:
        return 2

    @property
    def supports_ranges(self) -> bool:
        return True

    @property
    def local_path(self) -> str | None:
        return None  # no page-cache mapping: every byte is read (and counted)

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.read_bytes += len(buf)
        self.inner.read_into(offset, buf)


def test_bytes_read_per_rank_about_one_nth(tmp_path):
    g = torch.Generator().manual_seed(1)
    big = {
        "l.col.weight": torch.randn(256, 512, generator=g),
        "l.row.weight": torch.randn(512, 256, generator=g),  # dim 1: 512 pieces per rank
        "l.norm.weight": torch.randn(512, generator=g),
    }
    path = tmp_path / "big.tensors"
    with TensorSerializer(path) as out:
        out.write_state_dict(big)
    from tensorstream.deserialize.index import read_index

    probe = CountingSource(open_source(path))
    read_index(probe)  # what any load reads first (the index), before tensor data
    index_bytes = probe.read_bytes
    split = big["l.col.weight"].nbytes + big["l.row.weight"].nbytes
    replicated = big["l.norm.weight"].nbytes
    for world in (2, 3):
        for rank in range(world):
            src = CountingSource(open_source(path))
            spec = ShardSpec(rank, world, PLAN, max_gap=0)
            with TensorDeserializer(src, device="cpu", shard=spec) as d:
                assert torch.equal(d["l.row.weight"], big["l.row.weight"].chunk(world, 1)[rank])
            # every byte this rank took from storage past the index: headers and slices
            tensor_bytes = src.read_bytes - index_bytes
            assert tensor_bytes <= (split / world + replicated) * 1.1, (world, rank, tensor_bytes)
            assert d.total_bytes_read >= split / world - 4 * 512 * 4  # torch.chunk rounding


def test_max_gap_trades_requests_for_bytes(tmp_path):
    from tensorstream.deserialize.index import read_index

    path = tmp_path / "r.tensors"
    with TensorSerializer(path) as out:
        out.write_state_dict({"x.row.weight": torch.zeros(64, 32)})
    rec = read_index(open_source(path)).records[0]
    plan = plan_slice(rec, ShardSpec(0, 2, PLAN), 1)
    assert len(plan.pieces) == 64 and plan.nbytes == 64 * 16 * 4
    assert len(coalesce([plan], 0)) == 64  # exact bytes, one read per row
    merged = coalesce([plan], 1 << 20)
    assert len(merged) == 1 and merged[0].end - merged[0].start == 63 * 32 * 4 + 16 * 4


def test_rank_uri_fields():
    assert rank_uri("d/model-rank-%03d.tensors", 7) == "d/model-rank-007.tensors"
    assert rank_uri("s3://b/m-{rank}.tensors", 2) == "s3://b/m-2.tensors"
    assert rank_uri("m-{rank:02d}.tensors", 3) == "m-03.tensors"
    assert rank_uri("model.tensors", 1) is None
    # regression: an HTTP URL escapes % as %25; "%2503d" was read as a 2503-wide field
    assert rank_uri("http://h/model-rank-%2503d.tensors", 1) == "http://h/model-rank-001.tensors"


def test_uneven_split_refused_when_even_required(files):
    with pytest.raises(ConfigError, match=r"l\.row\.weight.*dim 1 of size 9.*2 equal shards"):
        TensorDeserializer(
            files["tensorizer"], device="cpu", shard=ShardSpec(0, 2, PLAN, even=True)
        )


def test_missing_dim_and_bad_action_refused(files):
    with pytest.raises(ConfigError, match=r"l\.col\.bias.*dim 1"):
        TensorDeserializer(files["tensorizer"], device="cpu", shard=ShardSpec(0, 2, {"*.bias": 1}))
    with pytest.raises(ConfigError, match="not one of 'replicate'"):
        ShardSpec(0, 2, {"*": "columns"})
    with pytest.raises(ConfigError, match=r"rank must be in \[0, 2\)"):
        ShardSpec(2, 2)


def test_encrypted_file_cannot_be_sliced(tmp_path):
    from tensorstream import DecryptionParams, EncryptionParams

    key = EncryptionParams.random()
    path = tmp_path / "enc.tensors"
    with TensorSerializer(path, encryption=key) as out:
        out.write_state_dict({"l.col.weight": torch.ones(4, 4)})
    with pytest.raises(ConfigError, match="cannot slice an encrypted file.*rank files"):
        TensorDeserializer(
            path,
            device="cpu",
            encryption=DecryptionParams.from_key(key.key),
            shard=ShardSpec(0, 2, PLAN),
        )


def test_verify_hash_refuses_to_return_unverified_slices(files):
    """verify_hash=True never hands out bytes it did not check: slicing is refused."""
    spec = ShardSpec(1, 2, PLAN)
    with pytest.raises(ConfigError, match="verify_hash cannot check slices.*rank files"):
        TensorDeserializer(files["tensorizer"], device="cpu", shard=spec, verify_hash=True)


def test_load_into_module_cannot_verify_slices(tmp_path):
    path = tmp_path / "module.tensors"
    with TensorSerializer(path) as out:
        out.write_module(torch.nn.Linear(4, 6))
    module = torch.nn.Linear(4, 6)
    with TensorDeserializer(path, device="cpu", shard=ShardSpec(0, 2, {"*weight": 0})) as d:
        with pytest.raises(ConfigError, match="cannot check these tensors"):
            d.load_into_module(module, verify_hash=True)


def test_replicated_tensors_verify_under_a_shard_spec(files):
    spec = ShardSpec(1, 2, {"*": "replicate"})
    with TensorDeserializer(files["tensorizer"], device="cpu", shard=spec, verify_hash=True) as d:
        assert torch.equal(d["l.norm.weight"], _tensors()["l.norm.weight"])
        assert d["l.col.weight"].shape == _tensors()["l.col.weight"].shape


@pytest.mark.parametrize("where", ["local", "http"])
def test_sliced_tensor_header_must_agree_with_the_index(files, tmp_path, where, request):
    """A slice reads no header with its data; the header is still checked (issue #15)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "integrity"))
    from _edit import edit_index

    edited = edit_index(files["tensorizer"].read_bytes(), "l.col.weight", dtype="<i4")
    if where == "local":
        uri = tmp_path / "edited.tensors"
        uri.write_bytes(edited)
    else:
        http_server = request.getfixturevalue("http_server")
        (http_server.root / "edited.tensors").write_bytes(edited)
        uri = http_server.url("edited.tensors")
    with pytest.raises(tensorstream.errors.FormatError, match="'l.col.weight'.*dtype"):
        TensorDeserializer(uri, device="cpu", shard=ShardSpec(0, 2, PLAN), num_readers=2)


@pytest.mark.parametrize("world", [2, 3])
def test_llama_plan_splits_the_vocab_and_reads_less(tmp_path, world):
    """With the vocab split, embed_tokens/lm_head count as split bytes: every rank reads
    about 1/N of them, and less than under the replicated-vocab plan."""
    from tensorstream.deserialize.index import read_index
    from tensorstream.engine.parallel.plan import LLAMA_LAYER_PLAN, LLAMA_TP_PLAN

    g = torch.Generator().manual_seed(2)
    state = {
        "model.embed_tokens.weight": torch.randn(600, 64, generator=g),
        "lm_head.weight": torch.randn(600, 64, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(96, 64, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 96, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(64, generator=g),
        "model.norm.weight": torch.randn(64, generator=g),
    }
    path = tmp_path / "llama.tensors"
    with TensorSerializer(path) as out:
        out.write_state_dict(state)
    probe = CountingSource(open_source(path))
    read_index(probe)
    index_bytes = probe.read_bytes
    read = {}
    for name, plan in (("vocab", LLAMA_TP_PLAN), ("layers", LLAMA_LAYER_PLAN)):
        splits = [n for n in state if ShardSpec(0, world, plan).action(n) is not None]
        split = sum(state[n].nbytes for n in splits)
        replicated = sum(t.nbytes for n, t in state.items() if n not in splits)
        for rank in range(world):
            src = CountingSource(open_source(path))
            spec = ShardSpec(rank, world, plan, even=True, max_gap=0)
            with TensorDeserializer(src, device="cpu", shard=spec) as d:
                for n in ("model.embed_tokens.weight", "lm_head.weight"):
                    want = state[n].chunk(world, 0)[rank] if name == "vocab" else state[n]
                    assert torch.equal(d[n], want)
            tensor_bytes = src.read_bytes - index_bytes
            assert tensor_bytes <= (split / world + replicated) * 1.1, (name, rank, tensor_bytes)
            read[name, rank] = tensor_bytes
    for rank in range(world):  # the two vocab tables alone are 5/6 of the model
        assert read["vocab", rank] < read["layers", rank] * 0.7
