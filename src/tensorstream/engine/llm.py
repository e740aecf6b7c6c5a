"""``LLM``: load a model through a weight loader and generate text (vLLM-shaped facade).

``LLM(model, load_format=..., dtype=...)`` resolves the model's files, reads
the config and tokenizer, loads the weights with the chosen loader, builds the
transformers model around them without random initialisation, and wraps it in
an :class:`~tensorstream.engine.core.EngineCore`. ``generate`` and ``chat`` add
their requests to that core and step it until every request is done.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tensorstream.engine.build import build_model, import_model_code, resolve_dtype
from tensorstream.engine.core import EngineCore
from tensorstream.engine.loaders import LOAD_FORMATS, LoadRequest, detect_format, get_loader
from tensorstream.engine.outputs import RequestOutput
from tensorstream.engine.resolve import ModelLocation, resolve_model
from tensorstream.engine.sampling import SamplingParams
from tensorstream.errors import ConfigError, SourceNotFoundError
from tensorstream.utils.jsonarg import json_object

__all__ = ["LLM", "LoadStats"]

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int] | Mapping[str, Any]


@dataclass(frozen=True)
class LoadStats:
    """How the last weight load went.

    Attributes:
        load_format: the loader used ("safetensors", "tensorizer").
        uri: where the weights were read from.
        bytes: tensor bytes read.
        read_seconds: time to read every tensor (storage -> memory).
        build_seconds: time to construct the model on meta and adopt the tensors.
        seconds: ``read_seconds + build_seconds``.
        gb_per_s: ``bytes / read_seconds / 1e9``, the storage-side throughput.
    """

    load_format: str
    uri: str
    bytes: int
    read_seconds: float
    build_seconds: float

    @property
    def seconds(self) -> float:
        return self.read_seconds + self.build_seconds

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.read_seconds / 1e9 if self.read_seconds > 0 else float("inf")


class LLM:
    """A model ready to generate.

    Args:
        model: local directory, serialized directory (``model.tensors`` + config/tokenizer),
            the built-in model (``"smollm2-135m"`` or ``"HuggingFaceTB/SmolLM2-135M-Instruct"``),
            or a Hugging Face Hub id already in the local cache.
        load_format: "auto" (``model.tensors`` -> tensorizer, ``*.safetensors`` -> safetensors),
            "tensorizer" or "safetensors".
        dtype: "auto" (the config's dtype), "float16", "bfloat16", "float32", or a torch dtype.
        enable_lora: accept ``lora_request`` arguments (adapters are applied with peft,
            chosen per request, several in one batch).
        max_loras: adapters loaded at once (the least recently used idle one is evicted).
        max_lora_rank: highest adapter rank accepted.
        model_loader_extra_config: loader options, a dict or a JSON string (tensorizer keys:
            ``tensorizer_uri``, ``num_readers``, ``verify_hash``, ``encryption_keyfile``...).
        seed: seeds sampling for requests without their own seed.
        device: "cpu", "cuda", "cuda:1"...; default CUDA when available, else CPU.
        tokenizer: directory or id of the tokenizer, when it is not beside the model.
        max_model_len: context length; default the config's ``max_position_embeddings``.
        trust_remote_code: allow model code from the model directory.
        revision: Hub revision for Hub ids.

    Raises:
        ConfigError: bad options (unknown load_format, dtype, extra config keys).
        SourceNotFoundError: the model, its config.json or its weights are missing.

    Example:
        >>> llm = LLM("smollm2-135m")  # doctest: +SKIP
        >>> llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text  # doctest: +SKIP
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        load_format: str = "auto",
        dtype: str | torch.dtype = "auto",
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        model_loader_extra_config: Mapping[str, Any] | str | None = None,
        seed: int | None = None,
        device: str | torch.device | None = None,
        tokenizer: str | os.PathLike[str] | None = None,
        max_model_len: int | None = None,
        trust_remote_code: bool = False,
        revision: str | None = None,
    ) -> None:
        load_format = str(load_format).strip().lower()
        if load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"unknown load_format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}"
            )
        extra = _parse_extra(model_loader_extra_config)
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self.enable_lora = bool(enable_lora)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.device = torch.device(device) if device is not None else _default_device()

        self.location: ModelLocation = resolve_model(
            model, revision=revision, storage=_storage_from_extra(extra)
        )
        load_format = load_format if load_format != "auto" else detect_format(self.location, extra)
        loader = get_loader(load_format)
        # Start reading weights now, while transformers is imported and the config and
        # tokenizer are parsed: that import alone takes seconds, long enough to stream a
        # good part of a model from S3. The dtype comes from config.json, no import needed.
        early_dtype = resolve_dtype(dtype, _config_json(self.location.files_dir))
        pending = _background(
            _timed, loader.load, LoadRequest(self.location, self.device, early_dtype, extra)
        )
        try:
            self.config = _load_config(self.location.files_dir, trust_remote_code)
            self.tokenizer = _load_tokenizer(
                tokenizer or self.location.files_dir, trust_remote_code
            )
            self.dtype = resolve_dtype(dtype, self.config)
            self.load_format = load_format
            import_model_code(self.config)
            weights, read_seconds = pending.result()
        except BaseException:
            _discard(pending)
            raise
        if self.dtype != early_dtype:  # a config that only transformers resolves differently
            weights.close()
            weights, read_seconds = _timed(
                loader.load, LoadRequest(self.location, self.device, self.dtype, extra)
            )
        build_started = time.perf_counter()
        try:
            self.model = build_model(
                self.config,
                weights,
                dtype=self.dtype,
                device=self.device,
                trust_remote_code=trust_remote_code,
                source=weights.uri,
            )
        finally:
            weights.close()
        self.load_stats = LoadStats(
            self.load_format,
            weights.uri,
            weights.nbytes,
            read_seconds,
            time.perf_counter() - build_started,
        )
        stats = self.load_stats
        logger.info(
            "loaded %s (%s, %.1f MB) in %.2f s: read %.2f s (%.2f GB/s), build %.2f s",
            self.location.name,
            stats.load_format,
            stats.bytes / 1e6,
            stats.seconds,
            stats.read_seconds,
            stats.gb_per_s,
            stats.build_seconds,
        )
        self.max_model_len = _context_length(self.config, max_model_len)
        self.lora_manager = self._lora_manager(extra) if self.enable_lora else None
        self.engine = EngineCore(
            self.model,
            self.tokenizer,
            max_model_len=self.max_model_len,
            eos_token_ids=_eos_ids(self.location.files_dir, self.config, self.tokenizer),
            seed=seed,
            lora_manager=self.lora_manager,
        )

    def _lora_manager(self, extra: Mapping[str, Any]) -> Any:
        from tensorstream.engine.lora import AdapterOptions, LoRAManager

        # Adapters beside an encrypted model use the model's key and storage by default.
        nested = extra.get("tensorizer_config")
        flat = {**extra, **(nested if isinstance(nested, Mapping) else {})}
        keys = ("encryption_keyfile", "s3_access_key_id", "s3_secret_access_key", "s3_endpoint")
        defaults = AdapterOptions.from_config({k: flat[k] for k in keys if flat.get(k)})
        return LoRAManager(
            self.model,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            defaults=defaults,
        )

    def add_lora(self, lora_request: Any) -> bool:
        """Load an adapter now (otherwise it loads on first use).

        Returns:
            True.

        Raises:
            ConfigError: LoRA is not enabled, or the adapter does not fit the model.
        """
        self._require_lora()
        self.lora_manager.add(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter by ``lora_int_id``; False when it was not loaded."""
        self._require_lora()
        return self.lora_manager.remove(lora_id)

    def list_loras(self) -> set[int]:
        """Ids of the loaded adapters."""
        return self.lora_manager.list() if self.lora_manager is not None else set()

    def _require_lora(self) -> None:
        if self.lora_manager is None:
            raise ConfigError(
                "LoRA is not enabled; build the LLM with enable_lora=True to use adapters"
            )

    @property
    def model_name(self) -> str:
        """The name the model was asked for by (the built-in model's Hub id for its alias)."""
        return self.location.name

    def get_tokenizer(self) -> Any:
        """Return the tokenizer."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: Any = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete each prompt; all prompts run as one batch.

        Args:
            prompts: a string, a list of token ids, a ``{"prompt": ...}`` /
                ``{"prompt_token_ids": [...]}`` dict, or a list of those.
            sampling_params: one for all prompts, or one per prompt; default ``SamplingParams()``.
            lora_request: a ``LoRARequest`` for every prompt, or a list with one per
                prompt (None entries use the base model); needs ``enable_lora=True``.
            use_tqdm: show a progress bar of finished requests (needs tqdm).

        Returns:
            One finished ``RequestOutput`` per prompt, in prompt order.

        Raises:
            ConfigError: bad prompts, mismatched ``sampling_params``, or an unusable LoRA request.
        """
        batch = _as_prompt_list(prompts)
        encoded = [self._encode(p) for p in batch]
        return self._run(encoded, sampling_params, lora_request, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: Any = None,
        use_tqdm: bool = False,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them with the tokenizer's chat template.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]`` or a list of such lists.
            sampling_params, lora_request, use_tqdm: as in :meth:`generate`.
            chat_template: override the tokenizer's template.
            add_generation_prompt: end the prompt with the assistant turn's opening.

        Returns:
            One ``RequestOutput`` per conversation.

        Raises:
            ConfigError: the tokenizer has no chat template and none was given.
        """
        if not messages:
            raise ConfigError("chat() needs at least one message")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                f"the tokenizer of {self.model_name} has no chat template; pass chat_template= or use generate()"
            )
        encoded = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                list(conversation),
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
            # The template already holds any BOS token; do not let the tokenizer add another.
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            encoded.append((text, list(ids)))
        return self._run(encoded, sampling_params, lora_request, use_tqdm)

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self._encode(str(prompt["prompt"]))
            raise ConfigError(
                f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
            )
        return None, [int(t) for t in prompt]

    def _run(
        self,
        encoded: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        lora_request: Any,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if lora_request is not None and not self.enable_lora:
            raise ConfigError(
                "a lora_request was given but the LLM was built without enable_lora=True"
            )
        if isinstance(lora_request, (list, tuple)):
            loras = list(lora_request)
            if len(loras) != len(encoded):
                raise ConfigError(
                    f"got {len(loras)} lora_requests for {len(encoded)} prompts; give one, or one per prompt"
                )
        else:
            loras = [lora_request] * len(encoded)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(encoded)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(encoded)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(encoded):
                raise ConfigError(
                    f"got {len(params_list)} sampling_params for {len(encoded)} prompts; give one, or one per prompt"
                )
        ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        bar = _progress(len(encoded)) if use_tqdm else None
        try:
            for (text, tokens), params, lora in zip(encoded, params_list, loras, strict=True):
                ids.append(self.engine.add_request(tokens, params, prompt=text, lora_request=lora))
            while len(finished) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _storage_from_extra(extra: Mapping[str, Any]) -> Any:
    """``StorageOptions`` from the S3 keys of the extra config (flat or nested); None if absent."""
    nested = extra.get("tensorizer_config")
    flat = {**extra, **(nested if isinstance(nested, Mapping) else {})}
    keys = ("s3_access_key_id", "s3_secret_access_key", "s3_endpoint")
    values = {k: flat[k] for k in keys if flat.get(k)}
    if not values:
        return None
    from tensorstream.sources.base import StorageOptions

    return StorageOptions(**values)


def _parse_extra(extra: Mapping[str, Any] | str | None) -> dict[str, Any]:
    return json_object(extra, "model_loader_extra_config")


def _config_json(files_dir: Path) -> Any:
    """config.json as attributes (enough for ``resolve_dtype``), without transformers."""
    from types import SimpleNamespace

    try:
        data = json.loads((Path(files_dir) / "config.json").read_text())
    except (OSError, ValueError):
        data = {}
    return SimpleNamespace(
        dtype=data.get("dtype") if isinstance(data, dict) else None,
        torch_dtype=data.get("torch_dtype") if isinstance(data, dict) else None,
    )


def _background(fn: Any, *args: Any) -> Any:
    """Run ``fn`` on a daemon thread; returns a future."""
    import threading
    from concurrent.futures import Future

    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # delivered to the caller through the future
            future.set_exception(exc)

    threading.Thread(target=run, name="tensorstream-weights", daemon=True).start()
    return future


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and the seconds it took (the read time, even when overlapped)."""
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


def _discard(pending: Any) -> None:
    """Wait for a background load that is no longer wanted and release what it holds."""
    try:
        pending.result()[0].close()
    except BaseException:  # noqa: BLE001 - the original error is the one to report
        pass


def _load_config(files_dir: Path, trust_remote_code: bool) -> Any:
    if not (files_dir / "config.json").is_file():
        raise SourceNotFoundError(
            f"no config.json in {files_dir}; a model directory needs the Hugging Face config "
            "(serialize with the config and tokenizer files beside model.tensors)"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(files_dir, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError) as exc:
        raise ConfigError(f"cannot read {files_dir / 'config.json'}: {exc}") from exc


def _load_tokenizer(where: str | os.PathLike[str], trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            os.fspath(where), trust_remote_code=trust_remote_code
        )
    except (ValueError, OSError, KeyError) as exc:
        raise ConfigError(
            f"cannot load a tokenizer from {where}: {exc}; put tokenizer files beside the model "
            "or pass tokenizer=<directory>"
        ) from exc
    return tokenizer


def _context_length(config: Any, requested: int | None) -> int:
    declared = None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        declared = getattr(config, key, None)
        if isinstance(declared, int) and declared > 0:
            break
    if requested is None:
        return declared or 2048
    if not isinstance(requested, int) or requested < 2:
        raise ConfigError(f"max_model_len must be an integer >= 2, got {requested!r}")
    if declared and requested > declared:
        raise ConfigError(
            f"max_model_len={requested} exceeds the model's {declared} positions; use at most {declared}"
        )
    return requested


def _eos_ids(files_dir: Path, config: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    generation = files_dir / "generation_config.json"
    if generation.is_file():
        try:
            add(json.loads(generation.read_text()).get("eos_token_id"))
        except ValueError:
            logger.warning("ignoring unreadable %s", generation)
    else:
        add(getattr(config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return ids


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    items = list(prompts)
    if not items:
        raise ConfigError("generate() needs at least one prompt")
    if all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError as exc:
        raise ConfigError(
            "use_tqdm=True needs tqdm; run: pip install 'tensorstream[progress]'"
        ) from exc
    return tqdm(total=total, desc="requests", unit="req")
