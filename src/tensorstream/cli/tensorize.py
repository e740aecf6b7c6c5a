"""``tensorstream tensorize``: vLLM's ``tensorize_vllm_model.py`` grammar, every flag honoured.

::

    tensorstream tensorize --model M [engine flags] [--lora-path P] serialize \\
        --serialized-directory DIR_OR_S3 [--suffix S] [--serialization-kwargs JSON] [--keyfile K]
    tensorstream tensorize [--model M] [engine flags] [--lora-path P] deserialize \\
        (--path-to-tensors URI | --serialized-directory DIR) [--keyfile K] [--num-readers N]
        [--verify-hash] [--deserialization-kwargs JSON] [--s3-access-key-id ...]

Engine flags go before the subcommand, as in the guide. ``examples/features/
tensorize_vllm_model.py`` calls :func:`main` here, so both spellings run the same
code; the work itself is in ``tensorstream.engine.tensorize``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from tensorstream.cli.flags import normalize_flags
from tensorstream.errors import ConfigError

__all__ = ["configure", "main", "normalize_flags", "run"]

_DEFAULT_PROMPT = "What is the capital of France?"


def _add_s3_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "S3 (default: S3_ACCESS_KEY_ID, S3_SECRET_ACCESS_KEY, S3_ENDPOINT_URL)"
    )
    group.add_argument("--s3-access-key-id", metavar="KEY", help="S3 access key id")
    group.add_argument("--s3-secret-access-key", metavar="SECRET", help="S3 secret access key")
    group.add_argument("--s3-endpoint", metavar="URL", help="S3 endpoint URL")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags and the ``serialize`` / ``deserialize`` subcommands."""
    engine = parser.add_argument_group("engine (before the subcommand)")
    engine.add_argument(
        "--model", help="model id (built-in, HF cache), local dir or serialized dir/URI"
    )
    engine.add_argument("--dtype", default="auto", help="auto, float16, bfloat16, float32")
    engine.add_argument("--revision", help="Hugging Face revision for Hub ids")
    engine.add_argument("--trust-remote-code", action="store_true", help="allow model code")
    engine.add_argument("--served-model-name", help="name the model is reported under")
    engine.add_argument(
        "--model-loader-extra-config",
        metavar="JSON",
        help="tensorizer options as JSON (tensorizer_uri, num_readers, ...)",
    )
    engine.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, help="serialize: write N rank files"
    )
    engine.add_argument("--max-model-len", type=int, help="context length for deserialize")
    engine.add_argument("--device", help="cpu, cuda, cuda:1 (default: CUDA if available)")
    engine.add_argument(
        "--lora-path", help="LoRA adapter (PEFT dir) to serialize with, or load with, the model"
    )
    from tensorstream.engine.vllm_args import add_vllm_options

    # The guide's script takes every vLLM engine flag here; so do we (checked in run()).
    own = {f[2:].replace("-", "_") for act in parser._actions for f in act.option_strings}
    add_vllm_options(parser, own | {"model"})
    sub = parser.add_subparsers(dest="tensorize_command", metavar="{serialize,deserialize}")
    sub.required = True

    ser = sub.add_parser("serialize", help="write the model as model.tensors plus its config files")
    ser.add_argument("--serialized-directory", required=True, help="local dir or s3:// root")
    ser.add_argument("--suffix", help="version component of the path (default: random hex)")
    ser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a model already serialized under this --suffix (refused otherwise)",
    )
    ser.add_argument("--serialization-kwargs", metavar="JSON", help="TensorSerializer kwargs")
    ser.add_argument(
        "--keyfile",
        help="encrypt model and adapter with the key at this path (local or s3://); "
        "a new random key is written there if it does not exist",
    )
    _add_s3_flags(ser)

    de = sub.add_parser("deserialize", help="load a serialized model, report GB/s, generate")
    de.add_argument("--path-to-tensors", help="URI of model.tensors (local, s3://, http(s)://)")
    de.add_argument("--serialized-directory", help="directory holding model.tensors")
    de.add_argument("--tensorizer-uri", help="same as --path-to-tensors")
    de.add_argument("--keyfile", help="decryption key file (local, s3://, http(s)://)")
    de.add_argument("--encryption-keyfile", help="same as --keyfile")
    de.add_argument("--deserialization-kwargs", metavar="JSON", help="TensorDeserializer kwargs")
    de.add_argument(
        "--num-readers",
        type=int,
        help="parallel readers (default: 4; locally min(4, CPUs), 8 on a cold page cache)",
    )
    de.add_argument("--verify-hash", action="store_true", help="check every tensor's hash")
    de.add_argument("--prompt", default=_DEFAULT_PROMPT, help="prompt of the test generation")
    de.add_argument("--max-tokens", type=int, default=16, help="tokens of the test generation")
    _add_s3_flags(de)


def _storage(args: argparse.Namespace) -> Any:
    values = {
        key: getattr(args, key, None)
        for key in ("s3_access_key_id", "s3_secret_access_key", "s3_endpoint")
    }
    values = {k: v for k, v in values.items() if v}
    if not values:
        return None  # the sources read S3_* / AWS_* from the environment
    from tensorstream.sources.base import StorageOptions

    return StorageOptions(**values)


def _extra(args: argparse.Namespace) -> dict[str, Any]:
    raw = args.model_loader_extra_config
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"--model-loader-extra-config is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError("--model-loader-extra-config must be a JSON object")
    return value


def _check_engine(args: argparse.Namespace) -> None:
    if args.tensor_parallel_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.tensor_parallel_size != 1 and args.tensorize_command != "serialize":
        raise ConfigError(
            f"--tensor-parallel-size {args.tensor_parallel_size} applies to serialize (it writes "
            "model-rank-%03d.tensors); load rank files with LLM(..., tensor_parallel_size=N) "
            "or tensorstream serve -tp N"
        )


def _progress_wanted() -> bool:
    return sys.stderr.isatty()


def _serialize(args: argparse.Namespace) -> int:
    from tensorstream.engine.tensorize import SerializeOptions, serialize_model

    if not args.model:
        raise ConfigError(
            "serialize needs --model (before the subcommand): --model M serialize ..."
        )
    import secrets

    # Printed before the work starts, so it is the first line whatever the logs say later.
    suffix = args.suffix or secrets.token_hex(16)
    print(f"suffix: {suffix}", flush=True)
    result = serialize_model(
        SerializeOptions(
            model=args.model,
            serialized_directory=args.serialized_directory,
            suffix=suffix,
            overwrite=args.overwrite,
            dtype=args.dtype,
            revision=args.revision,
            trust_remote_code=args.trust_remote_code,
            served_model_name=args.served_model_name,
            lora_path=args.lora_path,
            serialization_kwargs=args.serialization_kwargs,
            keyfile=args.keyfile,
            storage=_storage(args),
            model_loader_extra_config=_extra(args),
            progress=_progress_wanted(),
            tensor_parallel_size=args.tensor_parallel_size,
        )
    )
    print(f"serialized {args.model} to {result.directory}")
    print(f"  files: {', '.join(result.files)}")
    print(
        f"  tensors: {result.tensor_bytes / 1e6:.1f} MB in {result.seconds:.2f} s "
        f"({result.gb_per_s:.2f} GB/s)"
    )
    if result.keyfile:
        how = "new random key written" if result.new_key else "existing key used"
        print(f"  encrypted; key file: {result.keyfile} ({how})")
    return 0


def _deserialize(args: argparse.Namespace) -> int:
    from tensorstream.engine.sampling import SamplingParams
    from tensorstream.engine.tensorize import LoadOptions, adapter_directory, load_serialized

    if args.path_to_tensors and args.tensorizer_uri and args.path_to_tensors != args.tensorizer_uri:
        raise ConfigError("--path-to-tensors and --tensorizer-uri name different files; give one")
    if args.keyfile and args.encryption_keyfile and args.keyfile != args.encryption_keyfile:
        raise ConfigError("--keyfile and --encryption-keyfile name different files; give one")
    options = LoadOptions(
        path_to_tensors=args.path_to_tensors or args.tensorizer_uri,
        serialized_directory=args.serialized_directory,
        model=args.model,
        keyfile=args.keyfile or args.encryption_keyfile,
        deserialization_kwargs=args.deserialization_kwargs,
        num_readers=args.num_readers,
        verify_hash=args.verify_hash,
        storage=_storage(args),
        dtype=args.dtype,
        revision=args.revision,
        trust_remote_code=args.trust_remote_code,
        device=args.device,
        max_model_len=args.max_model_len,
        model_loader_extra_config=_extra(args),
        lora=bool(args.lora_path),
    )
    llm = load_serialized(options)
    stats = llm.load_stats
    name = args.served_model_name or llm.model_name
    print(
        f"loaded {name} from {stats.uri} ({stats.load_format}, dtype {str(llm.dtype).removeprefix('torch.')}, "
        f"{llm.device}): {stats.bytes / 1e6:.1f} MB usable after {stats.seconds:.2f} s; "
        f"{stats.describe().partition(', ')[2]}"
    )
    lora = None
    if args.lora_path:
        from tensorstream.engine.lora import LoRARequest

        # vLLM reads the adapter from the serialized directory; so do we.
        config = {"encryption_keyfile": options.keyfile} if options.keyfile else {}
        if options.storage is not None:
            config.update(
                (key, getattr(options.storage, key))
                for key in ("s3_access_key_id", "s3_secret_access_key", "s3_endpoint")
                if getattr(options.storage, key)
            )
        lora = LoRARequest("adapter", 1, adapter_directory(options), tensorizer_config_dict=config)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    if getattr(llm.tokenizer, "chat_template", None):
        out = llm.chat([{"role": "user", "content": args.prompt}], params, lora_request=lora)
    else:
        out = llm.generate(args.prompt, params, lora_request=lora)
    suffix = " (with the LoRA adapter)" if lora else ""
    print(f"prompt{suffix}: {args.prompt}")
    print(f"output: {out[0].outputs[0].text.strip()}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``serialize`` or ``deserialize``.

    Raises:
        TensorStreamError: any failure, with a message saying what to do.
    """
    from tensorstream.engine.vllm_args import apply_vllm_options, vllm_options_given

    _check_engine(args)
    apply_vllm_options(vllm_options_given(args), "cli")
    if args.tensorize_command == "serialize":
        return _serialize(args)
    return _deserialize(args)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run; errors print one line, exit 2.

    Args:
        argv: the arguments.
        prog: program name shown in help.

    Returns:
        The exit status.
    """
    import logging

    from tensorstream.errors import TensorStreamError

    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serialize a model in the tensorize layout, or load one back (vLLM's "
        "tensorize_vllm_model.py grammar).",
    )
    configure(parser)
    args = parser.parse_args(normalize_flags(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except TensorStreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
