"""The smaller CLI defects of issue #16, each replayed as a user ran it."""

from __future__ import annotations

import json

import pytest
import torch

from tensorstream.cli.main import main
from tensorstream.errors import ConfigError, SourceNotFoundError


@pytest.fixture
def tiny_tensors(tmp_path):
    from tensorstream import TensorSerializer

    path = tmp_path / "tiny.tensors"
    with TensorSerializer(str(path)) as writer:
        writer.write_state_dict({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)})
    return path


@pytest.mark.parametrize("existing", [False, True])
def test_serialize_into_a_directory_writes_model_tensors(tiny_tensors, tmp_path, existing):
    """Regression: ``serialize SRC out_dir/`` wrote a file named ``out_dir``."""
    out = tmp_path / "out_dir"
    if existing:
        out.mkdir()
        dest = str(out)
    else:
        dest = str(out) + "/"
    assert main(["serialize", str(tiny_tensors), dest]) == 0
    assert (out / "model.tensors").is_file()
    from tensorstream import TensorDeserializer

    with TensorDeserializer(str(out / "model.tensors"), device="cpu") as reader:
        assert torch.equal(reader["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_a_flag_typo_prints_the_subcommands_usage_and_a_suggestion(capsys):
    """Regression: the top-level usage was printed, with no suggestion."""
    with pytest.raises(SystemExit) as info:
        main(["tensorize", "--model", "m", "serialize", "--serialized-directori", "/tmp/x"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: tensorstream tensorize serialize" in err
    assert "did you mean --serialized-directory?" in err


def test_an_offline_hub_id_for_an_adapter_says_how_to_get_an_adapter(monkeypatch, tmp_path):
    """Regression: the message suggested the built-in *model*."""
    from tensorstream.engine.adapter_files import _local_dir

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(SourceNotFoundError) as info:
        _local_dir("someone/sql-lora-adapter")
    message = str(info.value)
    assert "LoRA adapter 'someone/sql-lora-adapter'" in message
    assert "adapter_config.json" in message and "built-in model" not in message


def test_tensorize_serialize_dtype_suffix_and_overwrite(tmp_path, capsys):
    """Regressions: ``--dtype float16`` left config.json saying bfloat16 (and loaded back
    as bf16); re-serializing under the same ``--suffix`` silently overwrote; the suffix
    line was not the first line."""
    from tensorstream import LLM

    argv = ["tensorize", "--model", "smollm2-135m", "--dtype", "float16", "serialize"]
    argv += ["--serialized-directory", str(tmp_path), "--suffix", "v1"]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "suffix: v1"
    out = tmp_path / "vllm" / "smollm2-135m" / "v1"
    config = json.loads((out / "config.json").read_text())
    assert {config.get(k) for k in ("torch_dtype", "dtype") if k in config} == {"float16"}
    llm = LLM(str(out), dtype="float16", cpu_threads=1)  # auto may compute in float32
    assert llm.dtype == torch.float16

    with pytest.raises(ConfigError, match="already exists .*--overwrite"):
        main_raising(argv)
    assert main([*argv, "--overwrite"]) == 0


def main_raising(argv: list[str]) -> None:
    """Run the command's ``run`` directly, so the ConfigError is seen (main prints it)."""
    from tensorstream.cli.main import build_parser

    args = build_parser(argv).parse_args(argv)
    args._run(args)


def test_the_guides_script_takes_vllm_engine_flags(tmp_path, capsys):
    """vLLM's tensorize_vllm_model.py accepts every EngineArgs flag before the subcommand."""
    argv = ["tensorize", "--model", "smollm2-135m", "--quantization", "awq", "--enforce-eager"]
    argv += ["serialize", "--serialized-directory", str(tmp_path)]
    assert main(argv) == 2
    assert "--quantization awq cannot be honoured" in capsys.readouterr().err
    from tensorstream.cli.main import build_parser

    ok = ["tensorize", "--model", "m", "--gpu-memory-utilization", "0.9", "--enforce-eager"]
    ok += ["-tp", "1", "deserialize", "--serialized-directory", str(tmp_path)]
    args = build_parser(ok).parse_args(ok)
    assert args.tensorize_command == "deserialize"
