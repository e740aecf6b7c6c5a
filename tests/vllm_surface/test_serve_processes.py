"""Two real ``tensorstream serve`` starts with command lines copied from vLLM users.

1. The guide's full serve example (``tensorizer_uri`` on S3, ``stream_kwargs`` with
   ``"force_http": "False"``, ``deserialization_kwargs`` with ``"verify_hash": "True"``),
   wrapped in a deployment's usual vLLM flags (SeaweedFS stands in for the bucket).
2. Encrypted serving with ``--keyfile``.
"""

from __future__ import annotations

import json
import shutil

import pytest
from serveproc import ServeProcess

pytestmark = pytest.mark.integration

PROMPT = "The capital of France is"


def _complete(server: ServeProcess, model: str) -> str:
    status, body = server.request(
        "POST",
        "/v1/completions",
        {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0},
        timeout=180,
    )
    assert status == 200, body
    return body["choices"][0]["text"]


@pytest.fixture(scope="module")
def expected_text(tensorized_dir) -> str:
    from tensorstream import LLM, SamplingParams

    llm = LLM(str(tensorized_dir), cpu_threads=1)
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text


def test_the_guides_full_serve_example_with_deployment_flags(
    s3_server, tensorized_dir, tmp_path, expected_text
):
    bucket = s3_server.make_bucket("guide-full")
    client = s3_server.client()
    prefix = "vllm/facebook/opt-125m/v1"
    client.upload_file(str(tensorized_dir / "model.tensors"), bucket, f"{prefix}/model.tensors")
    extra = {
        "tensorizer_uri": f"s3://{bucket}/{prefix}/model.tensors",
        "stream_kwargs": {"force_http": "False"},
        "deserialization_kwargs": {"verify_hash": "True", "num_readers": 8},
    }
    # The config and tokenizer come from the local directory, as vLLM's --model does.
    args = [str(tensorized_dir), "--load-format", "tensorizer"]
    args += ["--model-loader-extra-config", json.dumps(extra)]
    args += "--tensor-parallel-size 1 --gpu-memory-utilization 0.90 --enforce-eager".split()
    args += (
        "--max-model-len 2048 --max-num-seqs 4 --dtype bfloat16 --served-model-name smol".split()
    )
    args += "--swap-space 4 --block-size 16 --enable-prefix-caching --disable-log-requests".split()
    args += "--uvicorn-log-level warning --cpu-threads 1".split()
    env = {
        "S3_ENDPOINT_URL": s3_server.endpoint,
        "S3_ACCESS_KEY_ID": s3_server.access_key,
        "S3_SECRET_ACCESS_KEY": s3_server.secret_key,
    }
    server = ServeProcess.start(args, tmp_path / "serve.log", env=env)
    try:
        assert _complete(server, "smol") == expected_text
        log = server.log.read_text()
    finally:
        server.stop()
    for flag in ("--gpu-memory-utilization", "--swap-space", "--block-size"):
        assert log.count(f"WARNING tensorstream.vllm_args: {flag} ") == 1, flag
    assert "stream_kwargs['force_http'] accepted" in log
    assert "since process start" in log and "GB/s" in log  # S3 bytes are really read
    assert "Traceback" not in log


def test_encrypted_serving_with_keyfile(tensorized_dir, tmp_path, expected_text):
    from tensorstream import EncryptionParams, TensorDeserializer, TensorSerializer
    from tensorstream.crypto.keyfile import write_keyfile

    model_dir = tmp_path / "encrypted"
    shutil.copytree(tensorized_dir, model_dir, ignore=shutil.ignore_patterns("model.tensors"))
    key = EncryptionParams.random()
    keyfile = tmp_path / "model.key"
    write_keyfile(str(keyfile), key.key)
    with TensorDeserializer(str(tensorized_dir / "model.tensors"), device="cpu") as reader:
        state = {k: v.clone() for k, v in reader.items()}
    with TensorSerializer(str(model_dir / "model.tensors"), encryption=key) as writer:
        writer.write_state_dict(state)
    args = [str(model_dir), "--keyfile", str(keyfile), "--served-model-name", "enc"]
    args += ["--cpu-threads", "1"]
    server = ServeProcess.start(args, tmp_path / "serve-enc.log")
    try:
        assert _complete(server, "enc") == expected_text
    finally:
        server.stop()
