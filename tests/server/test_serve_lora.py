"""LoRA adapters loaded and unloaded over HTTP while serving: PEFT dir, tensorized over HTTP,
tensorized + encrypted in S3. Outputs equal ``LLM.generate`` with the same adapter."""

from __future__ import annotations

import openai
import pytest

from conftest import SERVED_NAME
from tensorstream.engine import SamplingParams

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def adapter_sources(peft_adapter, s3_server, lora_roots):
    """The same adapter as a PEFT dir, tensorized on nginx, tensorized+encrypted in SeaweedFS,
    each under one of the server's ``--lora-allowed-roots``."""
    import shutil

    from tensorstream import StorageOptions
    from tensorstream.crypto.keyfile import write_keyfile
    from tensorstream.crypto.params import EncryptionParams
    from tensorstream.engine.lora import read_adapter, write_adapter

    adapter = read_adapter(str(peft_adapter))
    peft_dir = lora_roots["local"] / "peft"
    shutil.copytree(peft_adapter, peft_dir, dirs_exist_ok=True)
    http_dir = lora_roots["http_dir"] / "serve-lora-adapter"
    http_dir.mkdir(parents=True, exist_ok=True)
    write_adapter(adapter, str(http_dir))
    storage = StorageOptions(
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key=s3_server.secret_key,
        s3_endpoint=s3_server.endpoint,
    )
    key = EncryptionParams.random()
    keyfile = lora_roots["local"] / "adapter.key"
    write_keyfile(str(keyfile), key.key)
    s3_uri = f"{lora_roots['s3']}/enc"
    write_adapter(adapter, s3_uri, encryption=key, storage=storage)
    return {
        "peft": str(peft_dir),
        "http": f"{lora_roots['http']}/serve-lora-adapter",
        "s3": s3_uri,
        "keyfile": str(keyfile),
    }


def _load(server, name, path, **extra):
    return server.request(
        "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, **extra}
    )


def test_adapters_over_http(local_server, client, reference_llm, adapter_sources):
    from tensorstream.engine.lora import LoRARequest

    params = SamplingParams(**GREEDY)
    base_text = reference_llm.generate(PROMPT, params)[0].outputs[0].text
    lora_text = (
        reference_llm.generate(
            PROMPT, params, lora_request=LoRARequest("ref", 99, adapter_sources["peft"])
        )[0]
        .outputs[0]
        .text
    )
    assert lora_text != base_text, "the test adapter must change the output"

    loads = [
        ("peft-a", adapter_sources["peft"], {}),
        ("http-a", adapter_sources["http"], {}),
        ("s3-enc", adapter_sources["s3"], {"encryption_keyfile": adapter_sources["keyfile"]}),
    ]
    try:
        for name, path, extra in loads:
            status, body = _load(local_server, name, path, **extra)
            assert status == 200, body
        # Same name twice, or an encrypted adapter without its key: refused, not fatal.
        assert _load(local_server, "peft-a", adapter_sources["peft"])[0] == 400
        status, body = _load(local_server, "s3-nokey", adapter_sources["s3"])
        assert status == 400, body

        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {SERVED_NAME, "peft-a", "http-a", "s3-enc"}
        assert all(models[n].parent == SERVED_NAME for n in ("peft-a", "http-a", "s3-enc"))

        # Three adapters, two engine slots (--max-loras 2): each still answers correctly.
        for name, _, _ in loads + loads[:1]:
            out = client.completions.create(model=name, prompt=PROMPT, **GREEDY)
            assert out.choices[0].text == lora_text, name
            assert out.model == name
        chat = client.chat.completions.create(
            model="s3-enc", messages=[{"role": "user", "content": "Hi"}], **GREEDY
        )
        assert chat.choices[0].message.content
        base = client.completions.create(model=SERVED_NAME, prompt=PROMPT, **GREEDY)
        assert base.choices[0].text == base_text
    finally:
        for name, _, _ in loads:
            local_server.request("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="peft-a", prompt=PROMPT, **GREEDY)
    status, _ = local_server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "peft-a"})
    assert status == 404
