"""Pick the next token of one sequence from its logits: penalties, temperature, top-k/p, draw.

Pure functions over one row of logits, so each request can carry its own
settings and its own ``torch.Generator`` while the model runs them as a batch.
"""

from __future__ import annotations

import torch

from tensorstream.engine.outputs import Logprob
from tensorstream.engine.sampling import SamplingParams

__all__ = ["apply_penalties", "pick_token", "row_argmax", "top_logprobs"]

#: Vocabulary entries per block in :func:`row_argmax`.
ARGMAX_BLOCK = 256


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of a [rows, vocab] float tensor, the same indices, faster.

    torch's CPU ``argmax`` along the last dimension does not vectorize (measured: 0.66 ms
    for 16 x 49152 float32, against 0.04 ms for ``amax``). So: each block's maximum by
    ``amax``, the first block holding the row's maximum by ``argmax`` over those few values,
    then ``argmax`` inside that block. Ties and NaNs resolve as torch's: the first maximal
    (or first NaN) entry wins, because the first block holding it is chosen.
    """
    rows, vocab = logits.shape
    whole = vocab - vocab % ARGMAX_BLOCK
    if whole == 0:
        return logits.argmax(-1)
    maxima = logits[:, :whole].reshape(rows, -1, ARGMAX_BLOCK).amax(-1)
    if whole < vocab:
        maxima = torch.cat([maxima, logits[:, whole:].amax(-1, keepdim=True)], dim=1)
    starts = maxima.argmax(-1) * ARGMAX_BLOCK
    # The last block may be short: clamping repeats its last entry, after the real ones.
    offsets = torch.arange(ARGMAX_BLOCK, device=logits.device)
    index = (starts[:, None] + offsets).clamp_max_(vocab - 1)
    return starts + logits.gather(1, index).argmax(-1)


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: torch.Tensor, output_ids: torch.Tensor
) -> torch.Tensor:
    """Return ``logits`` (1-D, float32) processed as ``params`` asks, before sampling.

    In order: only ``allowed_token_ids`` survive; EOS and stop ids are masked until
    ``min_tokens`` are out; ``logit_bias`` is added; then the penalties. Repetition
    penalty follows Hugging Face (over prompt and output: negative logits are
    multiplied, positive divided); presence and frequency penalties follow OpenAI/vLLM
    (over output tokens only).
    """
    size = logits.numel()
    if params.allowed_token_ids is not None:
        keep = torch.tensor(
            [i for i in params.allowed_token_ids if i < size],
            dtype=torch.long,
            device=logits.device,
        )
        masked = torch.full_like(logits, float("-inf"))
        masked[keep] = logits[keep]
        logits = masked
    if params.min_tokens_blocked and output_ids.numel() < params.min_tokens:
        blocked = [i for i in params.min_tokens_blocked if i < size]
        if blocked:
            logits = logits.clone()
            logits[torch.tensor(blocked, dtype=torch.long, device=logits.device)] = float("-inf")
    if params.logit_bias:
        ids = [i for i in params.logit_bias if i < size]
        if ids:
            logits = logits.clone()
            index = torch.tensor(ids, dtype=torch.long, device=logits.device)
            bias = torch.tensor(
                [params.logit_bias[i] for i in ids], dtype=logits.dtype, device=logits.device
            )
            logits[index] += bias
    if params.repetition_penalty != 1.0:
        seen = torch.cat([prompt_ids, output_ids]).unique()
        scores = logits[seen]
        scores = torch.where(
            scores < 0, scores * params.repetition_penalty, scores / params.repetition_penalty
        )
        logits = logits.clone()
        logits[seen] = scores
    if (params.presence_penalty or params.frequency_penalty) and output_ids.numel():
        counts = torch.bincount(output_ids, minlength=logits.numel())[: logits.numel()].to(
            logits.dtype
        )
        logits = (
            logits
            - params.frequency_penalty * counts
            - params.presence_penalty * (counts > 0).to(logits.dtype)
        )
    return logits


def pick_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """Choose the next token from processed 1-D float32 ``logits``.

    Greedy (temperature 0) is a plain argmax, identical to transformers' greedy search.
    Otherwise: temperature, then min-p, top-k, top-p, then one draw from ``generator``.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.min_p > 0.0:
        # min_p scales with the most likely token: keep p >= min_p * p_max.
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the mass *before* it already reaches top_p; the top token always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(
    logprobs: torch.Tensor, chosen: int, k: int, decode: callable | None = None
) -> dict[int, Logprob]:
    """The ``k`` most likely tokens plus the chosen one, with their log-probs and ranks."""
    result: dict[int, Logprob] = {}
    if k > 0:
        values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
        for rank, (value, token) in enumerate(
            zip(values.tolist(), ids.tolist(), strict=True), start=1
        ):
            result[token] = Logprob(value, rank, decode(token) if decode else None)
    if chosen not in result:
        value = float(logprobs[chosen])
        rank = int((logprobs > logprobs[chosen]).sum()) + 1
        result[chosen] = Logprob(value, rank, decode(chosen) if decode else None)
    return result
