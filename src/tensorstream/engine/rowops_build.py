"""Builds and loads the fused row operators' C library (``engine/csrc/``); no torch import.

Owns: compiling the C sources with the system's C compiler (``-O3 -march=native``) into
the cache directory (``$TENSORSTREAM_CACHE`` or ``~/.cache/tensorstream``, under
``kernels/``; a per-user directory under the system's temporary directory where that is
read-only), keyed by the sources, the compiler and this CPU; loading the result with
ctypes, only from a directory and file of this user's that nobody else can write; and the
``TENSORSTREAM_ROWOPS`` switch. The torch-facing calls are
``engine/models/rowops.py``'s.

Torch-free so that ``LLM(...)`` can start the build before ``import torch``: a first
start on a fresh machine compiles for ~1 s on another core while torch imports and the
weights stream in; later starts find the library in the cache (~10 ms). The first forward
pass waits for it (:func:`library`), so a process never mixes the C arithmetic and
torch's. ``python -m tensorstream.engine.rowops_build`` builds it ahead (a container
image build, say) and prints where.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from importlib import resources
from pathlib import Path

from tensorstream.errors import ConfigError

__all__ = ["ENV", "SUFFIXES", "library", "start_build"]

logger = logging.getLogger("tensorstream.engine")

ENV = "TENSORSTREAM_ROWOPS"
_ABI = 7
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno")
#: dtype name -> the C functions' suffix.
SUFFIXES = {"bfloat16": "bf16", "float32": "float"}

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_norm": [_P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _F],
    "add_rows": [_P, _I, _P, _I, _I, _I],
    "silu_mul": [_P, _I, _P, _I, _P, _I, _I, _I, _I],
    "rope_store": [_P, _I, _P, _I, _P, _I, _P, _P, _I, _P, _P, _F, _P, _P, _P, _P] + [_I] * 5,
    "decode_attention": [_P, _I, _P, _P, _P, _P, _P, _I] + [_I] * 6 + [_P],
    "greedy_rows": [_P, _I, _I, _I, _P, _P],
    "rope_attend": [_P, _I, _P, _I, _P, _I, _P, _P, _I, _P, _P, _F, _P, _P, _P, _P]
    + [_I] * 5
    + [_I, _P, _I, _I, _I, _P],
}
_MATMUL = [_P, _I, _I, _I, _I, _P, _P, _P, _I, _I]
_PLAIN_MATMUL = [_P, _I, _I, _I, _I, _P, _I, _P, _P, _I]
_DECODE_STACK = [_P, _I, _I, _I, _P, _I, _I, _I, _I, _I, _F, _F] + [_P] * 11 + [_I]

_lock = threading.Lock()
_thread: threading.Thread | None = None
_lib: _Library | None = None
_error = ""
_resolved = False  # _lib/_error are final


class _Library:
    """The loaded shared object: one bound function per operator and dtype."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cdll = ctypes.CDLL(str(path))
        self.cdll.rowops_abi.restype = ctypes.c_int
        if self.cdll.rowops_abi() != _ABI:
            raise OSError(f"{path} has another ABI than this tensorstream")
        self.ops: dict[tuple[str, str], ctypes._CFuncPtr] = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, suffix in SUFFIXES.items():
                fn = getattr(self.cdll, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, None
                self.ops[name, dtype] = fn
        # The small-batch matmul (csrc/rowmatmul.h): bfloat16 only, on AMX or AVX-512 bf16.
        self.matmul = self.cdll.rowmatmul_bf16
        self.matmul.argtypes, self.matmul.restype = _MATMUL, ctypes.c_int
        self.cdll.rowmatmul_ready.restype = ctypes.c_int
        self.cdll.rowmatmul_block.restype = ctypes.c_int
        self.cdll.rowmatmul_second_thread.argtypes = [ctypes.c_int]
        self.cdll.rowmatmul_second_thread.restype = ctypes.c_int
        #: ``second_thread(0)``: where two-thread calls send half their outputs, 1 torch's
        #: OpenMP team, 2 the library's own helper thread (0: no matmul built);
        #: ``second_thread(2)`` forces the helper (tests), ``(0)`` looks again.
        self.second_thread = self.cdll.rowmatmul_second_thread
        self.plain_matmul = self.cdll.rowmatmul_plain_bf16
        self.plain_matmul.argtypes, self.plain_matmul.restype = _PLAIN_MATMUL, ctypes.c_int
        #: Outputs per block of the packed layout the matmul reads (0: no matmul built).
        self.matmul_block = int(self.cdll.rowmatmul_block())
        self.decode_stack = self.cdll.decode_stack_bf16
        self.decode_stack.argtypes, self.decode_stack.restype = _DECODE_STACK, ctypes.c_int
        self._matmul_ready: bool | None = None

    def matmul_ready(self) -> bool:
        """Whether this build has the matmul (AMX: and the kernel lets the process use it)."""
        if self._matmul_ready is None:
            self._matmul_ready = bool(self.cdll.rowmatmul_ready())
        return self._matmul_ready


def _mode() -> str:
    return os.environ.get(ENV, "").strip().lower()


def _disabled() -> bool:
    return _mode() in ("0", "false", "no", "off")


def _required() -> bool:
    return _mode() in ("1", "true", "yes", "on")


def _cache_roots() -> list[Path]:
    """Where the library may live: the cache directory, else (read-only home, as in many
    containers) a per-user directory in the system's temporary directory."""
    root = os.environ.get("TENSORSTREAM_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tensorstream"
    spare = Path(tempfile.gettempdir()) / f"tensorstream-kernels-{os.getuid()}"
    return [base / "kernels", spare]


def _private(path: Path, *, directory: bool) -> None:
    """Refuse a file or directory this process did not make its own: another user's, a
    symlink, or writable by others (a library loaded from there would run their code)."""
    info = os.lstat(path)
    kind = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if not kind or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(
            f"{path} is not private to this user (owner, type or permissions); remove it or "
            "set TENSORSTREAM_CACHE to a directory of your own"
        )


def _cache_dir() -> Path:
    """The first of :func:`_cache_roots` that is (or can be made) a private directory."""
    problems = []
    for root in _cache_roots():
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            _private(root, directory=True)
            if os.access(root, os.W_OK):
                return root
            problems.append(f"{root} is not writable")
        except OSError as exc:
            problems.append(str(exc))
    raise OSError("no cache directory for the kernel library: " + "; ".join(problems))


def _compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _sources() -> dict[str, bytes]:
    """The C sources shipped in the package: name -> bytes."""
    folder = resources.files("tensorstream.engine").joinpath("csrc")
    return {
        item.name: item.read_bytes()
        for item in folder.iterdir()
        if item.name.endswith((".c", ".h"))
    }


def _build(sources: dict[str, bytes]) -> Path:
    """The compiled library of ``sources`` on this machine (built now unless cached)."""
    compiler = _compiler()
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH; set CC to one")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    digest = hashlib.sha256()
    for part in (compiler, version, " ".join(_FLAGS), _cpu_identity()):
        digest.update(part.encode() + b"\0")
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + sources[name] + b"\0")
    root = _cache_dir()
    target = root / f"rowops-{digest.hexdigest()[:24]}.so"
    if target.exists():
        _private(target, directory=False)
        return target
    with tempfile.TemporaryDirectory(dir=root) as work:
        for name, data in sources.items():
            (Path(work) / name).write_bytes(data)
        out = Path(work) / "rowops.so"
        done = subprocess.run(
            [compiler, *_FLAGS, "-o", str(out), str(Path(work) / "rowops.c"), "-lm", "-ldl"],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise OSError(f"{Path(compiler).name} failed: {' '.join(tail)}")
        os.chmod(out, 0o755)  # whatever the umask: group/other write would be refused
        os.replace(out, target)  # atomic: a concurrent build leaves one whole file
    return target


def _run_build() -> None:
    global _lib, _error
    try:
        _lib = _Library(_build(_sources()))
    except (OSError, subprocess.SubprocessError) as exc:
        _error = str(exc)


def start_build() -> None:
    """Start building (or loading the cached) library in the background; idempotent."""
    global _thread
    with _lock:
        if _thread is None and not _resolved and not _disabled():
            _thread = threading.Thread(target=_run_build, name="tensorstream-rowops", daemon=True)
            _thread.start()


def library() -> _Library | None:
    """The loaded library (waits for a build in progress), or None: torch operators run.

    Raises:
        ConfigError: ``TENSORSTREAM_ROWOPS=1`` and the library could not be built.
    """
    global _resolved, _error
    if _resolved:
        return _lib
    if _disabled():
        _error = f"{ENV}={os.environ.get(ENV)}"
    else:
        start_build()
        assert _thread is not None
        _thread.join()
    with _lock:
        _resolved = True
    if _lib is None:
        message = f"fused row operators unavailable ({_error})"
        if _required():
            raise ConfigError(f"{message}; unset {ENV} to run torch's operators instead")
        logger.info("%s: the native models run torch's operators", message)
    else:
        logger.debug("fused row operators: %s", _lib.path)
    return _lib


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = library()
    print(built.path if built is not None else "not built (see above)")
    sys.exit(0 if built is not None else 1)
