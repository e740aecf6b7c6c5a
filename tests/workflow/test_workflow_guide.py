"""The tensorize guide's commands, run verbatim as subprocesses on the built-in SmolLM2,
into a local directory and into a SeaweedFS bucket; the results load with ``LLM`` and
generate the same greedy tokens as transformers' ``from_pretrained`` of the original."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tensorstream.engine import LLM, SamplingParams

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "features" / "tensorize_vllm_model.py"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=5)


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(args, capture_output=True, text=True, env=full_env, timeout=300, cwd=REPO)


def _tensorstream(*args: str, env=None) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "tensorstream", *args], env)


def _script(*args: str, env=None) -> subprocess.CompletedProcess:
    return _run([sys.executable, str(SCRIPT), *args], env)


@pytest.fixture(scope="module")
def reference_tokens(smollm2_dir) -> list[list[int]]:
    """Greedy tokens of transformers' own from_pretrained on the original directory."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    out = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=5, do_sample=False)
        out.append(gen[0, ids["input_ids"].shape[1] :].tolist())
    return out


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_guide_local(tmp_path, reference_tokens):
    kwargs = '{"limit_cpu_concurrency": 2}'
    done = _script(
        "--model",
        MODEL,
        "serialize",
        "--serialized-directory",
        str(tmp_path),
        "--suffix",
        "v1",
        "--serialization-kwargs",
        kwargs,
    )
    assert done.returncode == 0, done.stderr
    out = tmp_path / "vllm" / MODEL / "v1"
    names = {p.name for p in out.iterdir()}
    assert {
        "model.tensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    } <= names
    assert not any(n.endswith(".safetensors") for n in names)
    # The same command through `tensorstream tensorize`, no suffix: a random hex one, printed.
    again = _tensorstream(
        "tensorize", "--model", MODEL, "serialize", "--serialized-directory", str(tmp_path)
    )
    assert again.returncode == 0, again.stderr
    suffix = again.stdout.split("suffix: ", 1)[1].split()[0]
    assert len(suffix) == 32 and int(suffix, 16) >= 0
    assert (tmp_path / "vllm" / MODEL / suffix / "model.tensors").is_file()
    # deserialize honours --dtype, --num-readers and --verify-hash (vLLM drops them).
    loaded = _tensorstream(
        "tensorize",
        "--model",
        MODEL,
        "--dtype",
        "float16",
        "deserialize",
        "--serialized-directory",
        str(out),
        "--num-readers",
        "2",
        "--verify-hash",
    )
    assert loaded.returncode == 0, loaded.stderr
    assert "dtype float16" in loaded.stdout and "GB/s" in loaded.stdout
    assert "output: " in loaded.stdout and len(loaded.stdout.split("output: ", 1)[1].strip()) > 0
    assert _greedy(LLM(str(out), device="cpu")) == reference_tokens


def test_guide_s3_encrypted(s3_server, s3_bucket, tmp_path, reference_tokens, monkeypatch):
    env = {
        "S3_ENDPOINT_URL": s3_server.endpoint,
        "S3_ACCESS_KEY_ID": s3_server.access_key,
        "S3_SECRET_ACCESS_KEY": s3_server.secret_key,
    }
    root = f"s3://{s3_bucket}"
    done = _script(
        "--model", MODEL, "serialize", "--serialized-directory", root, "--suffix", "v1", env=env
    )
    assert done.returncode == 0, done.stderr
    uri = f"{root}/vllm/{MODEL}/v1"
    # Encrypted, key file written to the bucket; this time credentials come from --s3-* flags.
    flags = [
        "--s3-endpoint",
        s3_server.endpoint,
        "--s3-access-key-id",
        s3_server.access_key,
        "--s3-secret-access-key",
        s3_server.secret_key,
    ]
    secret = _tensorstream(
        "tensorize",
        "--model",
        MODEL,
        "serialize",
        "--serialized-directory",
        root,
        "--suffix",
        "enc",
        "--keyfile",
        f"{root}/keys/model.key",
        *flags,
    )
    assert secret.returncode == 0, secret.stderr
    assert "new random key written" in secret.stdout
    enc = f"{root}/vllm/{MODEL}/enc/model.tensors"
    loaded = _tensorstream(
        "tensorize",
        "deserialize",
        "--path-to-tensors",
        enc,
        "--keyfile",
        f"{root}/keys/model.key",
        *flags,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert "GB/s" in loaded.stdout
    wrong = tmp_path / "wrong.key"
    wrong.write_bytes(b"\x01" * 32)
    refused = _tensorstream(
        "tensorize", "deserialize", "--path-to-tensors", enc, "--keyfile", str(wrong), *flags
    )
    assert refused.returncode == 2 and "error:" in refused.stderr
    assert "Traceback" not in refused.stderr
    # Straight from S3 in-process (config + tokenizer fetched from the bucket too).
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert _greedy(LLM(uri, device="cpu")) == reference_tokens
