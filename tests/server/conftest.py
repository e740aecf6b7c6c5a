"""Server test fixtures: the built-in model tensorized (locally and in SeaweedFS), a LoRA
adapter, a reference ``LLM``, and one real ``tensorstream serve`` process per session.

Server processes are expensive on a 2-core machine, so the local one is shared by
every server test (session scope); tests that change it (adapters) clean up after
themselves. The S3 server of the guide's command lives in its own test module.

The shared server is configured the way a deployment migrated from vLLM would be:
its API key and runtime-LoRA switch come from ``VLLM_API_KEY`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, and adapters load only from ``lora_roots``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from serveproc import ServeProcess

SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
API_KEY = "test-key-123"
SERVED_NAME = "smol"
GUIDE_BUCKET = "my-bucket"
HEADER_TIMEOUT_S = 3
CHAT_TEMPLATE_TIMEOUT_S = 3
GUIDE_PREFIX = "vllm/facebook/opt-125m/v1"


@pytest.fixture(scope="session")
def builtin_dir() -> Path:
    from tensorstream.engine.builtin import materialize_builtin

    return materialize_builtin()


@pytest.fixture(scope="session")
def tensorized_dir(tmp_path_factory: pytest.TempPathFactory, builtin_dir: Path) -> Path:
    """The built-in model as ``model.tensors`` + config/tokenizer files (vLLM's layout)."""
    import transformers

    from tensorstream import TensorSerializer

    out = tmp_path_factory.mktemp("tensorized")
    for name in SMALL_FILES:
        if (builtin_dir / name).is_file():
            shutil.copy(builtin_dir / name, out / name)
    model = transformers.AutoModelForCausalLM.from_pretrained(builtin_dir)
    with TensorSerializer(str(out / "model.tensors")) as serializer:
        serializer.write_module(model)
    del model
    return out


@pytest.fixture(scope="session")
def peft_adapter(tmp_path_factory: pytest.TempPathFactory, builtin_dir: Path) -> Path:
    """A PEFT LoRA adapter for the built-in model with non-zero weights (it changes outputs)."""
    import peft
    import torch
    import transformers

    out = tmp_path_factory.mktemp("peft-adapter")
    model = transformers.AutoModelForCausalLM.from_pretrained(builtin_dir)
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def reference_llm(tensorized_dir: Path):
    """The same model the servers load, in this process, for expected greedy outputs."""
    from tensorstream.engine import LLM

    return LLM(str(tensorized_dir), load_format="tensorizer", device="cpu", enable_lora=True)


@pytest.fixture(scope="session")
def s3_env_vars(s3_server) -> dict[str, str]:
    """vLLM's S3 variables for a child process."""
    return {
        "S3_ENDPOINT_URL": s3_server.endpoint,
        "S3_ACCESS_KEY_ID": s3_server.access_key,
        "S3_SECRET_ACCESS_KEY": s3_server.secret_key,
    }


@pytest.fixture(scope="session")
def guide_bucket(s3_server, tensorized_dir: Path) -> str:
    """``s3://my-bucket/vllm/facebook/opt-125m/v1`` holding the tensorized built-in model."""
    client = s3_server.client()
    try:
        client.create_bucket(Bucket=GUIDE_BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    for path in sorted(tensorized_dir.iterdir()):
        client.upload_file(str(path), GUIDE_BUCKET, f"{GUIDE_PREFIX}/{path.name}")
    return f"s3://{GUIDE_BUCKET}/{GUIDE_PREFIX}"


@pytest.fixture(scope="session")
def lora_roots(tmp_path_factory: pytest.TempPathFactory, s3_server, http_server) -> dict:
    """The shared server's ``--lora-allowed-roots``: a local dir, an nginx prefix, an S3 prefix.

    Keys: ``local`` (Path), ``http_dir`` (Path served by nginx), ``http`` (its URL),
    ``bucket``, ``s3`` (``s3://bucket/allowed``).
    """
    local = tmp_path_factory.mktemp("lora-root")
    http_dir = http_server.root / "lora-root"
    http_dir.mkdir(parents=True, exist_ok=True)
    bucket = s3_server.make_bucket("lora-root")
    return {
        "local": local,
        "http_dir": http_dir,
        "http": http_server.url("lora-root"),
        "bucket": bucket,
        "s3": f"s3://{bucket}/allowed",
    }


@pytest.fixture(scope="session")
def local_server(
    tmp_path_factory: pytest.TempPathFactory,
    tensorized_dir: Path,
    s3_env_vars: dict[str, str],
    lora_roots: dict,
) -> Iterator[ServeProcess]:
    """``tensorstream serve <local tensorized dir>`` with an API key, LoRA and 4 seats."""
    log = tmp_path_factory.mktemp("serve-local") / "serve.log"
    env = {
        **s3_env_vars,  # adapters are also loaded from SeaweedFS
        "VLLM_API_KEY": API_KEY,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true",
    }
    server = ServeProcess.start(
        [
            str(tensorized_dir),
            "--load-format",
            "tensorizer",
            "--served-model-name",
            SERVED_NAME,
            "--enable-lora",
            "--max-loras",
            "2",
            "--max-num-seqs",
            "4",
            "--device",
            "cpu",
            "--shutdown-timeout",
            "20",
            "--lora-allowed-roots",
            str(lora_roots["local"]),
            "--lora-allowed-roots",
            f"{lora_roots['http']},{lora_roots['s3']}",
            "--trust-request-chat-template",
            "--chat-template-timeout",
            str(CHAT_TEMPLATE_TIMEOUT_S),
            "--request-header-timeout",
            str(HEADER_TIMEOUT_S),
        ],
        log,
        env=env,
        api_key=API_KEY,
        api_key_flag=False,  # the key reaches the server through VLLM_API_KEY
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def client(local_server: ServeProcess):
    """The official ``openai`` client pointed at ``local_server``."""
    import openai

    return openai.OpenAI(
        base_url=local_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=180
    )
