"""Child process of the load fuzz test: load mutants under an address-space limit.

Run as ``python fuzz_child.py JOB.json RESULTS.txt``. For each mutant it appends
``START <id>`` before touching it and ``RESULT <id> <outcome>`` after, flushed at
once, so the parent can name the mutant a crash (signal, abort) or hang happened in.
Outcomes: ``ok`` (bit-identical to the original), ``err <Class>`` (a tensorstream
error), ``loaded`` (no reference to compare with: safetensors), ``wrong <detail>``
(silent wrong data), ``exc <Type> <message>`` (any other exception), ``timeout``,
and ``inspect-bad <detail>`` for a ``tensorstream inspect`` run that misbehaved.
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import signal
import sys
import traceback
from typing import Any


class _Timeout(BaseException):
    """Raised by SIGALRM: a mutant took longer than its budget."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def _flat(d: Any, prefix: tuple[Any, ...] = ()) -> dict[Any, Any]:
    """Every tensor under its full path (structured state dicts nest mappings)."""
    out: dict[Any, Any] = {}
    for k in d.keys():
        v = d[k]
        if hasattr(v, "keys"):
            out.update(_flat(v, (*prefix, k)))
        else:
            out[(*prefix, k) if prefix else k] = v
    return out


def _raw(t: Any) -> Any:
    import torch

    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _compare(got: dict[Any, Any], want: dict[Any, Any]) -> str | None:
    import torch

    if list(got) != list(want):
        return f"keys {list(got)[:8]} != {list(want)[:8]}"
    for k, t in want.items():
        g = got[k]
        if not isinstance(g, torch.Tensor):
            return f"{k!r} is a {type(g).__name__}"
        if g.dtype != t.dtype or tuple(g.shape) != tuple(t.shape):
            return f"{k!r}: {g.dtype}{tuple(g.shape)} != {t.dtype}{tuple(t.shape)}"
        if not torch.equal(_raw(g), _raw(t)):
            return f"{k!r}: bits differ"
    return None


def _load(item: dict[str, Any]) -> dict[Any, Any]:
    from tensorstream import TensorDeserializer
    from tensorstream.crypto import DecryptionParams

    # safetensors stores no hashes, so verify_hash is refused for it: parse and load plainly.
    verify = not str(item["path"]).endswith(".safetensors")
    kwargs: dict[str, Any] = {"device": "cpu", "verify_hash": verify}
    if item.get("key"):
        kwargs["encryption"] = DecryptionParams.from_key(bytes.fromhex(item["key"]))
        kwargs["manifest"] = False  # the file's own checks, not the manifest's
    mode = item["mode"]
    if mode == "copy":
        kwargs["use_mmap"] = False
    elif mode == "lazy":
        kwargs["lazy_load"] = True
    elif mode == "staged":
        kwargs["num_readers"] = 2
    TensorDeserializer._force_staged = mode == "staged"
    try:
        with TensorDeserializer(item["path"], **kwargs) as d:
            return _flat(d)
    finally:
        TensorDeserializer._force_staged = False


def _inspect(path: str) -> str | None:
    """``tensorstream inspect``: succeeds, or exits 2 with one line and no traceback."""
    from tensorstream.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["inspect", path])
    text = err.getvalue()
    if rc == 0:
        return None
    if rc != 2 or "Traceback" in text or len(text.strip().splitlines()) != 1:
        return f"rc={rc} stderr={text.strip()[:300]!r}"
    return None


def _run_one(item: dict[str, Any], refs: dict[str, dict[Any, Any]]) -> str:
    from tensorstream.errors import TensorStreamError

    try:
        got = _load(item)
    except TensorStreamError as exc:
        outcome = f"err {type(exc).__name__}"
    else:
        ref = refs.get(item["ref"]) if item["kind"] == "tensorizer" else None
        if ref is None:
            outcome = "loaded"
        else:
            diff = _compare(got, ref)
            outcome = "ok" if diff is None else f"wrong {diff}"
    if item.get("inspect"):
        bad = _inspect(item["path"])
        if bad is not None:
            outcome = f"inspect-bad {bad}"
    return outcome


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    limit = int(job["as_limit"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _on_alarm)
    out = open(sys.argv[2], "a", buffering=1)
    import torch  # noqa: F401 - imported under the limit, like a real load

    refs: dict[str, dict[Any, Any]] = {}
    for ref in job["refs"]:
        refs[ref["path"]] = _load({**ref, "mode": "copy"})
    for item in job["items"]:
        out.write(f"START {item['id']}\n")
        signal.alarm(int(job["timeout"]))
        try:
            outcome = _run_one(item, refs)
        except _Timeout:
            outcome = "timeout"
        except BaseException as exc:  # noqa: BLE001 - report every other failure
            where = traceback.extract_tb(exc.__traceback__)[-1]
            outcome = (
                f"exc {type(exc).__name__} {str(exc)[:200]!r} at "
                f"{where.filename.rsplit('/', 1)[-1]}:{where.lineno}"
            )
        finally:
            signal.alarm(0)
        out.write(f"RESULT {item['id']} {' '.join(outcome.split())}\n")
    out.close()


if __name__ == "__main__":
    main()
