"""``tensorstream generate MODEL --prompt TEXT``: load a model and print completions.

Prompts run as one batch. ``--chat`` wraps each prompt in the model's chat
template. ``--lora NAME=PATH`` (repeatable) loads adapters; ``--lora-for I=NAME``
picks one per prompt (by default the first adapter applies to every prompt).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tensorstream.errors import ConfigError

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``generate`` options."""
    parser.add_argument("model", help="model dir, serialized dir/URI, built-in id or cached Hub id")
    parser.add_argument("--prompt", action="append", required=True, help="prompt (repeatable)")
    parser.add_argument("--chat", action="store_true", help="use the chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per completion")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, help="sampling seed")
    parser.add_argument(
        "--lora", action="append", default=[], metavar="NAME=PATH", help="LoRA adapter (repeatable)"
    )
    parser.add_argument(
        "--lora-for",
        action="append",
        default=[],
        metavar="INDEX=NAME",
        help="apply adapter NAME to prompt INDEX (0-based); 'base' for none",
    )
    parser.add_argument("--load-format", default="auto", help="auto, tensorizer, safetensors")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (the checkpoint's dtype; float32 on a CPU without fast bf16/fp16 matmuls), float16, bfloat16 or float32",
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:1 (default: CUDA if available)")
    parser.add_argument("--model-loader-extra-config", metavar="JSON", help="loader options")
    parser.add_argument("--keyfile", help="decryption key file for an encrypted model/adapters")
    parser.add_argument("--max-model-len", type=int, help="context length")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument(
        "--cpu-threads",
        type=int,
        help="torch threads for the model (default: CPUs this process may use, minus one)",
    )


def _loras(args: argparse.Namespace) -> dict[str, Any]:
    from tensorstream.engine.lora import LoRARequest

    loras: dict[str, Any] = {}
    for i, spec in enumerate(args.lora, start=1):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora {spec!r}: expected NAME=PATH")
        if name in loras or name == "base":
            raise ConfigError(f"--lora name {name!r} is used twice or reserved")
        loras[name] = LoRARequest(name, i, path)
    return loras


def _per_prompt(args: argparse.Namespace, loras: dict[str, Any]) -> list[Any] | None:
    if not loras:
        if args.lora_for:
            raise ConfigError("--lora-for needs at least one --lora NAME=PATH")
        return None
    first = next(iter(loras.values()))
    chosen: list[Any] = (
        [first] * len(args.prompt) if not args.lora_for else [None] * len(args.prompt)
    )
    for spec in args.lora_for:
        index, sep, name = spec.partition("=")
        if not sep or not index.isdigit() or int(index) >= len(args.prompt):
            raise ConfigError(
                f"--lora-for {spec!r}: expected INDEX=NAME with 0 <= INDEX < {len(args.prompt)}"
            )
        if name != "base" and name not in loras:
            raise ConfigError(f"--lora-for {spec!r}: no adapter {name!r}; known: {sorted(loras)}")
        chosen[int(index)] = None if name == "base" else loras[name]
    return chosen


def run(args: argparse.Namespace) -> int:
    """Load the model and print one completion per prompt.

    Raises:
        TensorStreamError: bad options, or the model cannot be loaded.
    """
    from tensorstream.engine import LLM, SamplingParams

    extra: dict[str, Any] = {}
    if args.model_loader_extra_config:
        try:
            extra = json.loads(args.model_loader_extra_config)
        except ValueError as exc:
            raise ConfigError(f"--model-loader-extra-config is not valid JSON: {exc}") from exc
        if not isinstance(extra, dict):
            raise ConfigError("--model-loader-extra-config must be a JSON object")
    if args.keyfile:
        extra["encryption_keyfile"] = args.keyfile
    loras = _loras(args)
    per_prompt = _per_prompt(args, loras)
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        model_loader_extra_config=extra or None,
        enable_lora=bool(loras),
        max_loras=max(1, len(loras)),
        max_lora_rank=512,
        max_model_len=args.max_model_len,
        trust_remote_code=args.trust_remote_code,
        seed=args.seed,
        cpu_threads=args.cpu_threads,
    )
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(conversations, params, lora_request=per_prompt)
    else:
        outputs = llm.generate(args.prompt, params, lora_request=per_prompt)
    for i, (prompt, out) in enumerate(zip(args.prompt, outputs, strict=True)):
        tag = f" [{per_prompt[i].lora_name}]" if per_prompt and per_prompt[i] else ""
        print(f"--- prompt {i}{tag}: {prompt}")
        print(out.outputs[0].text)
    return 0
