"""Where a native decode step spends its time: forward, LM head, sampling, the rest.

Builds the built-in SmolLM2-135M through ``LLM(model_impl="native")`` and drives its
``NativeEngineCore`` step by step: ``batch`` greedy requests are prefilled, then
``steps`` decode steps are timed. The model's ``hidden_states`` and ``logits`` are
wrapped with timers on the instance, so each step splits into forward (decoder
layers), head (LM head) and everything else (sampling, detokenization, bookkeeping).
Figures are medians over the steps; run it several times on a shared machine.

    python -m bench.decode_profile --batch 1 16 --steps 40
    python -m bench.decode_profile --batch 16 --torch-profile   # top ops by self CPU time
    python -m bench.decode_profile --batch 16 --same-prompt     # rows of one length
    python -m bench.decode_profile --batch 1 16 --compare-lean  # lean pass vs modules
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]


def _timed(obj: Any, name: str, sink: list[float]) -> None:
    inner = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = inner(*args, **kwargs)
        sink.append(time.perf_counter() - started)
        return out

    setattr(obj, name, wrapper)


def profile_batch(
    llm: Any,
    batch: int,
    steps: int,
    torch_profile: bool,
    compare: bool = False,
    compare_attention: bool = False,
    same_prompt: bool = False,
    compare_lean: bool = False,
) -> dict[str, float]:
    """Median ms per decode step (total, forward, head, other) at ``batch`` rows; with
    ``compare``, also the median step of the fused/packed linears vs plain ones; with
    ``compare_attention``, of one padded bf16 decode attention call vs one per length;
    with ``compare_lean``, of the lean decoder pass vs the module path (``fastpath.py``)."""
    import torch

    from tensorstream.engine import SamplingParams
    from tensorstream.engine.models import fastpath, packing

    engine, model = llm.engine, llm.model
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        # distinct lengths by default; ``same_prompt``: one length, as the serve bench sends
        prompt = PROMPTS[0] if same_prompt else PROMPTS[i % 2] + " " * (i // 2)
        engine.add_request(llm.tokenizer.encode(prompt), params)
    forward: list[float] = []
    head: list[float] = []
    _timed(model, "hidden_states", forward)
    _timed(model, "logits", head)
    started = time.perf_counter()
    while any(not getattr(r, "decoding", False) for r in engine._rows) or not engine._rows:
        engine.step()  # prefill
    prefill = time.perf_counter() - started
    for _ in range(3):  # warm-up decode steps
        engine.step()
    forward.clear()
    head.clear()
    totals = []
    profiler = None
    if torch_profile:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    compared: dict[bool, list[float]] = {True: [], False: []}
    for step in range(steps):
        if compare:  # alternate the paths step by step: both see the same machine load
            packing.FAST_LINEARS = step % 2 == 0
        if compare_attention:
            engine.padded_decode = step % 2 == 0
        if compare_lean:
            fastpath.ENABLED = step % 2 == 0
        started = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - started)
        if compare_attention:
            fast = engine.padded_decode
        else:
            fast = fastpath.ENABLED if compare_lean else packing.FAST_LINEARS
        compared[fast].append(totals[-1])
    if compare:
        packing.FAST_LINEARS = True
    fastpath.ENABLED = True
    engine.padded_decode = True
    if profiler is not None:
        profiler.__exit__(None, None, None)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    while engine.has_unfinished_requests():
        engine.step()
    del model.hidden_states, model.logits  # drop the instance wrappers
    ms = 1000.0
    total = statistics.median(totals) * ms
    fwd = statistics.median(forward) * ms
    lm = statistics.median(head) * ms
    result = {}
    if compare or compare_attention or compare_lean:
        fast, plain = statistics.median(compared[True]), statistics.median(compared[False])
        result = {"fast_ms": fast * 1000, "plain_ms": plain * 1000, "speedup": plain / fast}
    return result | {
        "batch": batch,
        "prefill_ms": prefill * ms,
        "step_ms": total,
        "forward_ms": fwd,
        "head_ms": lm,
        "other_ms": total - fwd - lm,
        "ms_per_token": total / batch,
        "tok_s": batch / total * ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=1, help="runs per batch size")
    parser.add_argument("--torch-profile", action="store_true")
    parser.add_argument(
        "--same-prompt",
        action="store_true",
        help="every row the same prompt (one decode length, as bench.serve_bench sends)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="alternate fused/packed and plain linears per step; print both medians",
    )
    parser.add_argument(
        "--compare-attention",
        action="store_true",
        help="alternate one padded bf16 decode attention call and one per length, per step",
    )
    parser.add_argument(
        "--compare-lean",
        action="store_true",
        help="alternate the lean decoder pass and the module path per step",
    )
    args = parser.parse_args()

    import torch

    from tensorstream.engine import LLM
    from tensorstream.engine.builtin import materialize_builtin

    llm = LLM(
        str(materialize_builtin()),
        dtype=args.dtype,
        model_impl="native",
        cpu_threads=args.cpu_threads,
    )
    llm.generate(PROMPTS[0])  # warm-up
    print(
        f"threads={torch.get_num_threads()} interop={torch.get_num_interop_threads()} "
        f"mkldnn={torch.backends.mkldnn.is_available()} dtype={llm.model.dtype}"
    )
    for batch in args.batch:
        for _ in range(args.repeat):
            row = profile_batch(
                llm,
                batch,
                args.steps,
                args.torch_profile,
                args.compare,
                args.compare_attention,
                args.same_prompt,
                args.compare_lean,
            )
            print(
                "batch {batch:3d}: step {step_ms:7.2f} ms (forward {forward_ms:6.2f}, "
                "head {head_ms:5.2f}, other {other_ms:5.2f}) = {ms_per_token:6.2f} ms/token, "
                "{tok_s:6.1f} tok/s; prefill {prefill_ms:6.1f} ms".format(**row),
                flush=True,
            )
            if args.compare:
                print(
                    "  same run, alternating steps: fused/packed {fast_ms:7.2f} ms, "
                    "plain {plain_ms:7.2f} ms per step ({speedup:.2f}x)".format(**row),
                    flush=True,
                )
            if args.compare_lean:
                print(
                    "  same run, alternating steps: lean pass {fast_ms:7.2f} ms, "
                    "modules {plain_ms:7.2f} ms per step ({speedup:.2f}x)".format(**row),
                    flush=True,
                )
            if args.compare_attention:
                print(
                    "  same run, alternating steps: one padded attention call "
                    "{fast_ms:7.2f} ms, one per length {plain_ms:7.2f} ms per step "
                    "({speedup:.2f}x)".format(**row),
                    flush=True,
                )


if __name__ == "__main__":
    main()
