"""``LLM``: load a model through a weight loader and generate text (vLLM-shaped facade).

``LLM(model, load_format=..., dtype=...)`` resolves the model's files, reads
the config and tokenizer, loads the weights with the chosen loader, builds the
transformers model around them without random initialisation, and wraps it in
an :class:`~tensorstream.engine.core.EngineCore`. ``generate`` and ``chat`` add
their requests to that core and step it until every request is done.

Importing this module does not import torch: ``LLM(...)`` first starts fetching the
weights (``engine/prefetch.py``), then imports torch and the model code while the
bytes arrive.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tensorstream.engine.load_stats import LoadStats
from tensorstream.engine.loaders import LOAD_FORMATS, LoadRequest, detect_format, get_loader
from tensorstream.engine.loaders.tensorizer_config import storage_from_extra
from tensorstream.engine.model_files import (
    config_json,
    context_length,
    eos_ids,
    load_config,
    load_tokenizer,
    pop_lora_dir,
    template_text,
)
from tensorstream.engine.outputs import RequestOutput
from tensorstream.engine.resolve import ModelLocation, resolve_model
from tensorstream.engine.sampling import SamplingParams
from tensorstream.engine.threads import apply_threads
from tensorstream.engine.vllm_args import check_llm_kwargs
from tensorstream.errors import ConfigError, KeyRequiredError
from tensorstream.utils.jsonarg import json_object

if TYPE_CHECKING:
    import torch

__all__ = ["LLM", "LoadStats"]

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int] | Mapping[str, Any]


class LLM:
    """A model ready to generate.

    Args:
        model: local directory, serialized directory (``model.tensors`` + config/tokenizer),
            the built-in model (``"smollm2-135m"`` or ``"HuggingFaceTB/SmolLM2-135M-Instruct"``),
            or a Hugging Face Hub id already in the local cache.
        load_format: "auto" (``model.tensors`` -> tensorizer, ``*.safetensors`` -> safetensors),
            "tensorizer" or "safetensors".
        dtype: "auto" (the config's dtype; float32 for a bf16/fp16 checkpoint on a CPU
            without fast matmuls in it, see ``engine/cpu_dtype.py``), "float16", "bfloat16",
            "float32", or a torch dtype.
        enable_lora: accept ``lora_request`` arguments (adapters chosen per request,
            several in one batch; plain low-rank matmuls on the native model code, peft
            on the transformers one).
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
        model_impl: "auto" (the engine's own model code for Llama-family architectures,
            transformers' for the rest), "native" (require it) or "transformers" (force
            the fallback, for debugging).
        max_num_batched_tokens: prompt tokens the native engine prefills per step (the
            chunk size; default 512), so long prompts do not stall running requests.
        tensor_parallel_size: ranks sharing the model (native Llama family): each loads
            only its slices (or its rank file) and the steps run on all (docs/parallel.md).

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
        model_impl: str = "auto",
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        cpu_threads: int | None = None,
        chat_template: str | os.PathLike[str] | None = None,
        tensor_parallel_size: int = 1,
        **vllm_kwargs: Any,
    ) -> None:
        # vLLM's other EngineArgs: checked, or ignored with one WARNING each (vllm_args.py).
        check_llm_kwargs(vllm_kwargs, _OWN_PARAMETERS)
        if max_num_seqs is not None and (not isinstance(max_num_seqs, int) or max_num_seqs < 1):
            raise ConfigError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
        self.max_num_seqs = max_num_seqs
        load_format = str(load_format).strip().lower()
        if load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"unknown load_format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}"
            )
        extra = _parse_extra(model_loader_extra_config)
        # vLLM's name for the adapter written beside the model; the loaders never see it.
        self.lora_dir: str | None = pop_lora_dir(extra)
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self.enable_lora = bool(enable_lora)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank

        self.location: ModelLocation = resolve_model(
            model, revision=revision, storage=storage_from_extra(extra)
        )
        load_format = load_format if load_format != "auto" else detect_format(self.location, extra)
        if device is None or str(device).startswith("cpu"):
            # The native models' C operators: compiled (first start on this machine) or
            # found in the cache on another core while torch imports (engine/rowops_build.py).
            from tensorstream.engine import rowops_build

            rowops_build.start_build()
        prefetch = None
        if tensor_parallel_size == 1 and load_format == "tensorizer":
            # Before torch: its import is seconds the weights can spend arriving.
            from tensorstream.engine.loaders.tensorizer import start_prefetch

            prefetch = start_prefetch(extra, self.location.weights_uri, device)
        try:
            self._load(
                prefetch,
                load_format=load_format,
                extra=extra,
                dtype=dtype,
                seed=seed,
                device=device,
                tokenizer=tokenizer,
                max_model_len=max_model_len,
                trust_remote_code=trust_remote_code,
                model_impl=model_impl,
                max_num_batched_tokens=max_num_batched_tokens,
                cpu_threads=cpu_threads,
                chat_template=chat_template,
                tensor_parallel_size=tensor_parallel_size,
            )
        finally:
            if prefetch is not None:
                prefetch.close()  # joins its threads; frees the bytes no load took

    def _load(
        self,
        prefetch: Any,
        *,
        load_format: str,
        extra: dict[str, Any],
        dtype: str | torch.dtype,
        seed: int | None,
        device: str | torch.device | None,
        tokenizer: str | os.PathLike[str] | None,
        max_model_len: int | None,
        trust_remote_code: bool,
        model_impl: str,
        max_num_batched_tokens: int | None,
        cpu_threads: int | None,
        chat_template: str | os.PathLike[str] | None,
        tensor_parallel_size: int,
    ) -> None:
        imports_started = time.perf_counter()
        import torch

        from tensorstream.engine.build import (
            build_model,
            checkpoint_dtype,
            import_model_code,
            resolve_dtype,
        )
        from tensorstream.engine.core import EngineCore
        from tensorstream.engine.models.select import (
            choose_model_impl,
            fill_native,
            prepare_native,
        )
        from tensorstream.engine.native_core import NativeEngineCore

        import_seconds = time.perf_counter() - imports_started
        if prefetch is not None:
            prefetch.boost()  # the imports no longer compete for the GIL
        self.cpu_threads = apply_threads(cpu_threads)
        self.device = torch.device(device) if device is not None else _default_device()
        if tensor_parallel_size != 1:  # N ranks, each with its slices (engine/parallel/)
            from tensorstream.engine.parallel.launch import start_parallel

            start_parallel(
                self,
                tensor_parallel_size,
                load_format=load_format,
                extra=extra,
                dtype=dtype,
                seed=seed,
                tokenizer=tokenizer,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
                model_impl=model_impl,
                chat_template=chat_template,
            )
            return
        loader = get_loader(load_format)
        # Start reading weights now, while transformers is imported and the config and
        # tokenizer are parsed: that import alone takes seconds, long enough to stream a
        # good part of a model from S3. The dtype comes from config.json, no import needed.
        early_config = config_json(self.location.files_dir)
        early_dtype = resolve_dtype(dtype, early_config, self.device)
        load_started = time.perf_counter()
        pending = _Pending(
            _timed,
            loader.load,
            LoadRequest(self.location, self.device, early_dtype, extra, prefetch=prefetch),
        )
        try:
            # Native Llama-family code (no transformers import) or the transformers fallback;
            # the native model is built on meta while the weights stream in.
            self.model_impl = choose_model_impl(
                model_impl,
                self.location.files_dir,
                tokenizer_dir=tokenizer or self.location.files_dir,
            )
            if self.model_impl == "native":
                self.config, self.tokenizer, shell = prepare_native(
                    self.location.files_dir, tokenizer or self.location.files_dir, self.device
                )
            else:
                self.config = load_config(self.location.files_dir, trust_remote_code)
                self.tokenizer = load_tokenizer(
                    tokenizer or self.location.files_dir, trust_remote_code
                )
                import_model_code(self.config)
            # Decided once: the CPU fallback (engine/cpu_dtype.py) reads the free memory,
            # which the weights streaming meanwhile have used.
            if checkpoint_dtype(dtype, self.config) == checkpoint_dtype(dtype, early_config):
                self.dtype = early_dtype
            else:
                self.dtype = resolve_dtype(dtype, self.config, self.device)
            self.load_format = load_format
            if chat_template is not None:
                self.tokenizer.chat_template = template_text(chat_template)
            weights, read_seconds = _keyed(pending.result)
        except BaseException:
            _discard(pending)
            raise
        if self.dtype != early_dtype:  # a config that only transformers resolves differently
            weights.close()
            weights, read_seconds = _keyed(
                _timed, loader.load, LoadRequest(self.location, self.device, self.dtype, extra)
            )
        build_started = time.perf_counter()
        try:
            if self.model_impl == "native":
                self.model = fill_native(
                    shell, weights, dtype=self.dtype, device=self.device, source=weights.uri
                )
            else:
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
        if weights.fetch_seconds is not None:
            # The bytes came in through the fetch started before torch's import: its wall
            # time is the read's (the load itself only checked and viewed them).
            read_seconds = max(read_seconds, weights.fetch_seconds)
        self.load_stats = LoadStats(
            self.load_format,
            weights.uri,
            weights.nbytes,
            read_seconds,
            time.perf_counter() - build_started,
            mapped_bytes=weights.mapped_bytes,
            usable_seconds=time.perf_counter() - load_started,
            import_seconds=import_seconds,
            fetch_seconds=prefetch.fetch_seconds if prefetch is not None else None,
        )
        code = self.model_impl
        if code == "native" and self.device.type == "cpu":
            from tensorstream.engine.models import rowops

            # Waits for the build started above, so a failure surfaces here, not mid-request.
            code += " (fused row operators)" if rowops.active() else " (torch operators)"
        logger.info(
            "loaded %s (%s) in %.2f s; %s model code, %d CPU threads",
            self.location.name,
            self.load_stats.describe(),
            self.load_stats.seconds,
            code,
            self.cpu_threads,
        )
        self.max_model_len = context_length(self.config, max_model_len)
        self.lora_manager = self._lora_manager(extra) if self.enable_lora else None
        eos = eos_ids(self.location.files_dir, self.config, self.tokenizer)
        if self.model_impl == "native":
            self.engine = NativeEngineCore(
                self.model,
                self.tokenizer,
                max_model_len=self.max_model_len,
                eos_token_ids=eos,
                seed=seed,
                max_num_batched_tokens=max_num_batched_tokens or 512,
                lora_manager=self.lora_manager,
            )
        else:
            self.engine = EngineCore(
                self.model,
                self.tokenizer,
                max_model_len=self.max_model_len,
                eos_token_ids=eos,
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
        manager_class: Any = LoRAManager
        if self.model_impl == "native":  # plain low-rank matmuls per row group, no peft
            from tensorstream.engine.models.lora import NativeLoRAManager as manager_class
        return manager_class(
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

    def _beside_model(self, lora_request: Any) -> Any:
        """A request without its own tensorizer options reads the model's ``lora_dir``."""
        if lora_request is None or not self.lora_dir:
            return lora_request
        if getattr(lora_request, "tensorizer_config_dict", None):
            return lora_request
        import dataclasses

        return dataclasses.replace(lora_request, tensorizer_config_dict={"lora_dir": self.lora_dir})

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
        loras = [self._beside_model(lora) for lora in loras]
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
        pending = list(zip(encoded, params_list, loras, strict=True))
        pending.reverse()
        limit = self.max_num_seqs or len(pending)
        try:
            while pending or len(finished) < len(ids):
                # At most max_num_seqs requests run at once, as in vLLM.
                while pending and len(ids) - len(finished) < limit:
                    (text, tokens), params, lora = pending.pop()
                    ids.append(
                        self.engine.add_request(tokens, params, prompt=text, lora_request=lora)
                    )
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
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _parse_extra(extra: Mapping[str, Any] | str | None) -> dict[str, Any]:
    return json_object(extra, "model_loader_extra_config")


def _keyed(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, telling ``LLM`` users how to give the key of an encrypted model."""
    try:
        return fn(*args)
    except KeyRequiredError as exc:
        raise KeyRequiredError(
            f"{exc}; give the key file: LLM(..., model_loader_extra_config="
            "{'encryption_keyfile': '/path/to/key'}), or a passphrase: "
            "model_loader_extra_config={'deserialization_kwargs': "
            "{'encryption': DecryptionParams.from_string(passphrase)}}"
        ) from exc


class _Pending:
    """``fn(*args)`` on a daemon thread; ``result()`` joins it, so no thread outlives it."""

    def __init__(self, fn: Any, *args: Any) -> None:
        import threading

        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = fn(*args)
            except BaseException as exc:  # delivered to the caller by result()
                self._error = exc

        self._thread = threading.Thread(target=run, name="tensorstream-weights", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


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


#: ``LLM``'s own keyword names, for "did you mean" hints on unknown keywords.
_OWN_PARAMETERS = tuple(
    name
    for name in inspect.signature(LLM.__init__).parameters
    if name not in ("self", "vllm_kwargs")
)
