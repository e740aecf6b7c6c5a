"""``tensorstream serve MODEL``: load a model and serve it over an OpenAI-compatible HTTP API.

The HTTP server starts listening at once and answers 503 while the weights
stream in (``/health`` included); a background thread builds the ``LLM``,
registers ``--lora-modules`` and then marks the server ready. SIGTERM/SIGINT
stop accepting connections, let running requests finish for up to
``--shutdown-timeout`` seconds, and exit 0. A failed load exits 1.

A ``vllm serve`` command line works as it is: every flag of vLLM's engine and
server is accepted (``engine/vllm_args.py``). Those that apply are honoured; those
that cannot apply to this engine are named once at WARNING; a value that cannot be
honoured (``--tensor-parallel-size 2``, ``--quantization awq``) is a one-line error
naming the flag. ``--model X`` (vLLM's older form) equals the positional MODEL, and
``--max_model_len`` equals ``--max-model-len``, as in vLLM. The address defaults to
vLLM's: every interface (``0.0.0.0``), port 8000.

The web console (``tensorstream.server.console``) is served at ``/`` unless
``--no-ui``; the start-up phases it draws are marked here (``/v1/load_stats``).

Example::

    tensorstream serve s3://my-bucket/vllm/facebook/opt-125m/v1 --load-format tensorizer \\
        --enable-lora --model-loader-extra-config '{"deserialization_kwargs": {"num_readers": 2}}'
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
import time
from typing import Any

from tensorstream.cli.flags import normalize_flags
from tensorstream.utils.process import process_age

__all__ = ["configure", "normalize_flags", "run"]

logger = logging.getLogger("tensorstream.serve")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``serve``'s arguments to ``parser`` (and, hidden, the rest of vLLM's)."""
    from tensorstream.cli.keys import add_key_options
    from tensorstream.engine.vllm_args import add_vllm_options

    parser.add_argument(
        "model",
        nargs="?",
        help="local directory, s3:// or http(s):// URI, Hugging Face id (from the cache), "
        "or the built-in 'smollm2-135m'",
    )
    parser.add_argument(
        "--model", dest="model_option", metavar="MODEL", help="same as MODEL (vLLM's older form)"
    )
    parser.add_argument(
        "--load-format", default="auto", help="auto (default), tensorizer or safetensors"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (the checkpoint's dtype; float32 on a CPU without fast bf16/fp16 matmuls), float16, bfloat16 or float32 (default auto)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="name clients use as 'model' (default MODEL)",
    )
    parser.add_argument(
        "--enable-lora", action=argparse.BooleanOptionalAction, default=False, help="allow LoRA"
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=URI",
        help='adapters to load at start: name=URI or JSON {"name": ..., "path": ...}',
    )
    parser.add_argument("--max-loras", type=int, default=1, help="adapters active at once")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="highest adapter rank")
    parser.add_argument(
        "--model-loader-extra-config",
        default=None,
        help='JSON loader options, e.g. \'{"deserialization_kwargs": {"num_readers": 2}}\'',
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: all)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="require 'Authorization: Bearer KEY' (default $TENSORSTREAM_API_KEY or $VLLM_API_KEY)",
    )
    parser.add_argument(
        "--max-model-len", type=_token_count, default=None, help="context length (e.g. 4096, 4k)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="most sequences generated at once"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=_token_count,
        default=None,
        help="prompt tokens prefilled per step (native engine; default 512)",
    )
    parser.add_argument(
        "--model-impl",
        default="auto",
        type=_model_impl,
        help="auto (native model code for Llama-family architectures, else transformers), "
        "native (vLLM's 'vllm' is accepted as its name) or transformers",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for unseeded sampling")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: auto)")
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch threads for the model (default: CPUs this process may use, minus one)",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory, if not beside")
    parser.add_argument(
        "--chat-template", default=None, help="chat template file (or text) to use instead"
    )
    parser.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--revision", default=None, help="Hub revision for Hub ids")
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests may take to finish after SIGTERM (default 30)",
    )
    parser.add_argument(
        "--log-level",
        "--uvicorn-log-level",
        dest="log_level",
        default="info",
        help="uvicorn log level (default info)",
    )
    _add_hardening_options(parser)
    add_key_options(parser, for_writing=False)
    add_vllm_options(parser, _defined(parser))
    parser.epilog = (
        "Every other `vllm serve` flag is accepted too (--tensor-parallel-size/-tp, "
        "--gpu-memory-utilization, --enforce-eager, --swap-space, --block-size, "
        "--enable-prefix-caching, --quantization, ...): a value this engine cannot honour is "
        "an error naming the flag; a flag with no effect here is named once at WARNING. "
        "--max_model_len spellings work as in vLLM."
    )


def _add_hardening_options(parser: argparse.ArgumentParser) -> None:
    """What clients may make the server do (tensorstream.server.security/prompts/protocol)."""
    parser.add_argument(
        "--enable-runtime-lora-updating",
        action="store_true",
        help="allow /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1); loads only from --lora-allowed-roots",
    )
    parser.add_argument(
        "--lora-allowed-roots",
        action="append",
        default=None,
        metavar="ROOT",
        help="where runtime adapters may be loaded from: local dir, s3://bucket/prefix or "
        "https://host/prefix (repeatable, or comma-separated)",
    )
    parser.add_argument(
        "--max-seqs-per-request",
        type=int,
        default=256,
        help="most prompts x n in one request (default 256)",
    )
    parser.add_argument(
        "--chat-template-timeout",
        type=float,
        default=10.0,
        help="seconds a chat template may take to render (default 10)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="accept a chat_template sent in a request (as vLLM)",
    )
    parser.add_argument(
        "--no-ui",
        dest="ui",
        action="store_false",
        help="do not serve the web console at / (default: served, behind --api-key)",
    )
    parser.add_argument(
        "--request-header-timeout",
        type=float,
        default=10.0,
        help="close connections whose request headers are incomplete after this many "
        "seconds (default 10)",
    )


def _defined(parser: argparse.ArgumentParser) -> set[str]:
    """Option names (Python spelling) ``parser`` already has."""
    names = set()
    for action in parser._actions:
        for flag in action.option_strings:
            if flag.startswith("--"):
                names.add(flag[2:].replace("-", "_"))
        names.add(action.dest)
    names.add("model")
    return names


def _token_count(text: str) -> int | None:
    """vLLM's token counts: ``4096``, ``4k`` (x1000), ``4K`` (x1024), ``auto`` / ``-1`` (None).

    Example:
        >>> _token_count("2K"), _token_count("2.5k"), _token_count("auto")
        (2048, 2500, None)
    """
    value = text.strip()
    if value == "-1" or value.lower() == "auto":
        return None
    decimal = {"k": 10**3, "m": 10**6, "g": 10**9}
    binary = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if value and value[-1] in decimal:
            return int(float(value[:-1]) * decimal[value[-1]])
        if value and value[-1] in binary:
            return int(value[:-1]) * binary[value[-1]]
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a token count: {text!r} (e.g. 4096, 4k = 4000, 4K = 4096)"
        ) from None


def _model_impl(value: str) -> str:
    """``--model-impl``: vLLM's ``vllm`` (its own model code) is our ``native``."""
    choice = value.strip().lower()
    choice = "native" if choice == "vllm" else choice
    if choice not in ("auto", "native", "transformers"):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a model implementation; use auto, native (or vllm) or transformers"
        )
    return choice


def _checked(args: argparse.Namespace) -> dict[str, Any]:
    """Validate the options before the server starts; returns the extra loader config.

    Raises:
        ConfigError: a value that cannot be honoured, naming the flag.
    """
    from tensorstream.cli.keys import decryption_from_args
    from tensorstream.engine.vllm_args import apply_vllm_options, vllm_options_given
    from tensorstream.errors import ConfigError
    from tensorstream.utils.jsonarg import json_object

    if args.model_option and args.model and args.model_option != args.model:
        raise ConfigError(
            f"MODEL {args.model!r} and --model {args.model_option!r} differ; give one of them"
        )
    args.model = args.model or args.model_option
    if not args.model:
        raise ConfigError("serve needs a model: tensorstream serve MODEL (or --model MODEL)")
    if args.max_num_seqs < 1:
        raise ConfigError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise ConfigError(f"--cpu-threads must be >= 1, got {args.cpu_threads}")
    keys = (
        args.api_key
        or [
            k for k in (os.environ.get("TENSORSTREAM_API_KEY"), os.environ.get("VLLM_API_KEY")) if k
        ][:1]
    )
    if len(keys) > 1:
        raise ConfigError(f"--api-key: {len(keys)} keys given; one key is supported, give one")
    args.api_key = keys[0] if keys else None
    names = args.served_model_name or []
    if len(names) > 1:
        logger.warning(
            "--served-model-name: only the first name (%r) is served; %s not",
            names[0],
            ", ".join(repr(n) for n in names[1:]),
        )
    args.served_model_name = names[0] if names else None
    apply_vllm_options(vllm_options_given(args), "cli")
    extra = json_object(args.model_loader_extra_config, "--model-loader-extra-config")
    if args.keyfile:
        given = extra.get("encryption_keyfile")
        if given and given != args.keyfile:
            raise ConfigError(
                "--keyfile and encryption_keyfile in --model-loader-extra-config name "
                "different key files; give one"
            )
        extra["encryption_keyfile"] = args.keyfile  # adapters beside the model use it too
    elif args.passphrase_env:
        kwargs = dict(extra.get("deserialization_kwargs") or {})
        kwargs["encryption"] = decryption_from_args(args)
        extra["deserialization_kwargs"] = kwargs
    if getattr(args, "require_manifest", False):
        kwargs = dict(extra.get("deserialization_kwargs") or {})
        kwargs["require_manifest"] = True
        extra["deserialization_kwargs"] = kwargs
    return extra


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT.

    Returns:
        0 after a graceful shutdown, 1 when the model failed to load.

    Raises:
        ConfigError: an option that cannot be honoured (before anything starts).
    """
    entered = time.perf_counter()
    import uvicorn

    from tensorstream.errors import ConfigError
    from tensorstream.server.adapters import parse_lora_modules
    from tensorstream.server.app import ServeOptions, ServerState, create_app
    from tensorstream.server.protocol import header_timeout_protocol
    from tensorstream.server.security import runtime_lora_updating_enabled

    extra = _checked(args)
    for flag in ("max_seqs_per_request", "chat_template_timeout", "request_header_timeout"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    modules = parse_lora_modules(args.lora_modules)
    if modules and not args.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    options = ServeOptions(
        served_model_name=args.served_model_name or args.model,
        api_key=args.api_key or None,
        max_num_seqs=args.max_num_seqs,
        enable_lora=args.enable_lora,
        runtime_lora_updating=runtime_lora_updating_enabled(args.enable_runtime_lora_updating),
        lora_allowed_roots=tuple(args.lora_allowed_roots or ()),
        max_seqs_per_request=args.max_seqs_per_request,
        chat_template_timeout=args.chat_template_timeout,
        trust_request_chat_template=args.trust_request_chat_template,
        ui=args.ui,
    )
    state = ServerState(options)
    timeline = state.timeline  # what /v1/load_stats and the console show
    timeline.add("startup", "interpreter, torch import, CLI", 0.0, timeline.at(entered))
    app = create_app(state)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        http=header_timeout_protocol(args.request_header_timeout),
        # The engine thread runs the model; more event-loop threads would not help.
        workers=1,
    )
    server = _graceful_server_class()(config)
    started = time.perf_counter()
    failed = threading.Event()
    where = "all interfaces" if args.host in ("0.0.0.0", "::", "") else args.host
    logger.info(
        "serving %s on http://%s:%d/v1 (%s); answering 503 until the model is loaded",
        args.model,
        args.host,
        args.port,
        where,
    )

    def load() -> None:
        try:
            import tensorstream.engine  # noqa: F401 - timed apart from the load

            timeline.add(
                "imports", "server and engine imports", timeline.at(entered), timeline.now()
            )
            llm_started = timeline.now()
            llm = _build_llm(args, extra)
            timeline.model_loaded(llm.load_stats, llm_started, timeline.now(), _readers(extra))
            state.attach(llm, ready=False)
            for name, path in modules:
                adapter_started = timeline.now()
                asyncio.run(state.adapters.load(name, path))
                timeline.adapter_loaded(name, path, "startup", adapter_started, timeline.now())
                logger.info("adapter %s loaded from %s", name, path)
            state.mark_ready()
        except BaseException as exc:  # noqa: BLE001 - reported, then the server exits
            logger.error("cannot serve %s: %s", args.model, exc)
            state.fail(str(exc))
            failed.set()
            server.should_exit = True
            return
        age = process_age()
        logger.info(
            "ready: %s as %r (%s, usable after %.2f s); %.2f s since process start; "
            "http://%s:%d/v1",
            args.model,
            options.served_model_name,
            llm.load_stats.describe(),
            llm.load_stats.seconds,
            age if age is not None else time.perf_counter() - started,
            args.host,
            args.port,
        )

    # Daemon: a SIGTERM during a long load must not wait for the load to end.
    loader = threading.Thread(target=load, name="model-loader", daemon=True)
    loader.start()
    try:
        server.run()
    finally:
        state.close(timeout=5.0)
    if failed.is_set():
        return 1
    logger.info("server stopped")
    return 0


def _readers(extra: dict[str, Any]) -> int | None:
    """Parallel readers the loader config asks for (None: the source chooses)."""
    kwargs = extra.get("deserialization_kwargs")
    value = kwargs.get("num_readers") if isinstance(kwargs, dict) else None
    value = value if value is not None else extra.get("num_readers")
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _graceful_server_class() -> type:
    import contextlib
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, minus re-raising the stop signal after a clean shutdown.

        uvicorn re-raises a captured SIGTERM once it has shut down, so the process
        dies *by* the signal (status -15). A graceful stop should exit 0.
        """

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            signals = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def _on_signal(self, sig: int, _frame: Any) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C stops waiting for requests
            logger.info("received %s; finishing running requests", signal.Signals(sig).name)
            self.should_exit = True

    return GracefulServer


def _build_llm(args: argparse.Namespace, extra: dict[str, Any]) -> Any:
    from tensorstream.engine import LLM
    from tensorstream.errors import KeyRequiredError

    try:
        return LLM(
            args.model,
            load_format=args.load_format,
            dtype=args.dtype,
            enable_lora=args.enable_lora,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            model_loader_extra_config=extra,
            seed=args.seed,
            device=args.device,
            tokenizer=args.tokenizer,
            max_model_len=args.max_model_len,
            trust_remote_code=args.trust_remote_code,
            revision=args.revision,
            max_num_batched_tokens=args.max_num_batched_tokens,
            model_impl=args.model_impl,
            cpu_threads=args.cpu_threads,
            chat_template=args.chat_template,
            tensor_parallel_size=int(getattr(args, "vllm_option__tensor_parallel_size", 1) or 1),
        )
    except KeyRequiredError as exc:
        # Say how to give the key on this command line, not as LLM keyword arguments.
        cause = exc.__cause__ if isinstance(exc.__cause__, KeyRequiredError) else exc
        raise KeyRequiredError(
            f"{cause}; pass --keyfile PATH or --passphrase-env VAR to tensorstream serve "
            '(or "encryption_keyfile" in --model-loader-extra-config)'
        ) from exc
