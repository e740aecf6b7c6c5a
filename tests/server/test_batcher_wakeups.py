"""The engine thread wakes the event loop once per step, and a non-streaming reader only
when its request has finished (``server/batcher.py``)."""

from __future__ import annotations

import asyncio
import time

from tensorstream.engine.outputs import CompletionOutput, RequestOutput
from tensorstream.engine.sampling import SamplingParams
from tensorstream.server.batcher import EngineLoop


class CountingEngine:
    """A step-able core: every request gets one token per step, ``steps`` in all."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.progress: dict[str, int] = {}

    def add_request(self, prompt_token_ids, params, *, request_id, **_):
        self.progress[request_id] = 0

    def abort_request(self, request_id: str) -> None:
        self.progress.pop(request_id, None)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.01)  # a forward pass: the event loop runs between steps
        outputs = []
        for request_id in list(self.progress):
            self.progress[request_id] += 1
            done = self.progress[request_id] == self.steps
            tokens = list(range(self.progress[request_id]))
            completion = CompletionOutput(0, "x" * len(tokens), tokens, 0.0, None,
                                          "length" if done else None)  # fmt: skip
            outputs.append(RequestOutput(request_id, None, [1], [completion], finished=done))
            if done:
                del self.progress[request_id]
        return outputs


def test_one_wakeup_per_step_and_final_only_readers():
    async def run():
        loop = asyncio.get_running_loop()
        scheduled = [0]
        inner = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            scheduled[0] += 1
            return inner(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        engine = CountingEngine(steps=6)
        batcher = EngineLoop(engine)
        params = SamplingParams(max_tokens=6)
        streams = [batcher.submit([1], params) for _ in range(5)]
        wakes = [0] * 5
        for i, stream in enumerate(streams):
            original = stream._event.set

            def set_and_count(i=i, original=original):
                wakes[i] += 1
                original()

            stream._event.set = set_and_count  # type: ignore[method-assign]
        readers = asyncio.gather(*(s.result() for s in streams[:4]))
        updates: list[RequestOutput] = []

        async def follow() -> None:
            updates.extend([out async for out in streams[4].updates()])

        follower = asyncio.ensure_future(follow())
        await asyncio.sleep(0)  # the readers are waiting before the first step
        batcher.start()
        try:
            results = await asyncio.wait_for(readers, timeout=30)
            await asyncio.wait_for(follower, timeout=30)
        finally:
            batcher.stop()
        return results, updates, wakes, scheduled[0], batcher.steps

    results, updates, wakes, scheduled, steps = asyncio.run(run())
    assert [len(r.outputs[0].token_ids) for r in results] == [6, 6, 6, 6]
    assert all(r.finished for r in results)
    assert wakes[:4] == [1, 1, 1, 1]  # woken for the finished output only
    assert len(updates) >= 3 and updates[-1].finished  # a streaming reader sees progress
    assert wakes[4] == 6  # every step woke it
    assert steps == 6
    assert scheduled <= steps  # one hand-over per step for all five requests, not five
