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
    python -m bench.decode_profile --batch 1 16 --compare-rowops  # fused row operators vs torch's
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


#: What ``--compare-X`` alternates step by step: (module, attribute, on, off, printed
#: as "ON ms, OFF ms"); the engine's own switch when the module is None.
SWITCHES = {
    "packing": ("packing", "FAST_LINEARS", True, False, "fused/packed", "plain"),
    "attention": (None, "padded_decode", True, False,
                  "one padded attention call", "one per length"),
    "lean": ("fastpath", "ENABLED", True, False, "lean pass", "modules"),
    "rowops": ("rowops", "ENABLED", True, False, "fused row operators", "torch operators"),
    "rowmatmul": ("rowmatmul", "ENABLED", True, False, "small-batch matmul (AMX/AVX-512)", "oneDNN alone"),
    "stack": ("rowmatmul", "STACK", True, False, "one C call per step", "Python lean pass"),
}  # fmt: skip


def _switch(engine: Any, name: str) -> tuple[Any, str]:
    import importlib

    module, attribute = SWITCHES[name][:2]
    owner = engine if module is None else importlib.import_module(
        f"tensorstream.engine.models.{module}"
    )  # fmt: skip
    return owner, attribute


def profile_batch(
    llm: Any,
    batch: int,
    steps: int,
    torch_profile: bool,
    compare: str | None = None,
    same_prompt: bool = False,
) -> dict[str, float]:
    """Median ms per decode step (total, forward, head, other) at ``batch`` rows; with
    ``compare`` (a :data:`SWITCHES` name), also the median step with that switch on and
    off, alternating step by step."""
    import torch

    from tensorstream.engine import SamplingParams

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
    owner, attribute = _switch(engine, compare) if compare else (None, "")
    for step in range(steps):
        on = step % 2 == 0  # alternate the paths step by step: both see the same machine load
        if owner is not None:
            setattr(owner, attribute, SWITCHES[compare][2 if on else 3])
        started = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - started)
        compared[on].append(totals[-1])
    if owner is not None:
        setattr(owner, attribute, SWITCHES[compare][2])
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
    if compare:
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
        action="store_const",
        const="packing",
        dest="compare",
        help="alternate fused/packed and plain linears per step; print both medians",
    )
    parser.add_argument(
        "--compare-attention",
        action="store_const",
        const="attention",
        dest="compare",
        help="alternate one padded bf16 decode attention call and one per length, per step",
    )
    parser.add_argument(
        "--compare-lean",
        action="store_const",
        const="lean",
        dest="compare",
        help="alternate the lean decoder pass and the module path per step",
    )
    parser.add_argument(
        "--compare-rowops",
        action="store_const", const="rowops", dest="compare",
        help="alternate the fused row operators (engine/models/rowops.py) and torch's, per step",
    )  # fmt: skip
    parser.add_argument(
        "--compare-rowmatmul",
        action="store_const", const="rowmatmul", dest="compare",
        help="alternate the small-batch matmul (engine/models/rowmatmul.py: AMX or AVX-512 bf16) and oneDNN alone",
    )  # fmt: skip
    parser.add_argument(
        "--compare-stack",
        action="store_const", const="stack", dest="compare",
        help="alternate decode steps as one C call (rowmatmul.DecodeStack) and the Python pass",
    )  # fmt: skip
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
                llm, batch, args.steps, args.torch_profile, args.compare, args.same_prompt
            )
            print(
                "batch {batch:3d}: step {step_ms:7.2f} ms (forward {forward_ms:6.2f}, "
                "head {head_ms:5.2f}, other {other_ms:5.2f}) = {ms_per_token:6.2f} ms/token, "
                "{tok_s:6.1f} tok/s; prefill {prefill_ms:6.1f} ms".format(**row),
                flush=True,
            )
            if args.compare:
                on, off = SWITCHES[args.compare][4:]
                print(
                    f"  same run, alternating steps: {on} {row['fast_ms']:7.2f} ms, "
                    f"{off} {row['plain_ms']:7.2f} ms per step ({row['speedup']:.2f}x)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
