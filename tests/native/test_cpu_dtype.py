"""dtype="auto" on a CPU without fast bfloat16/float16 matmuls computes in float32."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tensorstream.engine import LLM, SamplingParams, cpu_dtype
from tensorstream.engine.build import resolve_dtype

SMOL = SimpleNamespace(
    dtype="bfloat16", hidden_size=576, num_hidden_layers=30, vocab_size=49152,
    intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
    tie_word_embeddings=True,
)  # fmt: skip


@pytest.fixture
def no_fast_half(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "cpu_matmul_supported", lambda dtype: dtype == torch.float32)


def test_auto_picks_float32_where_bf16_is_slow(no_fast_half, caplog):
    with caplog.at_level(logging.INFO, "tensorstream.engine"):
        assert resolve_dtype("auto", SMOL, "cpu") is torch.float32
        assert resolve_dtype(None, SMOL) is torch.float32  # no device: the CPU
    assert "computing in float32" in caplog.text and "dtype='bfloat16'" in caplog.text
    half = SimpleNamespace(**{**vars(SMOL), "dtype": "float16"})
    assert resolve_dtype("auto", half, "cpu") is torch.float32


def test_auto_keeps_the_checkpoint_dtype_otherwise(no_fast_half, monkeypatch):
    # An explicit dtype is honoured; another device keeps the checkpoint's dtype.
    assert resolve_dtype("bfloat16", SMOL, "cpu") is torch.bfloat16
    assert resolve_dtype(torch.float16, SMOL, "cpu") is torch.float16
    assert resolve_dtype("auto", SMOL, "meta") is torch.bfloat16
    assert resolve_dtype("auto", SimpleNamespace(dtype="float32"), "cpu") is torch.float32
    monkeypatch.setattr(cpu_dtype, "cpu_matmul_supported", lambda dtype: True)
    assert resolve_dtype("auto", SMOL, "cpu") is torch.bfloat16


def test_auto_keeps_bf16_when_float32_would_not_fit(no_fast_half, monkeypatch, caplog):
    params = cpu_dtype.estimated_parameters(SMOL)
    # float32 weights would take more than half of what is available: stay, and say so.
    monkeypatch.setattr(cpu_dtype, "_available_bytes", lambda: params * 4 * 2 * 2 - 1)
    with caplog.at_level(logging.WARNING, "tensorstream.engine"):
        assert resolve_dtype("auto", SMOL, "cpu") is torch.bfloat16
    assert "may not fit" in caplog.text and "dtype='float32'" in caplog.text
    monkeypatch.setattr(cpu_dtype, "_available_bytes", lambda: params * 4 * 2 * 2)
    assert resolve_dtype("auto", SMOL, "cpu") is torch.float32
    # No size to judge by: the checkpoint's dtype stays.
    assert resolve_dtype("auto", SimpleNamespace(dtype="bfloat16"), "cpu") is torch.bfloat16


def test_parameter_estimate_matches_real_models(tiny, smollm2_dir):
    from tensorstream.engine.models.config import NativeConfig, read_config_json

    for path in (smollm2_dir, tiny("llama"), tiny("qwen2"), tiny("mistral")):
        config = NativeConfig.from_dict(read_config_json(path), source=str(path))
        llm = LLM(str(path), device="cpu", dtype="float32")
        real = sum(p.numel() for p in llm.model.parameters())
        estimate = cpu_dtype.estimated_parameters(config)
        # Norm weights and biases are left out of the estimate: well under 1% of a model.
        assert abs(estimate - real) / real < 0.01, (path, estimate, real)


def test_probe_follows_torch():
    expected = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert cpu_dtype.cpu_matmul_supported(torch.bfloat16) is expected
    assert cpu_dtype.cpu_matmul_supported(torch.float32) is True


def test_llm_runs_float32_decided_once(no_fast_half, tiny, tmp_path, caplog):
    model = tmp_path / "bf16-llama"
    shutil.copytree(tiny("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (model / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, "tensorstream"):
        llm = LLM(str(model), device="cpu")
    assert llm.dtype is torch.float32
    assert {p.dtype for p in llm.model.parameters()} == {torch.float32}
    assert caplog.text.count("computing in float32") == 1  # decided once, not again after the load
    reference = LLM(str(model), device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": [1, 504, 3458, 5]}
    got = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert got == reference.generate(prompt, params)[0].outputs[0].token_ids


def test_serialize_keeps_the_checkpoint_dtype(no_fast_half, tiny, tmp_path):
    """A file is written once and served anywhere: tensorize writes the checkpoint's dtype."""
    from tensorstream import TensorDeserializer
    from tensorstream.engine.tensorize import SerializeOptions, serialize_model

    model = tmp_path / "bf16-llama"
    shutil.copytree(tiny("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (model / "config.json").write_text(json.dumps(config))
    assert resolve_dtype("auto", SMOL, "cpu") is torch.float32  # what this CPU would run
    result = serialize_model(
        SerializeOptions(model=str(model), serialized_directory=str(tmp_path / "out"))
    )
    with TensorDeserializer(str(Path(result.directory, "model.tensors")), device="cpu") as tensors:
        assert {t.dtype for t in tensors.values() if t.is_floating_point()} == {torch.bfloat16}
    written = json.loads(Path(result.directory, "config.json").read_text())
    assert written["dtype"] == "bfloat16"
