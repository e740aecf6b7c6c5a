"""Server test fixtures: the built-in model tensorized (locally and in SeaweedFS), a LoRA
adapter, a reference ``LLM``, and one real ``tensorstream serve`` process per session.

Server processes are expensive on a 2-core machine, so the local one is shared by
every server test (session scope); tests that change it (adapters) clean up after
themselves. The S3 server of the guide's command lives in its own test module.
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
def local_server(
    tmp_path_factory: pytest.TempPathFactory, tensorized_dir: Path, s3_env_vars: dict[str, str]
) -> Iterator[ServeProcess]:
    """``tensorstream serve <local tensorized dir>`` with an API key, LoRA and 4 seats."""
    log = tmp_path_factory.mktemp("serve-local") / "serve.log"
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
        ],
        log,
        env=s3_env_vars,  # adapters are also loaded from SeaweedFS
        api_key=API_KEY,
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
