"""``tensorstream serve MODEL``: load a model and serve it over an OpenAI-compatible HTTP API.

The HTTP server starts listening at once and answers 503 while the weights
stream in (``/health`` included); a background thread builds the ``LLM``,
registers ``--lora-modules`` and then marks the server ready. SIGTERM/SIGINT
stop accepting connections, let running requests finish for up to
``--shutdown-timeout`` seconds, and exit 0. A failed load exits 1.

Example::

    tensorstream serve s3://my-bucket/vllm/facebook/opt-125m/v1 --load-format tensorizer \\
        --enable-lora --model-loader-extra-config '{"deserialization_kwargs": {"num_readers": 2}}'
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
from typing import Any

__all__ = ["configure", "run"]

logger = logging.getLogger("tensorstream.serve")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``serve``'s arguments to ``parser``."""
    parser.add_argument(
        "model",
        help="local directory, s3:// or http(s):// URI, Hugging Face id (from the cache), "
        "or the built-in 'smollm2-135m'",
    )
    parser.add_argument(
        "--load-format", default="auto", help="auto (default), tensorizer or safetensors"
    )
    parser.add_argument(
        "--dtype", default="auto", help="auto, float16, bfloat16 or float32 (default auto)"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use as 'model' (default MODEL)"
    )
    parser.add_argument("--enable-lora", action="store_true", help="allow LoRA adapters")
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
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default $TENSORSTREAM_API_KEY, "
        "else $VLLM_API_KEY)",
    )
    # Server hardening (tensorstream.server.security / prompts / protocol).
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
        action="store_true",
        help="accept a chat_template sent in a request",
    )
    parser.add_argument(
        "--request-header-timeout",
        type=float,
        default=10.0,
        help="close connections whose request headers are incomplete after this many "
        "seconds (default 10)",
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="context length")
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="most sequences generated at once"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for unseeded sampling")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: auto)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory, if not beside")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--revision", default=None, help="Hub revision for Hub ids")
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests may take to finish after SIGTERM (default 30)",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn log level (default info)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT.

    Returns:
        0 after a graceful shutdown, 1 when the model failed to load.
    """
    import uvicorn

    from tensorstream.errors import ConfigError
    from tensorstream.server.adapters import parse_lora_modules
    from tensorstream.server.app import ServeOptions, ServerState, create_app
    from tensorstream.server.protocol import header_timeout_protocol
    from tensorstream.server.security import resolve_api_key, runtime_lora_updating_enabled

    if args.max_num_seqs < 1:
        raise ConfigError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    for flag in ("max_seqs_per_request", "chat_template_timeout", "request_header_timeout"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    modules = parse_lora_modules(args.lora_modules)
    if modules and not args.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    options = ServeOptions(
        served_model_name=args.served_model_name or args.model,
        api_key=resolve_api_key(args.api_key),
        max_num_seqs=args.max_num_seqs,
        enable_lora=args.enable_lora,
        runtime_lora_updating=runtime_lora_updating_enabled(args.enable_runtime_lora_updating),
        lora_allowed_roots=tuple(args.lora_allowed_roots or ()),
        max_seqs_per_request=args.max_seqs_per_request,
        chat_template_timeout=args.chat_template_timeout,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    state = ServerState(options)
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

    def load() -> None:
        try:
            llm = _build_llm(args)
            state.attach(llm, ready=False)
            for name, path in modules:
                asyncio.run(state.adapters.load(name, path))
                logger.info("adapter %s loaded from %s", name, path)
            state.mark_ready()
        except BaseException as exc:  # noqa: BLE001 - reported, then the server exits
            logger.error("cannot serve %s: %s", args.model, exc)
            state.fail(str(exc))
            failed.set()
            server.should_exit = True
            return
        stats = llm.load_stats
        logger.info(
            "ready: %s as %r, %.1f MB of weights in %.2f s (read %.2f s, %.2f GB/s); "
            "%.2f s since start; http://%s:%d/v1",
            args.model,
            options.served_model_name,
            stats.bytes / 1e6,
            stats.seconds,
            stats.read_seconds,
            stats.gb_per_s,
            time.perf_counter() - started,
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


def _build_llm(args: argparse.Namespace) -> Any:
    from tensorstream.engine import LLM

    return LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        model_loader_extra_config=args.model_loader_extra_config,
        seed=args.seed,
        device=args.device,
        tokenizer=args.tokenizer,
        max_model_len=args.max_model_len,
        trust_remote_code=args.trust_remote_code,
        revision=args.revision,
    )
