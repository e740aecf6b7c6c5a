"""Console test fixtures: one real ``tensorstream serve`` with the console, one browser.

The server streams the built-in model, tensorized, from nginx with four readers
(so the timeline has bytes read and a rate to show), requires an API key, and
allows runtime LoRA loads from one local directory that holds a PEFT adapter.
Both are module-scoped: starting either costs seconds on a small machine.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from browser_driver import HINT, start_chromium  # noqa: E402
from serveproc import ServeProcess  # noqa: E402 - tests/server is not a package

API_KEY = "console-key-7"
SERVED_NAME = "smol"
READERS = 4
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


@pytest.fixture(scope="session")
def console_model_url(http_server) -> str:
    """The built-in model as ``model.tensors`` + config/tokenizer files on nginx."""
    from safetensors.torch import load_file

    from tensorstream import TensorSerializer
    from tensorstream.engine.builtin import materialize_builtin

    source = materialize_builtin()
    out = http_server.root / "console-model"
    out.mkdir(parents=True, exist_ok=True)
    for name in SMALL_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    with TensorSerializer(str(out / "model.tensors")) as serializer:
        serializer.write_state_dict(load_file(str(source / "model.safetensors")))
    return http_server.url("console-model")


def write_peft_adapter(directory: Path, model_dir: Path, seed: int) -> None:
    """A PEFT LoRA adapter (q_proj, v_proj; rank 8) with random non-zero weights."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = hidden // config["num_attention_heads"]
    out_dims = {"q_proj": hidden, "v_proj": config["num_key_value_heads"] * head_dim}
    rank = 8
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out_dim in out_dims.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, hidden, generator=generator) * 0.05
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out_dim, rank, generator=generator) * 0.05
            )
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": 16,
                "lora_dropout": 0.0,
                "target_modules": sorted(out_dims),
                "bias": "none",
            }
        )
    )


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's only ``--lora-allowed-roots`` entry, holding adapter ``style``."""
    from tensorstream.engine.builtin import materialize_builtin

    root = tmp_path_factory.mktemp("console-adapters")
    write_peft_adapter(root / "style", materialize_builtin(), seed=3)
    return root


@pytest.fixture(scope="module")
def console_server(
    tmp_path_factory: pytest.TempPathFactory, console_model_url: str, adapter_root: Path
) -> Iterator[ServeProcess]:
    """``tensorstream serve`` over HTTP with the console, an API key and runtime LoRA."""
    log = tmp_path_factory.mktemp("serve-console") / "serve.log"
    server = ServeProcess.start(
        [
            console_model_url,
            "--load-format",
            "tensorizer",
            "--model-loader-extra-config",
            json.dumps({"num_readers": READERS}),
            "--served-model-name",
            SERVED_NAME,
            "--device",
            "cpu",
            "--max-model-len",
            "2048",
            "--enable-lora",
            "--max-loras",
            "2",
            "--enable-runtime-lora-updating",
            "--lora-allowed-roots",
            str(adapter_root),
            "--shutdown-timeout",
            "5",
        ],
        log,
        api_key=API_KEY,
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    """One headless Chromium for the module; its log buffer is drained by each read."""
    try:
        driver = start_chromium(tmp_path_factory.mktemp("chromium"))
    except FileNotFoundError:
        pytest.fail(HINT, pytrace=False)
    try:
        yield driver
    finally:
        driver.quit()
