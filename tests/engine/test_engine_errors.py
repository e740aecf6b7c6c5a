"""Bad inputs fail early with errors that name the problem and the fix."""

from __future__ import annotations

import shutil

import pytest

from tensorstream.engine import LLM, SamplingParams, resolve_model
from tensorstream.errors import ConfigError, FormatError, SourceNotFoundError


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n must"),
        (dict(seed="x"), "seed"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop=[1]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(temperature=True), "temperature"),
    ],
)
def test_bad_sampling_params(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        SamplingParams(**kwargs)


def test_sampling_params_normalise():
    params = SamplingParams(stop="###", stop_token_ids=[7], top_k=0, temperature=0)
    assert params.stop_strings == ("###",) and params.stop_token_ids == (7,) and params.greedy
    assert SamplingParams(stop=["a", "b"]).stop_strings == ("a", "b")
    assert not SamplingParams().greedy and SamplingParams(max_tokens=None).max_tokens is None


def test_missing_config_json(tmp_path, tiny_model):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), model_dir)
    (model_dir / "config.json").unlink()
    with pytest.raises(SourceNotFoundError, match="config.json"):
        LLM(str(model_dir), device="cpu")


def test_unknown_load_format(tiny_model):
    with pytest.raises(
        ConfigError, match="unknown load_format 'pt'.*auto, safetensors, tensorizer"
    ):
        LLM(str(tiny_model("llama")), load_format="pt", device="cpu")


def test_unknown_dtype(tiny_model):
    with pytest.raises(ConfigError, match="unknown dtype 'float8'"):
        LLM(str(tiny_model("llama")), dtype="float8", device="cpu")


def test_extra_config_rejected_for_safetensors(tiny_model):
    with pytest.raises(ConfigError, match=r"\['num_readers'\].*safetensors"):
        LLM(
            str(tiny_model("llama")),
            load_format="safetensors",
            model_loader_extra_config={"num_readers": 2},
        )
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(str(tiny_model("llama")), model_loader_extra_config="{nope")


def test_no_weights_in_directory(tmp_path, tiny_model):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), model_dir)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no weights found.*model.tensors.*safetensors"):
        LLM(str(model_dir), device="cpu")
    with pytest.raises(SourceNotFoundError, match=r"no \*.safetensors files"):
        LLM(str(model_dir), load_format="safetensors", device="cpu")


def test_missing_tensor_named(tmp_path, tiny_model):
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        FormatError, match=r"lacks 1 tensors.*model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        LLM(str(model_dir), device="cpu")


def test_wrong_shape_named(tmp_path, tiny_model):
    import torch
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FormatError, match=r"'model.norm.weight'.*\(31,\).*\(32,\)"):
        LLM(str(model_dir), device="cpu")


def test_missing_model_paths():
    with pytest.raises(SourceNotFoundError, match="does not exist"):
        resolve_model("/nonexistent/model/dir")
    # A Hub id that is not cached: offline (tests set HF_HUB_OFFLINE=1), so the error
    # points at the built-in model instead of trying the network.
    with pytest.raises(SourceNotFoundError, match="smollm2-135m") as info:
        resolve_model("no-such-org/no-such-model-xyz")
    assert "HF_HUB_OFFLINE" in str(info.value)


def test_remote_model_without_config(s3_server, s3_bucket):
    with pytest.raises(SourceNotFoundError, match="config.json"):
        LLM(
            f"s3://{s3_bucket}/no-model",
            device="cpu",
            model_loader_extra_config={
                "s3_endpoint": s3_server.endpoint,
                "s3_access_key_id": s3_server.access_key,
                "s3_secret_access_key": s3_server.secret_key,
            },
        )


def test_bad_prompts_and_params(tiny_model):
    llm = LLM(str(tiny_model("llama")), device="cpu", max_model_len=16)
    with pytest.raises(ConfigError, match="2 sampling_params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ConfigError, match="max_model_len is 16"):
        llm.generate([list(range(3, 20))])
    with pytest.raises(ConfigError, match="enable_lora"):
        llm.generate("a", lora_request=object())
    with pytest.raises(ConfigError, match="exceeds the model's 256 positions"):
        LLM(str(tiny_model("llama")), device="cpu", max_model_len=10_000)


def test_builtin_refuses_foreign_incomplete_dir(tmp_path):
    from tensorstream.engine.builtin import materialize_builtin

    target = tmp_path / "cache"
    target.mkdir()
    (target / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a complete model directory"):
        materialize_builtin(target)
