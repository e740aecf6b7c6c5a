"""``LLM(...)`` calls written from vLLM's docs, on the built-in model (tensorized).

vLLM's EngineArgs keywords are honoured, named once at WARNING, or refused naming
the keyword; a keyword neither knows is a ``TypeError`` naming the closest one.
"""

from __future__ import annotations

import logging

import pytest

from tensorstream.errors import ConfigError


def test_a_vllm_docs_llm_call_loads_and_generates(tensorized_dir, vllm_log, fresh_warnings):
    from tensorstream import LLM, SamplingParams, TensorizerConfig

    # vLLM's tensorizer docs, with the engine keywords a vLLM user passes.
    llm = LLM(
        str(tensorized_dir),
        load_format="tensorizer",
        model_loader_extra_config=TensorizerConfig(
            tensorizer_uri=str(tensorized_dir / "model.tensors"),
            num_readers=2,
            verify_hash="True",
            stream_kwargs={"force_http": "False"},
        ),
        tensor_parallel_size=1,
        gpu_memory_utilization=0.9,
        enforce_eager=True,
        swap_space=4,
        max_num_seqs=2,
        seed=0,
        dtype="bfloat16",
        cpu_threads=1,
    )
    outs = llm.generate(
        ["The capital of France is", "One, two,", "Hello"],
        SamplingParams(temperature=0, max_tokens=4),
    )
    assert len(outs) == 3 and all(o.outputs[0].token_ids for o in outs)
    warnings = [r.getMessage() for r in vllm_log.records if r.levelno == logging.WARNING]
    assert any("LLM(gpu_memory_utilization=...)" in w for w in warnings)
    assert any("LLM(swap_space=...)" in w for w in warnings)
    assert not any("enforce_eager" in w for w in warnings)  # honoured: always eager
    assert llm.cpu_threads == 1


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        # SmolLM2 has 9 attention heads: 2 ranks cannot split them evenly.
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2 does not divide"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer, got 0"),
        ({"pipeline_parallel_size": 2}, "LLM(pipeline_parallel_size=2)"),
        ({"quantization": "awq"}, "LLM(quantization='awq')"),
        ({"kv_cache_dtype": "fp8"}, "LLM(kv_cache_dtype='fp8')"),
    ],
)
def test_values_that_cannot_be_honoured_name_the_keyword(kwargs, named, tensorized_dir):
    from tensorstream import LLM

    with pytest.raises(ConfigError) as info:
        LLM(str(tensorized_dir), **kwargs)
    assert named in str(info.value)


def test_an_unknown_keyword_names_the_closest_one(tensorized_dir):
    from tensorstream import LLM

    with pytest.raises(
        TypeError, match="'tensor_paralel_size'; did you mean 'tensor_parallel_size'"
    ):
        LLM(str(tensorized_dir), tensor_paralel_size=1)
    with pytest.raises(TypeError, match="'max_model_length'; did you mean 'max_model_len'"):
        LLM(str(tensorized_dir), max_model_length=64)


def test_max_num_seqs_bounds_running_requests(tensorized_dir):
    from tensorstream import LLM, SamplingParams

    llm = LLM(str(tensorized_dir), max_num_seqs=1, cpu_threads=1)
    running = []
    step = llm.engine.step

    def counting_step():
        running.append(len(llm.engine._requests))
        return step()

    llm.engine.step = counting_step
    outs = llm.generate(["a", "b", "c"], SamplingParams(temperature=0, max_tokens=2))
    assert len(outs) == 3 and max(running) == 1


def test_chat_template_keyword_replaces_the_tokenizers(tensorized_dir, tmp_path):
    from tensorstream import LLM, SamplingParams

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    llm = LLM(str(tensorized_dir), chat_template=str(template), cpu_threads=1)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1))
    assert out[0].prompt == "<<hi>>"
