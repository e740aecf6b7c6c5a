"""`vllm serve` command lines as vLLM's docs and deployment manifests write them.

Each line is parsed by ``tensorstream serve``'s own parser and checks (no server is
started): it either works, with the flags that apply honoured and the others named
once at WARNING, or fails with an error naming the flag.
"""

from __future__ import annotations

import logging

import pytest

from tensorstream.errors import ConfigError

MODEL = "/models/llama"  # never opened: parsing and checks only


def warnings_of(log: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in log.records if r.levelno == logging.WARNING]


# Written from vLLM's docs (quickstart, deployment/k8s, production-stack values, LoRA docs).
WORKING_LINES = [
    # Quickstart / OpenAI server docs.
    f"{MODEL} --dtype auto --api-key token-abc123",
    # Docker / k8s deployment docs.
    f"--model {MODEL} --port 8000 --host 0.0.0.0 --dtype bfloat16 --max-model-len 4096 "
    "--enforce-eager --disable-log-requests --swap-space 16 --block-size 16 --max-num-seqs 256 "
    "--seed 0 --tensor-parallel-size 1 --gpu-memory-utilization 0.9",
    # vLLM's docs write underscores in some manifests; its parser accepts both.
    f"{MODEL} --trust-remote-code --enable-chunked-prefill --max_num_batched_tokens 1024",
    # LoRA docs.
    f"{MODEL} --enable-lora --lora-modules sql-lora=/adapters/sql --max-loras 2 --max-lora-rank 64",
    # Distributed / perf flags users keep when moving to one box.
    f"{MODEL} -tp 1 -pp 1 --distributed-executor-backend mp --enable-prefix-caching "
    "--kv-cache-dtype auto --max-num-batched-tokens 8k --uvicorn-log-level warning "
    "--disable-log-stats --download-dir /models/cache --served-model-name llama llama-3",
    f"{MODEL} --no-enable-prefix-caching --hf-token --tokenizer-mode auto --max-model-len auto",
]


@pytest.mark.parametrize("line", WORKING_LINES)
def test_deployment_lines_parse(line, serve_args, vllm_log):
    args, extra = serve_args(line)
    assert args.model == MODEL
    assert extra == {}


def test_honoured_flags_reach_the_engine(serve_args, vllm_log):
    args, _ = serve_args(
        f"--model {MODEL} --max-model-len 4K --max-num-batched-tokens 2k --max-num-seqs 8 "
        "--served-model-name llama llama-3 --uvicorn-log-level warning --api-key k1 "
        "--chat-template /t.jinja --cpu-threads 3 --seed 7 --dtype float16"
    )
    assert (args.max_model_len, args.max_num_batched_tokens, args.max_num_seqs) == (4096, 2000, 8)
    assert args.served_model_name == "llama" and args.log_level == "warning"
    assert args.api_key == "k1" and args.chat_template == "/t.jinja"
    assert (args.cpu_threads, args.seed, args.dtype) == (3, 7, "float16")
    # The second served name is not silently dropped.
    assert any("llama-3" in w and "--served-model-name" in w for w in warnings_of(vllm_log))


def test_host_and_port_default_to_vllms(serve_args):
    args, _ = serve_args(MODEL)
    assert (args.host, args.port) == ("0.0.0.0", 8000)


def test_ignored_flags_are_named_once_at_warning(serve_args, vllm_log):
    serve_args(
        f"{MODEL} --gpu-memory-utilization 0.9 --swap-space 4 --block-size 16 "
        "--enable-prefix-caching --disable-log-requests --distributed-executor-backend ray"
    )
    text = "\n".join(warnings_of(vllm_log))
    for flag in (
        "--gpu-memory-utilization",
        "--swap-space",
        "--block-size",
        "--enable-prefix-caching",
        "--disable-log-requests",
        "--distributed-executor-backend",
    ):
        assert text.count(flag) == 1, flag
    # Once per process: a second parse says nothing new.
    vllm_log.clear()
    serve_args(f"{MODEL} --gpu-memory-utilization 0.9")
    assert not [w for w in warnings_of(vllm_log) if "--gpu-memory-utilization" in w]


def test_enforce_eager_is_honoured_not_warned(serve_args, vllm_log):
    serve_args(f"{MODEL} --enforce-eager")
    assert not warnings_of(vllm_log)
    assert any("--enforce-eager" in r.getMessage() for r in vllm_log.records)


@pytest.mark.parametrize(
    ("line", "flag"),
    [
        (f"{MODEL} --tensor-parallel-size 0", "--tensor-parallel-size 0"),
        (f"{MODEL} -tp two", "--tensor-parallel-size two"),
        (f"{MODEL} --pipeline-parallel-size 2", "--pipeline-parallel-size 2"),
        (f"{MODEL} --data-parallel-size 2", "--data-parallel-size 2"),
        (f"{MODEL} --quantization awq", "--quantization awq"),
        (f"{MODEL} -q gptq", "--quantization gptq"),
        (f"{MODEL} --kv-cache-dtype fp8", "--kv-cache-dtype fp8"),
        (f"{MODEL} --config serve.yaml", "--config serve.yaml"),
        (f"{MODEL} --runner pooling", "--runner pooling"),
        (f"{MODEL} --api-key a b", "--api-key"),
        (f"{MODEL} --model /other", "--model"),
        ("--max-num-seqs 4", "MODEL"),
    ],
)
def test_values_that_cannot_be_honoured_name_the_flag(line, flag, serve_args):
    with pytest.raises(ConfigError) as info:
        serve_args(line)
    assert flag in str(info.value)


def test_a_typo_names_the_flag_meant(serve_args, capsys):
    with pytest.raises(SystemExit) as info:
        serve_args(f"{MODEL} --gpu-memory-utilisation 0.9")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: tensorstream serve" in err  # the subcommand's usage, not the top level's
    assert "did you mean --gpu-memory-utilization?" in err


def test_a_flag_neither_vllm_nor_we_know_is_refused(serve_args, capsys):
    with pytest.raises(SystemExit):
        serve_args(f"{MODEL} --frobnicate")
    assert "unrecognized arguments: --frobnicate" in capsys.readouterr().err


def test_keyfile_and_passphrase_flags_reach_the_loader(serve_args, monkeypatch, tmp_path):
    _, extra = serve_args(f"{MODEL} --keyfile /keys/model.key")
    assert extra["encryption_keyfile"] == "/keys/model.key"
    monkeypatch.setenv("MODEL_PASSPHRASE", "correct horse")
    _, extra = serve_args(f"{MODEL} --passphrase-env MODEL_PASSPHRASE --require-manifest")
    kwargs = extra["deserialization_kwargs"]
    assert kwargs["require_manifest"] is True and kwargs["encryption"] is not None
    with pytest.raises(ConfigError, match="--keyfile and encryption_keyfile"):
        serve_args(
            f"""{MODEL} --keyfile /a.key --model-loader-extra-config '{{"encryption_keyfile": "/b.key"}}'"""
        )


def test_every_vllm_032_option_is_accepted(serve_args):
    """The whole EngineArgs/FrontendArgs list, each with a value of its shape."""
    from tensorstream.cli.main import build_parser
    from tensorstream.engine.vllm_args import LIMITS, VLLM_OPTIONS

    serve = build_parser(["serve"])._subparsers._group_actions[0].choices["serve"]
    own = {  # honoured flags, with their own types (tested above)
        flag[2:].replace("-", "_")
        for action in serve._actions
        if not action.dest.startswith("vllm_option__")
        for flag in action.option_strings
    }
    checked = 0
    for name, shape in sorted(VLLM_OPTIONS.items()):
        if name in LIMITS or name in own:
            continue
        flag = "--" + name.replace("_", "-")
        value = {"bool": "", "optbool": "", "list": " a b", "value": " 1"}[shape]
        try:
            serve_args(f"{MODEL} {flag}{value}")
        except SystemExit:  # pragma: no cover - names the option in the failure
            pytest.fail(f"{flag} is refused by the parser")
        checked += 1
    assert checked > 250


@pytest.mark.parametrize(
    ("given", "expected"),
    [("", "auto"), ("--model-impl vllm", "native"), ("--model-impl transformers", "transformers")],
)
def test_model_impl_is_honoured(given, expected, serve_args):
    args, _ = serve_args(f"{MODEL} {given}")
    assert args.model_impl == expected


def test_unknown_model_impl_names_the_flag(serve_args, capsys):
    with pytest.raises(SystemExit):
        serve_args(f"{MODEL} --model-impl terratorch")
    assert "--model-impl" in capsys.readouterr().err


def test_chunked_prefill_is_not_called_ignored(serve_args, vllm_log):
    serve_args(f"{MODEL} --enable-chunked-prefill")
    assert not any("--enable-chunked-prefill" in w for w in warnings_of(vllm_log))
    assert any(
        "--enable-chunked-prefill" in r.getMessage() and "honoured" in r.getMessage()
        for r in vllm_log.records
    )
