"""LoRA adapters: serialized beside the model (local, S3, HTTP, encrypted) or PEFT directories,
several in one engine and one batch, matching PEFT's own output on the unserialized adapter."""

from __future__ import annotations

import shutil

import pytest
import torch

from tensorstream.engine import LLM, SamplingParams
from tensorstream.engine.lora import LoRARequest
from tensorstream.engine.tensorize import SerializeOptions, serialize_model
from tensorstream.errors import ConfigError, CryptoError

PROMPT = [1, 504, 3458, 5, 906, 42, 17]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _logits(llm: LLM, adapter_name: str | None) -> torch.Tensor:
    """Full prompt logits through the engine's model with one adapter row active."""
    with torch.no_grad(), llm.lora_manager.activate([adapter_name]):
        return llm.model(input_ids=torch.tensor([PROMPT])).logits[0]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def serialized(tmp_path_factory, tiny_llama, adapters):
    """tiny_llama tensorized with adapter a1 beside it (plain) and with a2 (encrypted)."""
    root = tmp_path_factory.mktemp("tensorized")
    plain = serialize_model(
        SerializeOptions(str(tiny_llama), str(root), suffix="plain", lora_path=str(adapters["a1"]))
    )
    keyfile = root / "model.key"
    secret = serialize_model(
        SerializeOptions(
            str(tiny_llama),
            str(root),
            suffix="secret",
            lora_path=str(adapters["a2"]),
            keyfile=str(keyfile),
        )
    )
    assert secret.new_key and keyfile.stat().st_size == 32
    return {"plain": plain.directory, "secret": secret.directory, "keyfile": str(keyfile)}


def test_serialized_adapter_matches_peft(serialized, adapters, peft_reference):
    llm = LLM(serialized["plain"], device="cpu", enable_lora=True)
    request = LoRARequest("a1", 1, serialized["plain"])
    ref_logits, ref_tokens = peft_reference(adapters["a1"], PROMPT, 6)
    base_logits, base_tokens = peft_reference(None, PROMPT, 6)
    assert not torch.allclose(ref_logits, base_logits, atol=1e-3)  # the adapter matters
    name = llm.lora_manager.add(request)
    torch.testing.assert_close(_logits(llm, name), ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_logits(llm, None), base_logits, atol=1e-4, rtol=1e-4)
    out = llm.generate({"prompt_token_ids": PROMPT}, GREEDY, lora_request=request)
    assert _tokens(out) == [ref_tokens]
    assert _tokens(llm.generate({"prompt_token_ids": PROMPT}, GREEDY)) == [base_tokens]


def test_two_adapters_and_base_in_one_batch(serialized, adapters, tiny_llama, peft_reference):
    llm = LLM(str(tiny_llama), device="cpu", enable_lora=True, max_loras=2)
    a1 = LoRARequest("a1", 1, serialized["plain"])  # serialized adapter
    a2 = LoRARequest("a2", 2, str(adapters["a2"]))  # PEFT directory
    prompts = [{"prompt_token_ids": PROMPT}] * 4
    out = llm.generate(prompts, GREEDY, lora_request=[a1, None, a2, a1])
    expected = {
        k: peft_reference(v, PROMPT, 6)[1]
        for k, v in (("a1", adapters["a1"]), ("a2", adapters["a2"]), ("base", None))
    }
    assert _tokens(out) == [expected["a1"], expected["base"], expected["a2"], expected["a1"]]
    assert len({tuple(t) for t in _tokens(out)}) == 3
    assert llm.list_loras() == {1, 2}
    # A third adapter evicts the least recently used idle one (max_loras=2).
    big = LoRARequest("big", 3, str(adapters["big"]))
    with pytest.raises(ConfigError, match="rank 32, above max_lora_rank=16"):
        llm.generate(prompts[:1], GREEDY, lora_request=big)
    assert llm.remove_lora(1) and llm.list_loras() == {2}


def test_adapter_from_s3_and_http(
    serialized, adapters, peft_reference, s3_env, s3_bucket, http_server, tiny_llama
):
    ref_tokens = peft_reference(adapters["a1"], PROMPT, 6)[1]
    # S3: tensorize straight into the bucket (credentials from S3_* env), load from there.
    remote = serialize_model(
        SerializeOptions(
            str(tiny_llama), f"s3://{s3_bucket}", suffix="v1", lora_path=str(adapters["a1"])
        )
    )
    assert remote.directory == f"s3://{s3_bucket}/vllm/{tiny_llama.name}/v1"
    # HTTP: nginx serves a copy of the local serialized directory.
    served = http_server.root / "lora-plain"
    shutil.copytree(serialized["plain"], served, dirs_exist_ok=True)
    llm = LLM(str(tiny_llama), device="cpu", enable_lora=True, max_loras=2)
    s3 = LoRARequest("s3", 1, remote.directory)
    http = LoRARequest("http", 2, http_server.url("lora-plain"))
    out = llm.generate([{"prompt_token_ids": PROMPT}] * 2, GREEDY, lora_request=[s3, http])
    assert _tokens(out) == [ref_tokens, ref_tokens]
    # The whole model also loads from the bucket: config and tokenizer come from S3 too.
    from_s3 = LLM(remote.directory, device="cpu", enable_lora=True)
    assert _tokens(from_s3.generate({"prompt_token_ids": PROMPT}, GREEDY, lora_request=s3)) == [
        ref_tokens
    ]


def test_encrypted_adapter(serialized, adapters, peft_reference, tmp_path):
    ref_tokens = peft_reference(adapters["a2"], PROMPT, 6)[1]
    keyfile = serialized["keyfile"]
    # The model's key file is the adapter's default key.
    llm = LLM(
        serialized["secret"],
        device="cpu",
        enable_lora=True,
        model_loader_extra_config={"encryption_keyfile": keyfile},
    )
    request = LoRARequest("a2", 1, serialized["secret"])
    assert _tokens(llm.generate({"prompt_token_ids": PROMPT}, GREEDY, lora_request=request)) == [
        ref_tokens
    ]
    # vLLM's per-adapter spelling works too, and a wrong key is refused clearly.
    wrong = tmp_path / "wrong.key"
    wrong.write_bytes(b"\x07" * 32)
    plain_llm = LLM(serialized["plain"], device="cpu", enable_lora=True)
    with pytest.raises(CryptoError):
        plain_llm.add_lora(
            LoRARequest(
                "a2",
                2,
                serialized["secret"],
                tensorizer_config_dict={"encryption_keyfile": str(wrong)},
            )
        )
    with pytest.raises(CryptoError):  # no key at all
        plain_llm.add_lora(LoRARequest("a2", 3, serialized["secret"]))
    assert plain_llm.add_lora(
        LoRARequest(
            "a2", 4, serialized["secret"], tensorizer_config_dict={"encryption_keyfile": keyfile}
        )
    )


def test_lora_errors(tiny_llama, other_llama, adapters, tmp_path):
    llm = LLM(str(tiny_llama), device="cpu")
    with pytest.raises(ConfigError, match="enable_lora"):
        llm.generate(
            {"prompt_token_ids": PROMPT},
            GREEDY,
            lora_request=LoRARequest("a1", 1, str(adapters["a1"])),
        )
    other = LLM(str(other_llama), device="cpu", enable_lora=True)
    with pytest.raises(ConfigError, match="do not match this model|does not fit"):
        other.add_lora(LoRARequest("a1", 1, str(adapters["a1"])))
    assert other.list_loras() == set()
    # The failed adapter left no LoRA weights behind: the base model still generates as before.
    assert not any("lora1" in name for name, _ in other.model.named_parameters())
    # Serializing an adapter with a model it does not fit is refused before anything is written.
    with pytest.raises(ConfigError, match="do not match this model|does not fit"):
        serialize_model(
            SerializeOptions(
                str(other_llama), str(tmp_path), suffix="x", lora_path=str(adapters["a1"])
            )
        )
    assert not (tmp_path / "vllm").exists()
    with pytest.raises(ConfigError, match="lora_int_id must be >= 1"):
        LoRARequest("x", 0, "/a")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        llm_l = LLM(str(tiny_llama), device="cpu", enable_lora=True)
        llm_l.add_lora(LoRARequest("x", 1, str(tmp_path / "missing")))
