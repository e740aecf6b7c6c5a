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


def test_row_argmax_picks_torchs_index_ties_and_nans_included():
    import torch

    from tensorstream.engine.sampler import ARGMAX_BLOCK, row_argmax

    generator = torch.Generator().manual_seed(0)
    for vocab in (7, ARGMAX_BLOCK, 49152, 32001, 3 * ARGMAX_BLOCK + 5):
        logits = torch.randn(6, vocab, generator=generator) * 4
        logits[1, :] = 1.0  # all tied: the first index
        logits[2, vocab // 3] = logits[2, vocab - 1] = 50.0  # tie across blocks
        logits[3, vocab - 1] = 60.0  # the maximum in a short last block
        logits[4, vocab // 2] = float("nan")  # NaN wins, as in torch
        logits[5, 0] = float("-inf")
        assert torch.equal(row_argmax(logits), logits.argmax(-1)), vocab
