"""The plugin's streaming parts without a vLLM engine: batches, read-ahead, prefault,
rank-slice placement, ``deserialization_kwargs`` checking."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tensorstream.errors import ConfigError, FormatError, SourceError
from tensorstream.integrations.vllm_options import checked_deserializer_kwargs
from tensorstream.integrations.vllm_shards import copy_rank_slices
from tensorstream.integrations.vllm_stream import (
    batch_bytes_for,
    batch_plan,
    prefault,
    stream_batches,
)


def _records(*sizes: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(key=f"t{i}", data_length=n) for i, n in enumerate(sizes)]


def test_batch_plan_cuts_by_bytes_and_keeps_large_tensors_whole():
    plan = batch_plan(_records(10, 10, 10, 50, 5, 5), batch_bytes=25)
    assert [[r.key for r in b] for b in plan] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert batch_plan([], 25) == []


def test_batch_plan_counts_only_what_a_record_holds():
    """Views of the page cache hold nothing of their own: only the copies fill a batch."""
    records = _records(10, 10, 10, 50, 5, 5)
    copies = {"t0", "t2", "t4"}  # the others are views
    plan = batch_plan(records, 15, lambda r: r.data_length if r.key in copies else 0)
    assert [[r.key for r in b] for b in plan] == [["t0", "t1"], ["t2", "t3", "t4", "t5"]]
    every_byte = batch_plan(records, 15)
    assert [[r.key for r in b] for b in every_byte] == [
        ["t0"],
        ["t1"],
        ["t2"],
        ["t3"],
        ["t4", "t5"],
    ]


def test_batch_size_grows_with_the_file_within_bounds():
    mib = 1 << 20
    assert batch_bytes_for(269_000_000) == 32 * mib  # SmolLM2: batches as small as before
    assert batch_bytes_for(1_636_000_000) == 1_636_000_000 // 16  # the 1.5 GiB Llama: ~98 MiB
    assert batch_bytes_for(16 << 30) == 128 * mib
    assert batch_bytes_for(0) == 32 * mib


def test_stream_batches_reads_ahead_but_holds_few_batches():
    live = []
    peak = [0]
    lock = threading.Lock()

    def read(batch):
        with lock:
            live.append(batch)
            peak[0] = max(peak[0], len(live))
        return [(batch, i) for i in range(3)]

    out = []
    for batch, i in stream_batches(list(range(8)), read, ahead=1):
        out.append((batch, i))
        if i == 2:
            time.sleep(0.01)  # a slow consumer: the reader must wait, not run away
            with lock:
                live.remove(batch)
    assert out == [(b, i) for b in range(8) for i in range(3)]
    assert peak[0] <= 3  # queued + being read + being consumed


def test_stream_batches_raises_the_readers_error_and_stops_on_close():
    def failing(batch):
        if batch == 2:
            raise SourceError("storage went away")
        return [batch]

    with pytest.raises(SourceError, match="went away"):
        list(stream_batches(list(range(5)), failing))

    calls = []

    def read(batch):
        calls.append(batch)
        return [batch]

    gen = stream_batches(list(range(100)), read)
    assert next(gen) == 0
    gen.close()  # vLLM failed half-way: the reader stops soon after
    assert len(calls) < 10


def test_prefault_keeps_contents():
    tensors = [torch.arange(3_000_000, dtype=torch.float32), torch.ones(10)]
    prefault(tensors)
    assert torch.equal(tensors[0], torch.arange(3_000_000, dtype=torch.float32))
    assert torch.equal(tensors[1], torch.ones(10))


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(4, 6, bias=False)  # this rank: q 2 rows, k 2, v 2
        self.o_proj = nn.Linear(2, 4, bias=False)


class _Tiny(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attn()


def test_rank_slices_fill_fused_and_plain_parameters():
    model = _Tiny()
    q, k, v, o = (
        torch.full((2, 4), 1.0),
        torch.full((2, 4), 2.0),
        torch.full((2, 4), 3.0),
        torch.full((4, 2), 4.0),
    )
    named = [
        ("self_attn.k_proj.weight", 0, k),  # pieces may come in any order
        ("self_attn.q_proj.weight", 0, q),
        ("self_attn.o_proj.weight", 0, o),
        ("self_attn.v_proj.weight", 0, v),
        ("self_attn.rotary_emb.inv_freq", 1, torch.ones(2)),
    ]
    assert copy_rank_slices(model, named, "x.tensors") == 4
    assert torch.equal(model.self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert torch.equal(model.self_attn.o_proj.weight, o)


@pytest.mark.parametrize(
    "named, words",
    [
        ([("self_attn.o_proj.weight", 0, torch.ones(4, 4))], ["o_proj", "[4, 4]", "[4, 2]"]),
        ([("self_attn.q_proj.weight", 0, torch.ones(2, 4))], ["qkv_proj", "pieces"]),
        ([("mlp.up_proj.weight", 0, torch.ones(2, 4))], ["up_proj", "not a parameter"]),
    ],
)
def test_rank_slices_that_do_not_fit_are_format_errors(named, words):
    with pytest.raises(FormatError) as info:
        copy_rank_slices(_Tiny(), named, "x.tensors")
    assert all(w in str(info.value) for w in words), str(info.value)


def test_deserializer_kwargs_are_checked_against_the_public_signature():
    assert checked_deserializer_kwargs({"use_mmap": False, "plaid_mode": True}) == {
        "use_mmap": False
    }
    with pytest.raises(ConfigError, match="bogus"):
        checked_deserializer_kwargs({"bogus": 1})
