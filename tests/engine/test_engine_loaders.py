"""Load-format detection and the safetensors loader (sharded checkpoints, zero-copy adoption)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tensorstream.engine import LLM, SamplingParams, resolve_model
from tensorstream.engine.loaders import LOAD_FORMATS, detect_format, get_loader
from tensorstream.engine.loaders.tensorizer import TensorizerLoadOptions
from tensorstream.errors import ConfigError


def test_formats_listed():
    assert LOAD_FORMATS == ("auto", "safetensors", "tensorizer")
    assert get_loader("SafeTensors").name == "safetensors"
    with pytest.raises(ConfigError, match="valid: auto, safetensors, tensorizer"):
        get_loader("gguf")


def test_detect_format(tmp_path, tiny_model):
    location = resolve_model(str(tiny_model("llama")))
    assert detect_format(location) == "safetensors"
    assert detect_format(location, {"tensorizer_uri": "/x/model.tensors"}) == "tensorizer"
    serialized = tmp_path / "serialized"
    serialized.mkdir()
    (serialized / "model.tensors").write_bytes(b"")
    (serialized / "model.safetensors").write_bytes(b"")
    assert detect_format(resolve_model(str(serialized))) == "tensorizer"


def test_sharded_checkpoint_matches_single(tmp_path, tiny_model):
    import transformers

    source = tiny_model("qwen2")
    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    model.save_pretrained(sharded, max_shard_size="1MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    params = SamplingParams(temperature=0, max_tokens=6)
    one = LLM(str(source), device="cpu").generate("hello world", params)[0].outputs[0].token_ids
    many = LLM(str(sharded), device="cpu").generate("hello world", params)[0].outputs[0].token_ids
    assert one == many


def test_loaded_tensors_become_parameters(tiny_model):
    """No copy: with matching dtype/device, each loaded tensor is the parameter's storage."""
    from tensorstream.engine.build import build_model
    from tensorstream.engine.loaders import LoadRequest

    llm_dir = tiny_model("llama")
    location = resolve_model(str(llm_dir))
    import transformers

    config = transformers.AutoConfig.from_pretrained(llm_dir)
    weights = get_loader("safetensors").load(
        LoadRequest(location, torch.device("cpu"), torch.float32)
    )
    pointers = {name: t.data_ptr() for name, t in weights.items()}
    model = build_model(config, weights, dtype=torch.float32, device="cpu")
    for name, param in model.named_parameters():
        assert param.data_ptr() == pointers[name], name


def test_tensorizer_options_parse():
    nested = TensorizerLoadOptions.from_extra(
        {
            "tensorizer_config": {
                "tensorizer_uri": "s3://b/m/model-rank-%03d.tensors",
                "num_readers": 4,
            }
        }
    )
    assert nested.num_readers == 4
    with pytest.raises(ConfigError, match="tensor-parallel shards.*tensor_parallel_size=N"):
        nested.uri_for("/unused")
    flat = TensorizerLoadOptions.from_extra({"tensorizer_dir": "s3://b/m", "verify_hash": 1})
    assert flat.uri_for("/unused") == "s3://b/m/model.tensors" and flat.verify_hash is True
    assert TensorizerLoadOptions.from_extra({}).uri_for("/models/x") == "/models/x/model.tensors"
    with pytest.raises(ConfigError, match=r"\['bogus'\].*tensorizer"):
        TensorizerLoadOptions.from_extra({"bogus": 1})
    with pytest.raises(ConfigError, match="num_readers"):
        TensorizerLoadOptions.from_extra({"num_readers": 0})


# ---------------------------------------------------------------- remote safetensors


def _greedy(model: str, **kwargs) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=6)
    return (
        LLM(model, device="cpu", **kwargs).generate("hello world", params)[0].outputs[0].token_ids
    )


def test_safetensors_stream_from_s3(tiny_model, s3_env, s3_bucket):
    source = tiny_model("llama")
    client = s3_env.client()
    for path in source.iterdir():
        client.upload_file(str(path), s3_bucket, f"hf/llama/{path.name}")
    uri = f"s3://{s3_bucket}/hf/llama"
    assert detect_format(resolve_model(uri)) == "safetensors"  # no model.tensors there
    assert _greedy(uri) == _greedy(str(source))


def test_sharded_safetensors_stream_over_http(tmp_path, tiny_model, http_server):
    import transformers

    source = tiny_model("qwen2")
    served = http_server.root / "sharded-qwen2"
    transformers.AutoModelForCausalLM.from_pretrained(source).save_pretrained(
        served, max_shard_size="1MB"
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, served / name)
    assert (served / "model.safetensors.index.json").is_file()
    url = http_server.url("sharded-qwen2")
    assert detect_format(resolve_model(url)) == "safetensors"
    assert _greedy(url, load_format="safetensors") == _greedy(str(source))


def test_remote_directory_without_weights(tiny_model, s3_env, s3_bucket):
    from tensorstream.errors import SourceNotFoundError

    client = s3_env.client()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # all but weights
        client.upload_file(str(tiny_model("llama") / name), s3_bucket, f"empty/{name}")
    uri = f"s3://{s3_bucket}/empty"
    assert detect_format(resolve_model(uri)) == "tensorizer"  # the default, which then says why
    with pytest.raises(
        SourceNotFoundError, match="no model.safetensors.index.json or model.safetensors"
    ):
        LLM(uri, device="cpu", load_format="safetensors")
