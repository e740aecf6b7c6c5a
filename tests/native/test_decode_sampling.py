"""The native engine's batched greedy sampling equals the per-row sampler."""

from __future__ import annotations

from tensorstream.engine import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time, in a small village by the sea,", "Hi"]


def test_batched_greedy_equals_per_row_path(tiny):
    llm = LLM(str(tiny("llama")), device="cpu", dtype="float32")
    fast = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # logprobs=1 sends every row through the base engine's per-row sampler.
    slow = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    batched = llm.generate(PROMPTS, fast)
    reference = llm.generate(PROMPTS, slow)
    for ours, theirs in zip(batched, reference, strict=True):
        a, b = ours.outputs[0], theirs.outputs[0]
        assert a.token_ids == b.token_ids and len(a.token_ids) == 10
        assert a.text == b.text
        assert a.cumulative_logprob < 0
        assert abs(a.cumulative_logprob - b.cumulative_logprob) < 1e-4


def test_mixed_batch_keeps_seeded_sampling(tiny):
    """A sampled row beside greedy ones still draws from its own seeded generator."""
    llm = LLM(str(tiny("llama")), device="cpu", dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPTS[2], sampled)[0].outputs[0].token_ids
    mixed = llm.generate(PROMPTS, [greedy, greedy, sampled])
    assert mixed[2].outputs[0].token_ids == alone
    assert mixed[0].outputs[0].token_ids == llm.generate(PROMPTS[0], greedy)[0].outputs[0].token_ids
