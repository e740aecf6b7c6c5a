"""Bad inputs to the workflow and its commands give clear errors (and exit status 2 on the CLI)."""

from __future__ import annotations

import shutil

import pytest

from tensorstream.cli.tensorize import main as tensorize_main
from tensorstream.cli.tensorize import normalize_flags
from tensorstream.engine import LLM
from tensorstream.engine.tensorize import (
    LoadOptions,
    SerializeOptions,
    check_deserialization_kwargs,
    check_serialization_kwargs,
    load_serialized,
    model_artifacts,
    output_directory,
    serialize_model,
)
from tensorstream.errors import ConfigError, SourceNotFoundError


@pytest.fixture(scope="module")
def tensorized(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("tensorized")
    return serialize_model(SerializeOptions(str(tiny_llama), str(root), suffix="v1")).directory


def test_kwargs_are_checked():
    assert check_serialization_kwargs('{"limit_cpu_concurrency": 2}') == {
        "limit_cpu_concurrency": 2
    }
    with pytest.raises(ConfigError, match=r"\['bogus'\].*accepted keys: .*limit_cpu_concurrency"):
        check_serialization_kwargs({"bogus": 1})
    with pytest.raises(ConfigError, match="use --keyfile"):
        check_serialization_kwargs({"encryption": 1})
    with pytest.raises(ConfigError, match="JSON object"):
        check_serialization_kwargs("[1]")
    assert check_deserialization_kwargs({"num_readers": 2}) == {"num_readers": 2}
    with pytest.raises(ConfigError, match=r"accepted keys: .*num_readers"):
        check_deserialization_kwargs({"num_reader": 2})


def test_output_paths_and_artifacts(tmp_path, tiny_llama):
    assert output_directory("s3://b/", "org/m", "v1") == "s3://b/vllm/org/m/v1"
    assert output_directory(str(tmp_path), str(tiny_llama), "v1") == str(
        tmp_path / "vllm" / tiny_llama.name / "v1"
    )
    with pytest.raises(ConfigError, match="cannot form an output path"):
        output_directory(str(tmp_path), "org/m", "../x")
    names = [p.name for p in model_artifacts(tiny_llama)]
    assert "config.json" in names and "tokenizer.json" in names
    assert not any(n.endswith(".safetensors") for n in names)


def test_serialized_model_errors(tensorized, tmp_path, tiny_llama):
    # Missing config.json and no --model to take it from.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(f"{tensorized}/model.tensors", bare / "model.tensors")
    with pytest.raises(SourceNotFoundError, match="no config.json"):
        load_serialized(LoadOptions(serialized_directory=str(bare)))
    # ... with --model, config comes from there and the weights from the bare directory.
    llm = load_serialized(
        LoadOptions(serialized_directory=str(bare), model=str(tiny_llama), device="cpu")
    )
    assert llm.load_format == "tensorizer" and llm.load_stats.uri.startswith(str(bare))
    with pytest.raises(ConfigError, match="not both"):
        load_serialized(
            LoadOptions(
                serialized_directory=tensorized, path_to_tensors=f"{tensorized}/model.tensors"
            )
        )
    with pytest.raises(ConfigError, match="needs --path-to-tensors"):
        load_serialized(LoadOptions())
    with pytest.raises(ConfigError, match="unknown load_format 'bogus'"):
        LLM(tensorized, load_format="bogus")
    with pytest.raises(ConfigError, match=r"\['bogus_key'\]"):
        LLM(tensorized, model_loader_extra_config={"bogus_key": 1})


def test_deserialize_honours_flags(tensorized):
    llm = load_serialized(
        LoadOptions(
            path_to_tensors=f"{tensorized}/model.tensors",
            dtype="bfloat16",
            num_readers=2,
            verify_hash=True,
            deserialization_kwargs={"use_mmap": False},
            device="cpu",
        )
    )
    assert {p.dtype for p in llm.model.parameters()} == {__import__("torch").bfloat16}


def test_cli_errors(tmp_path, capsys, tiny_llama):
    assert normalize_flags(["--serialized_directory=x", "--suffix", "a_b"]) == [
        "--serialized-directory=x",
        "--suffix",
        "a_b",
    ]
    assert (
        tensorize_main(
            [
                "--model",
                str(tiny_llama),
                "-tp",
                "0",
                "serialize",
                "--serialized-directory",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "--tensor-parallel-size must be >= 1" in capsys.readouterr().err
    assert (
        tensorize_main(
            [
                "--model",
                str(tiny_llama),
                "serialize",
                "--serialized-directory",
                str(tmp_path),
                "--serialization-kwargs",
                '{"nope": 1}',
            ]
        )
        == 2
    )
    assert "accepted keys" in capsys.readouterr().err
    assert not (tmp_path / "vllm").exists()
    assert tensorize_main(["deserialize", "--serialized-directory", str(tmp_path / "missing")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_generate_cli_with_loras(tiny_llama, adapters, capsys):
    from tensorstream.cli.main import main

    status = main(
        [
            "generate",
            str(tiny_llama),
            "--prompt",
            "hello",
            "--prompt",
            "there",
            "--max-tokens",
            "3",
            "--lora",
            f"a1={adapters['a1']}",
            "--lora",
            f"a2={adapters['a2']}",
            "--lora-for",
            "1=a2",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "--- prompt 0: hello" in out and "--- prompt 1 [a2]: there" in out
    assert main(["generate", str(tiny_llama), "--prompt", "x", "--lora", "bad"]) == 2


def test_serialize_deserialize_commands(tiny_llama, tmp_path, capsys):
    from tensorstream.cli.main import main

    dest = tmp_path / "m.tensors"
    assert main(["serialize", str(tiny_llama), str(dest), "--align", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["deserialize", str(dest), "--num-readers", "2", "--verify-hash"]) == 0
    assert "GB/s" in capsys.readouterr().out
    direct = tmp_path / "direct.tensors"  # O_DIRECT writes the same bytes
    assert (
        main(["serialize", str(tiny_llama), str(direct), "--align", "1", "--direct-io", "on"]) == 0
    )
    assert direct.read_bytes() == dest.read_bytes()
