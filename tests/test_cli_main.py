"""The `tensorstream` entry point: version text, lazy subcommands, flag spelling."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tensorstream.cli import main as cli


def test_version_names_the_crypto_backend(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("tensorstream ")
    assert "crypto: " in out and "libsodium" in out


def test_tensorize_accepts_vllm_underscore_flags() -> None:
    argv = [
        "tensorize",
        "--model",
        "m",
        "serialize",
        "--serialized_directory=/x",
        "--suffix",
        "a_b",
    ]
    assert cli._normalized(argv) == [
        "tensorize",
        "--model",
        "m",
        "serialize",
        "--serialized-directory=/x",
        "--suffix",
        "a_b",
    ]
    # other commands keep their arguments untouched
    assert cli._normalized(["inspect", "--some_flag"]) == ["inspect", "--some_flag"]


def test_every_listed_subcommand_is_installed() -> None:
    import importlib

    for name, (module_name, _) in cli.SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        assert callable(module.configure) and callable(module.run), name


def test_help_imports_no_heavy_dependencies() -> None:
    code = (
        "import sys\n"
        "from tensorstream.cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('boto3', 'transformers', 'fastapi', 'peft') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_library_errors_exit_2_with_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.tensors"
    assert cli.main(["inspect", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and "Traceback" not in err
