"""The guide's extra config, vLLM's ``TensorizerConfig`` and encrypted models, as vLLM users write them."""

from __future__ import annotations

import logging
import shutil

import pytest

from tensorstream.errors import ConfigError, KeyRequiredError

# The guide's full serve example, as printed in vLLM's tensorizer docs.
GUIDE_EXTRA = {
    "tensorizer_uri": "s3://my-bucket/vllm/facebook/opt-125m/v1/model.tensors",
    "stream_kwargs": {"force_http": "False"},
    "deserialization_kwargs": {"verify_hash": "True", "num_readers": 8},
}


def test_guide_extra_config_is_accepted_with_string_booleans():
    """Regression: stream_kwargs keys ['force_http'] are not storage options."""
    from tensorstream.engine.loaders.tensorizer import TensorizerLoadOptions, _checked_kwargs
    from tensorstream.engine.loaders.tensorizer_config import storage_from_extra

    options = TensorizerLoadOptions.from_extra(GUIDE_EXTRA)
    assert options.uri_for("/unused") == GUIDE_EXTRA["tensorizer_uri"]
    assert storage_from_extra(GUIDE_EXTRA) is None  # force_http alone changes nothing
    assert _checked_kwargs(options.deserialization_kwargs) == {
        "verify_hash": True,
        "num_readers": 8,
    }


def test_verify_hash_false_as_a_string_is_false():
    """Regression: bool("False") is True."""
    from tensorstream.engine.loaders.tensorizer import TensorizerLoadOptions

    assert TensorizerLoadOptions.from_extra({"verify_hash": "False"}).verify_hash is False
    assert TensorizerLoadOptions.from_extra({"verify_hash": "true"}).verify_hash is True
    assert TensorizerLoadOptions.from_extra({"num_readers": "4"}).num_readers == 4
    with pytest.raises(ConfigError, match="verify_hash must be true or false"):
        TensorizerLoadOptions.from_extra({"verify_hash": "maybe"})


def test_open_stream_keywords_map_onto_storage_options(caplog):
    from tensorstream.engine.loaders import tensorizer_config
    from tensorstream.engine.loaders.tensorizer_config import storage_from_extra

    tensorizer_config._told.clear()
    caplog.set_level(logging.INFO, logger="tensorstream")
    storage = storage_from_extra(
        {
            "s3_endpoint": "http://127.0.0.1:9000",
            "stream_kwargs": {
                "s3_access_key_id": "AK",
                "s3_secret_access_key": "SK",
                "s3_config_path": "/etc/s3cfg",
                "s3_region_name": "us-east-1",
                "buffer_size": 1 << 20,
                "force_http": "True",
                "begin": 0,
                "certificate_handling": {"cafile": "/etc/ca.pem", "allow_untrusted": "false"},
                "verify_tls": "False",  # our own option names work too
            },
        }
    )
    assert storage.s3_endpoint == "http://127.0.0.1:9000"
    assert (storage.s3_access_key_id, storage.s3_secret_access_key) == ("AK", "SK")
    assert (storage.s3_config_path, storage.s3_region) == ("/etc/s3cfg", "us-east-1")
    assert storage.ca_bundle == "/etc/ca.pem" and storage.verify_tls is False
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert sum("'buffer_size'" in m for m in infos) == 1
    assert sum("'force_http'" in m for m in infos) == 1
    storage_from_extra({"stream_kwargs": {"force_http": True}})  # said once per process
    assert sum("'force_http'" in m for r in caplog.records for m in [r.getMessage()]) == 1
    # Secrets never reach a repr or a message.
    assert "SK" not in repr(storage)


@pytest.mark.parametrize(
    ("stream_kwargs", "named"),
    [
        ({"begin": 100}, "stream_kwargs['begin']"),
        ({"end": 1000}, "stream_kwargs['end']"),
        ({"mode": "wb"}, "stream_kwargs['mode']"),
        ({"s3_signature_version": "s3"}, "s3_signature_version"),
        ({"forse_http": True}, "'forse_http'"),
    ],
)
def test_stream_keywords_that_cannot_be_honoured_are_named(stream_kwargs, named):
    from tensorstream.engine.loaders.tensorizer_config import storage_from_extra

    with pytest.raises(ConfigError) as info:
        storage_from_extra({"stream_kwargs": stream_kwargs})
    assert named in str(info.value)


def test_tensorizer_config_has_vllms_fields_and_is_a_mapping():
    from tensorstream import TensorizerConfig

    cfg = TensorizerConfig(
        tensorizer_uri="s3://b/vllm/m/v1/model.tensors",
        verify_hash="False",
        num_readers=8,
        encryption_keyfile="s3://b/key",
        s3_secret_access_key="SECRET",
        lora_dir="s3://b/vllm/m/v1",
        stream_kwargs={"force_http": False},
    )
    assert cfg.tensorizer_dir == "s3://b/vllm/m/v1" and cfg.verify_hash is False
    assert dict(cfg)["num_readers"] == 8 and "serialization_kwargs" not in cfg
    assert cfg.to_serializable()["lora_dir"] == "s3://b/vllm/m/v1"
    assert "SECRET" not in repr(cfg)
    for name in (
        "tensorizer_uri", "tensorizer_dir", "vllm_tensorized", "verify_hash", "num_readers",
        "encryption_keyfile", "s3_access_key_id", "s3_secret_access_key", "s3_endpoint",
        "lora_dir", "stream_kwargs", "serialization_kwargs", "deserialization_kwargs",
    ):  # fmt: skip
        assert hasattr(cfg, name), name


def test_lora_dir_in_the_model_config_names_the_adapter_beside_it(tensorized_dir, tmp_path):
    """vLLM's ``model_loader_extra_config={"lora_dir": ...}``: requests without their own
    tensorizer options read the adapter from there (a Hub id as lora_path is just a name)."""
    import torch

    from tensorstream import LLM, LoRARequest, SamplingParams
    from tensorstream.engine.adapter_files import LoadedAdapter, write_adapter

    config = {
        "r": 4,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "peft_type": "LORA",
        "base_model_name_or_path": "smollm2",
    }
    torch.manual_seed(0)
    tensors = {}
    for layer in range(30):
        for proj, out_dim in (("q_proj", 576), ("v_proj", 192)):
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(4, 576, dtype=torch.bfloat16) * 0.5
            tensors[f"{base}.lora_B.weight"] = torch.randn(out_dim, 4, dtype=torch.bfloat16) * 0.5
    model_dir = tmp_path / "model"
    shutil.copytree(tensorized_dir, model_dir)
    write_adapter(LoadedAdapter(str(model_dir), config, tensors), str(model_dir))
    assert (model_dir / "adapter_model.tensors").is_file()

    llm = LLM(
        str(model_dir),
        enable_lora=True,
        max_lora_rank=8,
        model_loader_extra_config={"lora_dir": str(model_dir)},
        cpu_threads=1,
    )
    params = SamplingParams(temperature=0, max_tokens=6)
    base = llm.generate("The capital of France is", params)[0].outputs[0].token_ids
    hub_name = LoRARequest("sql-lora", 1, "yard1/llama-2-7b-sql-lora-test")
    adapted = llm.generate("The capital of France is", params, lora_request=hub_name)
    assert adapted[0].outputs[0].token_ids != base


def test_encrypted_model_no_key_names_the_llm_keyword(tensorized_dir, tmp_path):
    from tensorstream import LLM, EncryptionParams, TensorDeserializer, TensorSerializer
    from tensorstream.crypto.keyfile import write_keyfile

    model_dir = tmp_path / "enc"
    shutil.copytree(tensorized_dir, model_dir, ignore=shutil.ignore_patterns("model.tensors"))
    key = EncryptionParams.random()
    keyfile = tmp_path / "model.key"
    write_keyfile(str(keyfile), key.key)
    with TensorDeserializer(str(tensorized_dir / "model.tensors"), device="cpu") as reader:
        state = {k: v.clone() for k, v in reader.items()}
    with TensorSerializer(str(model_dir / "model.tensors"), encryption=key) as writer:
        writer.write_state_dict(state)

    with pytest.raises(KeyRequiredError) as info:
        LLM(str(model_dir), cpu_threads=1)
    message = str(info.value)
    assert "model.tensors is encrypted" in message and "encryption_keyfile" in message
    assert "--keyfile" not in message  # that is the CLI's way, not LLM's

    llm = LLM(
        str(model_dir),
        model_loader_extra_config={"encryption_keyfile": str(keyfile)},
        cpu_threads=1,
    )
    assert llm.load_stats.bytes > 100e6

    # The CLI names its own flags for the same failure.
    import argparse

    from tensorstream.cli.serve import _build_llm

    args = argparse.Namespace(
        model=str(model_dir), load_format="auto", dtype="auto", enable_lora=False, max_loras=1,
        max_lora_rank=16, seed=None, device=None, tokenizer=None, max_model_len=None,
        trust_remote_code=False, revision=None, max_num_batched_tokens=None, cpu_threads=1,
        chat_template=None, model_impl="auto",
    )  # fmt: skip
    with pytest.raises(KeyRequiredError) as info:
        _build_llm(args, {})
    assert "--keyfile PATH or --passphrase-env VAR" in str(info.value)
    assert "LLM(" not in str(info.value)


def test_lora_request_config_reads_string_booleans():
    """Regression: ``tensorizer_config_dict={"verify_hash": "False"}`` turned hashing on."""
    from tensorstream import LoRARequest
    from tensorstream.engine.adapter_files import AdapterOptions

    options = AdapterOptions.from_config({"verify_hash": "False", "num_readers": "3"})
    assert options.verify_hash is False and options.num_readers == 3
    request = LoRARequest("a", 1, "/adapters/a", tensorizer_config_dict={"verify_hash": "True"})
    assert AdapterOptions.from_config(request.tensorizer_config_dict).verify_hash is True
