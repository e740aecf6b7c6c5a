"""The rank loop: rank 0 drives, the other ranks replay each step's inputs.

Owns the step protocol and its failure handling. Rank 0 runs the engine as usual;
its model and KV cache are wrapped (:class:`ParallelModel`, :class:`ParallelCache`)
so every forward pass and every cache change is first broadcast as one small
command, then run locally. The followers (:func:`follow`) execute the same commands
on their own slices and caches; the all-reduces inside the forward pass keep every
rank's hidden states equal. A replicated head is rank 0's alone; a vocab-parallel
head is one more command (the picked hidden rows), after which every rank computes
its logits slice and rank 0 gathers them and samples.

Failure handling (no rank may hang on a collective):

* every collective has the process group's timeout (``TENSORSTREAM_TP_TIMEOUT``,
  default 30 s); a killed peer closes its sockets, which fails gloo at once;
* while idle, rank 0 pings the followers every few seconds (so an idle server's
  followers never time out) and checks that its child processes are alive;
* a follower that fails puts ``(rank, error)`` on a queue and exits; rank 0 turns the
  first failure into one :class:`~tensorstream.errors.ParallelError` naming the rank
  and the cause, stops the other children, and refuses further steps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from tensorstream.engine.models import rowmatmul
from tensorstream.errors import ParallelError

__all__ = ["Driver", "ParallelCache", "ParallelModel", "follow", "run_command"]

log = logging.getLogger("tensorstream.engine.parallel")

#: Seconds between rank 0's idle pings (and child-liveness checks).
HEARTBEAT_S = 3.0


def _broadcast(obj: Any, device: torch.device | None = None) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def run_command(cmd: tuple[Any, ...], model: Any, cache: Any) -> Any:
    """Execute one step command on this rank's model and cache."""
    kind = cmd[0]
    if kind == "ensure":
        cache.ensure(cmd[1], cmd[2])
    elif kind == "move":
        cache.move(cmd[1], cmd[2], cmd[3])
    elif kind == "forward":
        ids, positions, batch = cmd[1:]
        return model.hidden_states(ids, positions, dataclasses.replace(batch, cache=cache))
    elif kind == "logits":  # a vocab-parallel head: every rank computes its slice
        hidden = cmd[1].to(model.device)  # unpickled onto rank 0's device
        # rank 0's row layout: else a slice of a step above 32 rows rounds otherwise than alone
        with rowmatmul.engine_pass(rowmatmul.head_layout(hidden, model.dtype)):
            return model.logits(hidden)
    return None


def follow(model: Any, cache: Any, device: torch.device | None = None) -> None:
    """Follower loop: run rank 0's commands until it says stop (or the group fails)."""
    with torch.inference_mode():
        while True:
            cmd = _broadcast(None, device)
            if cmd[0] == "stop":
                return
            run_command(cmd, model, cache)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped responding"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Driver:
    """Rank 0's side: sends commands, watches the followers, turns failures into one error.

    Args:
        world_size: ranks, rank 0 included.
        children: the follower processes this rank started (empty under torchrun).
        errors: queue the followers report ``(rank, message)`` on (or ``None``).
        device: the device ``broadcast_object_list`` stages through (NCCL: the GPU).
    """

    def __init__(
        self,
        world_size: int,
        children: list[Any],
        errors: Any,
        device: torch.device | None = None,
    ) -> None:
        self.world_size = world_size
        self.children = children
        self.errors = errors
        self.device = device
        self.failure: ParallelError | None = None
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = threading.Event()
        self._watch = threading.Thread(target=self._heartbeat, name="tensorstream-tp", daemon=True)

    def start(self) -> None:
        """Start the idle pings and liveness checks (once every rank has loaded)."""
        self._watch.start()

    def run(self, cmd: tuple[Any, ...], local: Callable[[], Any]) -> Any:
        """Broadcast ``cmd``, then run ``local`` (rank 0's share of the same step)."""
        with self._lock:
            self._check()
            try:
                _broadcast(cmd, self.device)
                out = local()
            except ParallelError:
                raise
            except Exception as exc:
                raise self._fail(exc) from exc
            finally:
                self._last = time.monotonic()
            return out

    def _check(self) -> None:
        if self.failure is not None:
            raise ParallelError(str(self.failure))
        if self._closed.is_set():
            raise ParallelError("the tensor-parallel ranks were shut down; create a new LLM")

    def fail(self, cause: BaseException | None) -> ParallelError:
        """The error to raise for ``cause`` (naming the rank that failed); stops every rank."""
        return self._fail(cause)

    def _fail(self, cause: BaseException | None) -> ParallelError:
        """Name the failed rank and why, stop every child, and remember the error."""
        if self.failure is not None:
            return self.failure
        deadline = time.monotonic() + 5.0
        culprit = None
        while culprit is None and time.monotonic() < deadline:
            culprit = self._reported() or self._dead_child()
            if culprit is None:
                time.sleep(0.1)
        if culprit is None:
            what = f"rank 0: {type(cause).__name__}: {cause}" if cause else "a rank failed"
        else:
            what = culprit
        self.failure = ParallelError(
            f"tensor parallelism stopped: {what}; every rank was stopped. Fix the cause "
            "and create the LLM again"
        )
        log.error("%s", self.failure)
        self._stop_children()
        return self.failure

    def _reported(self) -> str | None:
        if self.errors is None:
            return None
        try:
            rank, message = self.errors.get_nowait()
        except Exception:  # queue.Empty, or a queue torn down with its process
            return None
        return f"rank {rank} failed: {message}"

    def _dead_child(self) -> str | None:
        for rank, child in enumerate(self.children, start=1):
            if not child.is_alive():
                return f"rank {rank} (pid {child.pid}) {_describe_exit(child.exitcode)}"
        return None

    def _stop_children(self) -> None:
        for child in self.children:
            if child.is_alive():
                child.terminate()
        for child in self.children:
            child.join(timeout=5)
            if child.is_alive():
                child.kill()
                child.join(timeout=5)

    def _heartbeat(self) -> None:
        while not self._closed.wait(HEARTBEAT_S):
            if self.failure is not None:
                return
            dead = self._dead_child()
            if dead is not None:
                # Not under the lock: the main thread may be blocked in a collective with
                # the dead rank; stopping the others now bounds how long anything waits.
                self._fail(None)
                return
            if time.monotonic() - self._last < HEARTBEAT_S or not self._lock.acquire(False):
                continue
            try:
                _broadcast(("ping",), self.device)
            except Exception as exc:
                self._fail(exc)
                return
            finally:
                self._last = time.monotonic()
                self._lock.release()

    def close(self) -> None:
        """Tell the followers to stop, and wait for them (bounded)."""
        if self._closed.is_set():
            return
        with self._lock:
            self._closed.set()
            if self.failure is None:
                try:
                    _broadcast(("stop",), self.device)
                except Exception as exc:  # a peer already gone: nothing left to stop
                    log.debug("stop broadcast failed: %s", exc)
        for child in self.children:
            child.join(timeout=10)
        self._stop_children()
        _destroy_own_group()


def _destroy_own_group() -> None:
    """Tear down the process group this package formed (never a torchrun user's)."""
    try:
        import torch.distributed as dist

        if dist.is_initialized() and os.environ.get("TENSORSTREAM_TP_OWN_GROUP") == "1":
            dist.destroy_process_group()
    except Exception as exc:  # shutting down; the group may be broken already
        log.debug("destroy_process_group failed: %s", exc)


class ParallelCache:
    """Rank 0's KV cache: growth and row moves are broadcast before they run."""

    def __init__(self, cache: Any, driver: Driver) -> None:
        self._cache = cache
        self._driver = driver

    def ensure(self, rows: int, length: int) -> None:
        if rows <= self._cache.rows and length <= self._cache.length:
            return  # the same no-op on every rank: nothing to send
        self._driver.run(("ensure", rows, length), lambda: self._cache.ensure(rows, length))

    def move(self, src: int, dst: int, length: int) -> None:
        self._driver.run(("move", src, dst, length), lambda: self._cache.move(src, dst, length))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


class ParallelModel(torch.nn.Module):
    """Rank 0's model: each ``hidden_states`` call is broadcast, then run here too."""

    def __init__(self, model: torch.nn.Module, driver: Driver) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config
        self._driver = driver

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def get_output_embeddings(self) -> Any:
        return self.inner.get_output_embeddings()

    def get_input_embeddings(self) -> Any:
        return self.inner.get_input_embeddings()

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> Any:
        if batch.adapters is not None:
            raise ParallelError("LoRA adapters are not supported with tensor_parallel_size > 1")
        # The batch minus what is rank 0's own (its cache); fields travel as they are, so
        # the engine's batch layout can change without touching the protocol.
        cmd = ("forward", input_ids, positions, dataclasses.replace(batch, cache=None))
        return self._driver.run(cmd, lambda: self.inner.hidden_states(input_ids, positions, batch))

    def logits(self, hidden: torch.Tensor, adapters: Any = None) -> torch.Tensor:
        from tensorstream.engine.parallel.vocab import VocabParallelHead

        if not isinstance(self.inner.lm_head, VocabParallelHead):
            return self.inner.logits(hidden, adapters)  # replicated head: rank 0 alone
        # The followers hold the same hidden states, but not which rows the engine picked:
        # the picked rows travel (rows x hidden, small), so the protocol stays index-free.
        hidden = hidden.contiguous()
        return self._driver.run(("logits", hidden), lambda: self.inner.logits(hidden, adapters))

    def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
        raise ParallelError("a tensor-parallel model runs through the engine (LLM.generate)")
