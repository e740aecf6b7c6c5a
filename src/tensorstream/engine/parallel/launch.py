"""Start the ranks of a tensor-parallel ``LLM`` and load each rank's part of the model.

Owns process-group set-up and worker spawn: rank 0 is the calling process; ranks
1..N-1 are started with ``torch.multiprocessing`` (spawn) and join a gloo group over
localhost (NCCL on CUDA). Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) the
existing processes are the ranks: rank 0 returns a working ``LLM``, the others follow
it and exit when it stops. Each rank loads its rank file or its slices itself
(``weights.py``), reports bytes read, GB/s and host memory, and rank 0 logs the sum.
A rank that fails to load makes every rank stop with that rank's error.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tensorstream.errors import ConfigError, ParallelError

__all__ = ["RankReport", "start_parallel"]

log = logging.getLogger("tensorstream.engine.parallel")

TIMEOUT_ENV = "TENSORSTREAM_TP_TIMEOUT"
#: The ranks this process started (one tensor-parallel LLM at a time).
_ACTIVE: Any = None


@dataclass
class RankReport:
    """One rank's load: what it read, how fast, and its host memory afterwards."""

    rank: int
    uri: str = ""
    bytes_read: int = 0
    seconds: float = 0.0
    rss_bytes: int = 0
    vocab_split: bool = False
    error: tuple[str, str] | None = None

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class _Job:
    """Everything a rank needs to load its part (pickled to spawned ranks)."""

    location: Any
    load_format: str
    extra: dict[str, Any]
    dtype: torch.dtype
    device: str
    max_model_len: int
    threads: int
    world_size: int
    timeout_s: float
    init_method: str = "env://"
    backend: str = "gloo"
    reports: list[RankReport] = field(default_factory=list)


def _rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rank_device(job: _Job, rank: int) -> torch.device:
    device = torch.device(job.device)
    if device.type == "cuda":
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return device


def _load_rank(job: _Job, rank: int) -> tuple[RankReport, Any, Any]:
    """Build this rank's model part and KV cache; never raises (errors go in the report)."""
    from tensorstream.engine.kvcache import KVCache
    from tensorstream.engine.models.config import NativeConfig, read_config_json
    from tensorstream.engine.models.llama import NativeCausalLM
    from tensorstream.engine.models.select import fill_native
    from tensorstream.engine.parallel.plan import local_config, make_parallel, vocab_splits
    from tensorstream.engine.parallel.vocab import split_vocab
    from tensorstream.engine.parallel.weights import load_rank_weights

    report = RankReport(rank)
    try:
        device = _rank_device(job, rank)
        files = Path(job.location.files_dir)
        config = NativeConfig.from_dict(read_config_json(files), source=str(files / "config.json"))
        local = local_config(config, job.world_size)
        weights = load_rank_weights(
            job.location,
            job.load_format,
            job.extra,
            rank=rank,
            world_size=job.world_size,
            dtype=job.dtype,
            device=device,
            config=config,
        )
        with torch.device("meta"):
            model = NativeCausalLM(local)
        embed, head = vocab_splits(weights.plan)
        split_vocab(model, rank, job.world_size, embed=embed, head=head)
        report.vocab_split = embed or head
        model.model.rotary_emb.reset_parameters(device)
        fill_native(model, weights.tensors, dtype=job.dtype, device=device, source=weights.uri)
        make_parallel(model, rank)
        cache = KVCache(
            local.num_hidden_layers,
            local.num_key_value_heads,
            local.head_dim,
            dtype=model.dtype,
            device=device,
            max_length=job.max_model_len,
        )
        report.uri, report.bytes_read, report.seconds = (
            weights.uri,
            weights.bytes_read,
            (weights.seconds),
        )
        report.rss_bytes = _rss()
        return report, model, cache
    except Exception as exc:
        report.error = (type(exc).__name__, str(exc))
        return report, None, None


def _gather(report: RankReport, world_size: int) -> list[RankReport]:
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, report)
    return out


def _raise_first(reports: list[RankReport]) -> None:
    """Raise the lowest failed rank's error (its own class when it is one of ours)."""
    import tensorstream.errors as errors

    for r in reports:
        if r.error is not None:
            name, message = r.error
            cls = getattr(errors, name, None)
            if not (isinstance(cls, type) and issubclass(cls, errors.TensorStreamError)):
                cls = ParallelError
                message = f"{name}: {message}"
            raise cls(f"tensor-parallel rank {r.rank} could not load its weights: {message}")


def _follower_main(rank: int, job: _Job, errors: Any) -> None:
    """Spawned rank: join the group, load, report, then follow rank 0 until it stops."""
    import torch.distributed as dist

    from tensorstream.engine.parallel.runtime import follow

    os.environ["TENSORSTREAM_TP_OWN_GROUP"] = "1"
    try:
        torch.set_num_threads(job.threads)
        host, port = job.init_method.removeprefix("tcp://").rsplit(":", 1)
        timeout = datetime.timedelta(seconds=job.timeout_s)
        store = dist.TCPStore(host, int(port), job.world_size, False, timeout=timeout)
        store.set(f"tensorstream-tp-ready-{rank}", "1")
        dist.init_process_group(
            job.backend, store=store, rank=rank, world_size=job.world_size, timeout=timeout
        )
        report, model, cache = _load_rank(job, rank)
        reports = _gather(report, job.world_size)
        if any(r.error for r in reports):
            os._exit(1)  # rank 0 raises the error; nothing to add here
        device = _rank_device(job, rank) if job.backend == "nccl" else None
        follow(model, cache, device)
    except BaseException as exc:
        try:
            errors.put((rank, f"{type(exc).__name__}: {exc}"))
        finally:
            os._exit(1)
    os._exit(0)


def _form_group(job: _Job, children: list[Any], errors: Any) -> None:
    """Rank 0: host the rendezvous, wait until every child has reached it (naming any
    that died first, instead of waiting out the timeout), then form the group."""
    import torch.distributed as dist

    host, port = job.init_method.removeprefix("tcp://").rsplit(":", 1)
    timeout = datetime.timedelta(seconds=job.timeout_s)
    store = dist.TCPStore(
        host, int(port), job.world_size, True, timeout=timeout, wait_for_workers=False
    )
    keys = [f"tensorstream-tp-ready-{rank}" for rank in range(1, job.world_size)]
    deadline = time.monotonic() + job.timeout_s
    while not store.check(keys):
        for rank, child in enumerate(children, start=1):
            if not child.is_alive():
                cause = f"exit code {child.exitcode}"
                if not errors.empty():
                    cause = "{1}".format(*errors.get())
                for other in children:
                    other.kill()
                raise ParallelError(
                    f"tensor-parallel rank {rank} stopped before joining the group ({cause}); "
                    "every rank was stopped"
                )
        if time.monotonic() > deadline:
            for other in children:
                other.kill()
            raise ParallelError(
                f"tensor-parallel ranks did not join within {job.timeout_s:.0f} s "
                f"(${TIMEOUT_ENV}); every rank was stopped"
            )
        time.sleep(0.05)
    dist.init_process_group(
        job.backend, store=store, rank=0, world_size=job.world_size, timeout=timeout
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _destroy_group_at_exit() -> None:
    """Under torchrun, rank 0's default process group, torn down once its program is over.

    Left to interpreter teardown, gloo's worker threads can still hold work when the
    interpreter is gone, and the process aborts (``terminate called without an active
    exception``, SIGABRT: torch issue 190489): 6 of 16 three-rank runs on two busy cores
    here, 0 of 16 with this. The user's program has ended when this runs (registered
    before ``Driver.close``, it runs after it); only an exit handler of theirs registered
    before the LLM and using the group would find it gone.
    """
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # shutting down; the group may be broken already
        log.debug("destroy_process_group at exit failed: %s", exc)


def start_parallel(
    llm: Any,
    world_size: int,
    *,
    load_format: str,
    extra: dict[str, Any],
    dtype: Any,
    seed: int | None,
    tokenizer: Any,
    max_model_len: int | None,
    max_num_batched_tokens: int | None,
    model_impl: str,
    chat_template: Any,
) -> None:
    """Fill ``llm`` (an ``LLM`` being constructed) with a tensor-parallel native engine.

    Raises:
        ConfigError: not a native model, LoRA asked for, or a split does not divide.
        ShardMismatchError / SourceError / FormatError: a rank could not load (named).
        ParallelError: a rank died or the group could not form.
    """
    import torch.distributed as dist

    from tensorstream.engine.build import resolve_dtype
    from tensorstream.engine.load_stats import LoadStats
    from tensorstream.engine.model_files import context_length, eos_ids, template_text
    from tensorstream.engine.models.config import NativeConfig, read_config_json
    from tensorstream.engine.models.select import choose_model_impl
    from tensorstream.engine.native_core import NativeEngineCore
    from tensorstream.engine.parallel.plan import local_config
    from tensorstream.engine.parallel.runtime import Driver, ParallelCache, ParallelModel
    from tensorstream.engine.tokenizer import NativeTokenizer

    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    if llm.enable_lora:
        raise ConfigError("enable_lora is not supported with tensor_parallel_size > 1")
    files = llm.location.files_dir
    tok_dir = tokenizer or files
    if choose_model_impl(model_impl, files, tokenizer_dir=tok_dir) != "native":
        raise ConfigError(
            "tensor_parallel_size > 1 runs the native Llama-family code only; this model "
            "(or model_impl) needs transformers; use tensor_parallel_size=1"
        )
    config = NativeConfig.from_dict(
        read_config_json(files), source=str(Path(files) / "config.json")
    )
    try:  # refuse an indivisible split before starting ranks
        local_config(config, world_size)
    except ConfigError as exc:
        raise ConfigError(
            f"LLM(tensor_parallel_size={world_size}) cannot be honoured: {exc}"
        ) from exc
    llm.model_impl = "native"
    llm.config = config
    llm.tokenizer = NativeTokenizer(tok_dir)
    if chat_template is not None:
        llm.tokenizer.chat_template = template_text(chat_template)
    llm.dtype = resolve_dtype(dtype, config, llm.device)
    llm.load_format = load_format
    llm.max_model_len = context_length(config, max_model_len)
    llm.lora_manager = None
    cuda = llm.device.type == "cuda"
    job = _Job(
        location=llm.location,
        load_format=load_format,
        extra=dict(extra),
        dtype=llm.dtype,
        device=str(llm.device),
        max_model_len=llm.max_model_len,
        threads=max(1, llm.cpu_threads),
        world_size=world_size,
        timeout_s=float(os.environ.get(TIMEOUT_ENV, "30")),
        backend="nccl" if cuda else "gloo",
    )
    started = time.perf_counter()
    children: list[Any] = []
    errors = None
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if torchrun:
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ConfigError(
                f"torchrun started {os.environ['WORLD_SIZE']} ranks but tensor_parallel_size="
                f"{world_size}; make them equal"
            )
        rank = int(os.environ["RANK"])
        if not dist.is_initialized():
            dist.init_process_group(job.backend, timeout=datetime.timedelta(seconds=job.timeout_s))
        if rank != 0:
            report, model, cache = _load_rank(job, rank)
            if not any(r.error for r in _gather(report, world_size)):
                from tensorstream.engine.parallel.runtime import follow

                follow(model, cache, _rank_device(job, rank) if cuda else None)
            # This rank's program ends here, so its group is ours to tear down (see
            # _destroy_group_at_exit: left to interpreter teardown, gloo may abort).
            dist.destroy_process_group()
            raise SystemExit(0)
    else:
        import torch.multiprocessing as mp

        global _ACTIVE
        if _ACTIVE is not None:  # one tensor-parallel LLM per process: stop the previous one
            if not _ACTIVE.failure:
                log.warning("stopping the previous tensor-parallel LLM's ranks to start new ones")
            _ACTIVE.close()
            _ACTIVE = None
        if dist.is_initialized():
            raise ConfigError(
                "a torch.distributed process group already exists in this process; start "
                "the ranks with torchrun (RANK/WORLD_SIZE set) or let LLM form the group"
            )

        job.init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        errors = ctx.SimpleQueue()
        for rank in range(1, world_size):
            child = ctx.Process(
                target=_follower_main,
                args=(rank, job, errors),
                daemon=True,
                name=f"tensorstream-tp-rank{rank}",
            )
            child.start()
            children.append(child)
        os.environ["TENSORSTREAM_TP_OWN_GROUP"] = "1"
        _form_group(job, children, errors)
    driver = Driver(world_size, children, errors, _rank_device(job, 0) if cuda else None)
    report, model, cache = _load_rank(job, 0)
    try:
        try:
            reports = _gather(report, world_size)
        except Exception as exc:  # a rank died while loading
            raise driver.fail(exc) from exc
        _raise_first(reports)
    except BaseException:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    driver.start()
    if torchrun:  # atexit runs last-in first-out: this after driver.close
        atexit.register(_destroy_group_at_exit)
    atexit.register(driver.close)  # tell the followers to stop when this process ends
    if not torchrun:
        _ACTIVE = driver
    llm._parallel = driver
    llm.parallel_reports = reports
    total = sum(r.bytes_read for r in reports)
    slowest = max(r.seconds for r in reports)
    for r in reports:
        log.info(
            "rank %d: %s, %.1f MB read in %.2f s (%.2f GB/s), host RSS %.0f MB",
            r.rank,
            r.uri,
            r.bytes_read / 1e6,
            r.seconds,
            r.gb_per_s,
            r.rss_bytes / 1e6,
        )
    log.info(
        "tensor parallel x%d: %.1f MB read by all ranks in %.2f s (%.2f GB/s summed); "
        "embed_tokens/lm_head %s",
        world_size,
        total / 1e6,
        slowest,
        total / slowest / 1e9 if slowest else 0.0,
        "split along the vocab" if reports[0].vocab_split else "replicated",
    )
    wrapped = ParallelModel(model, driver)
    llm.model = wrapped
    llm.load_stats = LoadStats(
        load_format,
        reports[0].uri,
        total,
        slowest,
        0.0,
        usable_seconds=time.perf_counter() - started,
    )
    eos = eos_ids(files, config, llm.tokenizer)
    engine = NativeEngineCore(
        wrapped,
        llm.tokenizer,
        max_model_len=llm.max_model_len,
        eos_token_ids=eos,
        seed=seed,
        max_num_batched_tokens=max_num_batched_tokens or 512,
    )
    engine.cache = ParallelCache(cache, driver)  # rank 0's own, built like the followers'
    llm.engine = engine
