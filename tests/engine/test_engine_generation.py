"""Sampling behaviour and the step-able engine core, on a tiny Llama."""

from __future__ import annotations

import pytest
import torch

from tensorstream.engine import LLM, EngineCore, SamplingParams
from tensorstream.engine.sampler import apply_penalties, pick_token

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("llama")), device="cpu", seed=1234)


@pytest.fixture(scope="module")
def cohort_llm(tiny_model):
    """The transformers model code and the cohort EngineCore (the fallback path)."""
    return LLM(str(tiny_model("llama")), device="cpu", seed=1234, model_impl="transformers")


def test_seeded_sampling_reproducible(llm):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7, ignore_eos=True)
    first = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    again = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    other = llm.generate(
        PROMPT, SamplingParams(temperature=1.0, max_tokens=10, seed=8, ignore_eos=True)
    )
    assert first == again
    assert first != other[0].outputs[0].token_ids


def test_n_completions(llm):
    out = llm.generate(
        PROMPT, SamplingParams(temperature=1.5, n=3, max_tokens=6, seed=3, ignore_eos=True)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent draws
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, n=2, max_tokens=6))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_stop_strings_and_tokens(llm):
    full = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[
        0
    ].outputs[0]
    assert len(full.text) > 4
    stop = full.text[3:5]
    cut = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=[stop, "@@@"]))[
        0
    ].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.find(stop)]
    assert stop not in cut.text
    token = full.token_ids[4]
    by_id = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[token])
    )[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == token
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(token) + 1]


def test_eos_stops_unless_ignored(cohort_llm):
    llm = cohort_llm
    first = (
        llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    )
    ids = llm.tokenizer(PROMPT)["input_ids"]
    # An engine whose EOS is the model's greedy second token must stop right there.
    core = EngineCore(llm.model, llm.tokenizer, max_model_len=64, eos_token_ids={first[1]})
    core.add_request(ids, SamplingParams(temperature=0, max_tokens=4))
    outs = _drain(core)
    (done,) = outs.values()
    assert done.outputs[0].token_ids == first[:2]
    assert done.outputs[0].finish_reason == "stop" and done.outputs[0].stop_reason is None
    core.add_request(ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    (kept,) = _drain(core).values()
    assert kept.outputs[0].token_ids == first and kept.outputs[0].finish_reason == "length"


def test_logprobs(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0].outputs[
        0
    ]
    assert len(out.logprobs) == 3
    total = 0.0
    for token, step in zip(out.token_ids, out.logprobs, strict=True):
        assert token in step and step[token].rank == 1  # greedy picks the top token
        assert len(step) == 2 and all(lp.logprob <= 0 for lp in step.values())
        total += step[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_requests_join_between_steps(llm):
    """A request added mid-flight yields the same tokens as when run alone (continuous batching)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in (PROMPT, "The weather today")]
    core = llm.engine
    ids = [llm.tokenizer(p)["input_ids"] for p in (PROMPT, "The weather today")]
    first = core.add_request(ids[0], params)
    assert [o.request_id for o in core.step()] == [first]
    core.step()
    second = core.add_request(ids[1], params)
    outs = _drain(core)
    assert outs[first].outputs[0].token_ids == alone[0]
    assert outs[second].outputs[0].token_ids == alone[1]
    assert not core.has_unfinished_requests()


def test_cohorts_arriving_at_different_steps_share_one_batch(cohort_llm):
    llm = cohort_llm
    """Three requests joining at steps 0, 2 and 3 decode as one batch once running, their
    tokens equal to each one run alone; when the longest finishes, the padding it forced
    on the others is trimmed away."""
    prompts = [PROMPT + " there was a dragon who lived in a cave by the sea", "Hi", "The weather"]
    lengths = [6, 12, 12]  # the long prompt finishes first, at step 6
    alone = [
        llm.generate(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
        for p, n in zip(prompts, lengths, strict=True)
    ]
    core = llm.engine
    ids = [llm.tokenizer(p)["input_ids"] for p in prompts]

    def add(i: int) -> str:
        return core.add_request(
            ids[i], SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True)
        )

    requests = [add(0)]
    core.step()
    core.step()
    requests.append(add(1))
    core.step()
    requests.append(add(2))
    core.step()  # merges the first two cohorts, then prefills the third
    core.step()
    assert len(core._cohorts) == 1  # noqa: SLF001 - the batching is the point
    assert len(core._cohorts[0].sequences) == 3  # noqa: SLF001
    finished = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                finished[out.request_id] = out
        if requests[0] in finished and len(finished) < 3:
            mask = core._cohorts[0].mask  # noqa: SLF001
            assert bool(mask[:, 0].any())  # no column is padding in every row
    for request, want in zip(requests, alone, strict=True):
        assert finished[request].outputs[0].token_ids == want


def test_abort(llm):
    core = llm.engine
    ids = llm.tokenizer(PROMPT)["input_ids"]
    request = core.add_request(ids, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    core.step()
    core.abort_request(request)
    assert not core.has_unfinished_requests()
    assert core.step() == []


def test_chat_batch_of_conversations(llm):
    conversations = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]]
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=3))
    assert len(outs) == 2 and outs[0].prompt_token_ids != outs[1].prompt_token_ids
    assert all(o.finished for o in outs)


def test_sampler_units():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    assert pick_token(logits, SamplingParams(temperature=0), None) == 3
    gen = torch.Generator().manual_seed(0)
    assert {pick_token(logits, SamplingParams(top_k=1), gen) for _ in range(20)} == {3}
    assert {pick_token(logits, SamplingParams(top_p=0.01), gen) for _ in range(20)} == {3}
    assert {pick_token(logits, SamplingParams(top_k=2), gen) for _ in range(100)} == {0, 3}
    prompt, output = torch.tensor([1]), torch.tensor([0, 0, 3])
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt, output)
    assert rep.tolist() == [1.0, -2.0, 0.5, 1.5]
    pen = apply_penalties(
        logits, SamplingParams(presence_penalty=0.5, frequency_penalty=1.0), prompt, output
    )
    assert pen.tolist() == [2.0 - 2.0 - 0.5, -1.0, 0.5, 3.0 - 1.0 - 0.5]


def _drain(core: EngineCore) -> dict:
    finished = {}
    for _ in range(200):
        for out in core.step():
            if out.finished:
                finished[out.request_id] = out
        if not core.has_unfinished_requests():
            return finished
    raise AssertionError("engine did not finish")
