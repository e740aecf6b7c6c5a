"""vLLM's ``SamplingParams`` fields users set: honoured on the built-in model, or refused by name."""

from __future__ import annotations

import pytest
import torch

from tensorstream import SamplingParams
from tensorstream.errors import ConfigError

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(tensorized_dir):
    from tensorstream import LLM

    return LLM(str(tensorized_dir), cpu_threads=1)


def _one(llm, params, prompt=PROMPT):
    return llm.generate(prompt, params)[0].outputs[0]


def test_logit_bias_and_allowed_token_ids(llm):
    greedy = _one(llm, SamplingParams(temperature=0, max_tokens=3))
    first = greedy.token_ids[0]
    biased = _one(llm, SamplingParams(temperature=0, max_tokens=3, logit_bias={first: -100}))
    assert biased.token_ids[0] != first
    allowed = [llm.tokenizer.encode(" Paris")[0], llm.tokenizer.encode(" the")[0]]
    out = _one(llm, SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=allowed))
    assert set(out.token_ids) <= set(allowed)


def test_min_tokens_holds_back_eos_and_stop_strings(llm):
    chat = [{"role": "user", "content": "Reply with one word: yes or no?"}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, min_tokens=25))
    assert len(longer[0].outputs[0].token_ids) >= 25


def test_include_stop_str_in_output(llm):
    cut = _one(llm, SamplingParams(temperature=0, max_tokens=12, stop=["Paris"]))
    kept = _one(
        llm,
        SamplingParams(
            temperature=0, max_tokens=12, stop=["Paris"], include_stop_str_in_output=True
        ),
    )
    assert cut.stop_reason == kept.stop_reason == "Paris"
    assert kept.text == cut.text + "Paris"


def test_truncate_prompt_tokens_and_detokenize(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, truncate_prompt_tokens=2))[0]
    assert len(out.prompt_token_ids) == 2
    raw = _one(llm, SamplingParams(temperature=0, max_tokens=3, detokenize=False))
    assert raw.text == "" and len(raw.token_ids) == 3


def test_min_p_keeps_only_tokens_near_the_top():
    from tensorstream.engine.sampler import pick_token

    logits = torch.tensor([5.0, 4.9, 0.0, -1.0])
    params = SamplingParams(temperature=1.0, min_p=0.5)
    generator = torch.Generator().manual_seed(0)
    picks = {pick_token(logits, params, generator) for _ in range(200)}
    assert picks == {0, 1}  # p(2)/p(0) = e^-5 < 0.5: never drawn


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("bad_words", ["Paris"]),
        ("prompt_logprobs", 1),
        ("use_beam_search", True),
        ("best_of", 3),
        ("structured_outputs", {"json": {}}),
        ("guided_decoding", {"regex": "a+"}),
        ("logits_processors", [lambda ids, logits: logits]),
        ("spaces_between_special_tokens", False),
    ],
)
def test_fields_not_implemented_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {5: 500}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"detokenize": False, "stop": ["x"]}, "detokenize"),
    ],
)
def test_bad_values_are_named(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        SamplingParams(**kwargs)
