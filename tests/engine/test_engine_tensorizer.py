"""The tensorizer load format: serialized directories load and generate like the original."""

from __future__ import annotations

import shutil

import pytest
import torch

from tensorstream.engine import LLM, SamplingParams
from tensorstream.errors import ConfigError

PARAMS = SamplingParams(temperature=0, max_tokens=6)
PROMPTS = ["The quick brown fox", "Hello there, general"]
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def serialized_dir(tmp_path, model_dir, name="serialized"):
    """A vLLM-style serialized directory: config/tokenizer files, weights to be added."""
    out = tmp_path / name
    out.mkdir()
    for file in SMALL_FILES:
        if (model_dir / file).is_file():
            shutil.copy(model_dir / file, out / file)
    return out


def reference(model_dir):
    return [
        o.outputs[0].token_ids for o in LLM(str(model_dir), device="cpu").generate(PROMPTS, PARAMS)
    ]


def test_tensorstream_serialized_llama(tmp_path, tiny_model):
    import transformers

    from tensorstream import TensorSerializer

    model_dir = tiny_model("llama", tie_word_embeddings=True)
    out = serialized_dir(tmp_path, model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with TensorSerializer(str(out / "model.tensors")) as serializer:
        serializer.write_module(model)
    llm = LLM(str(out), device="cpu")  # auto: model.tensors -> tensorizer
    assert llm.load_format == "tensorizer" and llm.load_stats.bytes > 0
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference(model_dir)
    assert llm.model.lm_head.weight is llm.model.model.embed_tokens.weight
    # The rotary buffer in the file is ignored in favour of a float32 recomputation.
    assert llm.model.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("arch", ["opt", "gpt2", "qwen2"])
def test_tensorstream_serialized_other_archs(tmp_path, tiny_model, arch):
    import transformers

    from tensorstream import TensorSerializer

    model_dir = tiny_model(arch)
    out = serialized_dir(tmp_path, model_dir)
    with TensorSerializer(str(out / "model.tensors")) as serializer:
        serializer.write_module(transformers.AutoModelForCausalLM.from_pretrained(model_dir))
    llm = LLM(str(out), load_format="tensorizer", device="cpu")
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference(model_dir)


@pytest.mark.interop
def test_real_tensorizer_file_loads(tmp_path, tiny_model):
    """A file written by tensorizer 2.12.1 itself (the oracle) loads through our engine."""
    import transformers
    from tensorizer import TensorSerializer as OracleSerializer

    model_dir = tiny_model("llama")
    out = serialized_dir(tmp_path, model_dir)
    serializer = OracleSerializer(str(out / "model.tensors"))
    serializer.write_module(transformers.AutoModelForCausalLM.from_pretrained(model_dir))
    serializer.close()
    llm = LLM(str(out), load_format="tensorizer", device="cpu", dtype="bfloat16")
    assert {p.dtype for p in llm.model.parameters()} == {torch.bfloat16}
    expected = LLM(str(model_dir), device="cpu", dtype="bfloat16").generate(PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == [
        o.outputs[0].token_ids for o in expected
    ]


def test_extra_config_uri_and_rank_template(tmp_path, tiny_model):
    import transformers

    from tensorstream import TensorSerializer

    model_dir = tiny_model("qwen2")
    elsewhere = tmp_path / "weights"
    elsewhere.mkdir()
    with TensorSerializer(str(elsewhere / "model-rank-000.tensors")) as serializer:
        serializer.write_module(transformers.AutoModelForCausalLM.from_pretrained(model_dir))
    files = serialized_dir(tmp_path, model_dir, "files")
    templated = {
        "tensorizer_config": {"tensorizer_uri": str(elsewhere / "model-rank-%03d.tensors")}
    }
    with pytest.raises(ConfigError, match="tensor-parallel shards.*pass tensor_parallel_size=N"):
        LLM(str(files), device="cpu", model_loader_extra_config=templated)
    extra = {
        "tensorizer_config": {"tensorizer_uri": str(elsewhere / "model-rank-000.tensors")},
        "verify_hash": True,
    }
    llm = LLM(str(files), device="cpu", model_loader_extra_config=extra)  # auto -> tensorizer
    assert llm.load_format == "tensorizer"
    assert llm.load_stats.uri.endswith("model-rank-000.tensors")
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference(model_dir)


@pytest.mark.interop
def test_encrypted_by_tensorizer_with_keyfile(tmp_path, tiny_model):
    """tensorizer 2.12.1 encrypts; the engine decrypts with encryption_keyfile."""
    import transformers
    from tensorizer import EncryptionParams
    from tensorizer import TensorSerializer as OracleSerializer

    from tensorstream.crypto.keyfile import write_keyfile
    from tensorstream.errors import KeyRequiredError

    model_dir = tiny_model("gpt2")
    out = serialized_dir(tmp_path, model_dir)
    key = EncryptionParams.random()
    keyfile = tmp_path / "model.key"
    write_keyfile(str(keyfile), key.key)
    serializer = OracleSerializer(str(out / "model.tensors"), encryption=key)
    serializer.write_module(transformers.AutoModelForCausalLM.from_pretrained(model_dir))
    serializer.close()
    llm = LLM(
        str(out), device="cpu", model_loader_extra_config={"encryption_keyfile": str(keyfile)}
    )
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference(model_dir)
    with pytest.raises(KeyRequiredError):
        LLM(str(out), device="cpu")
