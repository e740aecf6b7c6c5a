"""The README's Python examples run as written, and its first lines are the two commands."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_starts_with_the_two_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, flags=re.S)
    assert first_block is not None
    lines = [ln.split("#")[0].strip() for ln in first_block.group(1).splitlines()]
    assert lines[:2] == ["make demo", "make test"]
    assert README.index("make demo") < README.index("## ")


def test_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, tmp_path: Path) -> None:
    code = BLOCKS[index].replace("/tmp/", f"{tmp_path}/")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr


def test_readme_cli_commands_exist() -> None:
    from tensorstream.cli.main import SUBCOMMANDS

    bash = "\n".join(re.findall(r"```bash\n(.*?)```", README, flags=re.S))
    used = set(re.findall(r"^tensorstream (\w+)", bash, flags=re.M))
    assert "serve" in used
    assert used <= set(SUBCOMMANDS), used - set(SUBCOMMANDS)
