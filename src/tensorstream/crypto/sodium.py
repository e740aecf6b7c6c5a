"""Find and load libsodium through ctypes; the only module that touches the C library.

Which build, chosen by measurement on the development VM (in-place
``crypto_secretbox_detached`` over 2 MiB chunks, one core):

1. the system ``libsodium.so.23`` (Debian ``libsodium23``), about 1.5 GB/s;
2. the copy bundled inside PyNaCl (``nacl/_sodium*.so``). PyNaCl's Python API
   lacks the detached secretbox, but its extension module exports the C
   symbols, so ctypes can call them directly.

``TENSORSTREAM_SODIUM`` overrides the search: ``system``, ``pynacl`` or a path
to a shared library. ``ctypes.CDLL`` releases the GIL around every foreign
call, so chunks handed to threads run in parallel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import threading
from dataclasses import dataclass

from tensorstream.errors import CryptoUnavailableError

__all__ = [
    "INSTALL_HINT",
    "Sodium",
    "available",
    "backend",
    "describe",
    "get",
    "load",
]

INSTALL_HINT = "run `apt-get install libsodium23` (fastest) or `pip install pynacl`"

_SYSTEM_NAMES = ("libsodium.so.23", "libsodium.so.26", "libsodium.so", "libsodium.dylib")

_u8p = ctypes.c_void_p
_ull = ctypes.c_ulonglong


@dataclass(frozen=True)
class Sodium:
    """A loaded libsodium: the bound functions this package uses plus where they came from."""

    #: ``"system"``, ``"pynacl"`` or ``"path"``.
    kind: str
    path: str
    version: str
    secretbox_detached: ctypes._CFuncPtr  # type: ignore[name-defined]
    secretbox_open_detached: ctypes._CFuncPtr  # type: ignore[name-defined]
    #: ``crypto_pwhash``; a fallback for key derivation when argon2-cffi is missing.
    pwhash: ctypes._CFuncPtr  # type: ignore[name-defined]

    def describe(self) -> str:
        """One line for ``tensorstream --version``: which libsodium, which version, where."""
        label = {"system": "system libsodium", "pynacl": "libsodium bundled with PyNaCl"}
        return f"{label.get(self.kind, 'libsodium')} {self.version} ({self.path})"


def _pynacl_paths() -> list[str]:
    # find_spec locates the package without importing it (importing nacl runs cffi setup).
    try:
        spec = importlib.util.find_spec("nacl")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    found: list[str] = []
    for folder in spec.submodule_search_locations:
        found.extend(sorted(glob.glob(os.path.join(folder, "_sodium*.so"))))
        found.extend(sorted(glob.glob(os.path.join(folder, "_sodium*.pyd"))))
    return found


def _pynacl_version() -> str:
    try:
        from importlib.metadata import version

        return version("pynacl")
    except Exception:  # metadata missing in odd installs; the path still identifies it
        return "(unknown version)"


def _bind(kind: str, path: str) -> Sodium:
    """Open ``path`` and bind the functions; raises OSError/AttributeError if unusable."""
    lib = ctypes.CDLL(path)
    if lib.sodium_init() < 0:
        raise OSError(f"sodium_init() failed in {path}")

    box = lib.crypto_secretbox_detached
    # int crypto_secretbox_detached(c, mac, m, mlen, n, k); c may equal m (in place).
    box.argtypes = [_u8p, _u8p, _u8p, _ull, _u8p, _u8p]
    box.restype = ctypes.c_int
    unbox = lib.crypto_secretbox_open_detached
    # int crypto_secretbox_open_detached(m, c, mac, clen, n, k); verifies before writing.
    unbox.argtypes = [_u8p, _u8p, _u8p, _ull, _u8p, _u8p]
    unbox.restype = ctypes.c_int
    pwhash = lib.crypto_pwhash
    # int crypto_pwhash(out, outlen, passwd, passwdlen, salt, opslimit, memlimit, alg)
    pwhash.argtypes = [_u8p, _ull, _u8p, _ull, _u8p, _ull, ctypes.c_size_t, ctypes.c_int]
    pwhash.restype = ctypes.c_int

    try:
        version_fn = lib.sodium_version_string
    except AttributeError:  # PyNaCl's extension does not export it
        version = _pynacl_version() if kind == "pynacl" else "(unknown version)"
    else:
        version_fn.restype = ctypes.c_char_p
        version_fn.argtypes = []
        version = version_fn().decode("ascii", "replace")
    return Sodium(kind, path, version, box, unbox, pwhash)


def _system_candidates() -> list[str]:
    names = list(_SYSTEM_NAMES)
    found = ctypes.util.find_library("sodium")
    if found and found not in names:
        names.append(found)
    return names


def _resolve_path(name: str) -> str:
    """The real file behind a soname such as ``libsodium.so.23``, for ``describe()``."""
    if os.path.sep in name:
        return os.path.realpath(name)
    # The dynamic loader resolved the soname; /proc/self/maps shows the file it mapped.
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libsodium.so"):
                    return path
    except OSError:
        pass
    return name


def load(which: str = "auto") -> Sodium:
    """Load a specific libsodium build.

    Args:
        which: ``"auto"`` (system first, then PyNaCl's copy), ``"system"``,
            ``"pynacl"``, or a filesystem path to a libsodium shared library.

    Returns:
        The bound library.

    Raises:
        CryptoUnavailableError: no usable build was found; the message says what to install.
    """
    attempts: list[str] = []
    if which in ("auto", "system"):
        for name in _system_candidates():
            try:
                sodium = _bind("system", name)
            except (OSError, AttributeError) as exc:
                attempts.append(f"{name}: {exc}")
                continue
            return _with_path(sodium, _resolve_path(name))
    if which in ("auto", "pynacl"):
        for path in _pynacl_paths():
            try:
                return _bind("pynacl", path)
            except (OSError, AttributeError) as exc:
                attempts.append(f"{path}: {exc}")
        if not _pynacl_paths():
            attempts.append("PyNaCl: not installed")
    if which not in ("auto", "system", "pynacl"):
        try:
            return _bind("path", which)
        except (OSError, AttributeError) as exc:
            attempts.append(f"{which}: {exc}")
    raise CryptoUnavailableError(
        f"encryption needs libsodium and none was usable ({which=}; tried: "
        + "; ".join(attempts)
        + f"); {INSTALL_HINT}"
    )


def _with_path(sodium: Sodium, path: str) -> Sodium:
    return Sodium(
        sodium.kind,
        path,
        sodium.version,
        sodium.secretbox_detached,
        sodium.secretbox_open_detached,
        sodium.pwhash,
    )


_lock = threading.Lock()
_loaded: Sodium | None = None
_error: CryptoUnavailableError | None = None


def get() -> Sodium:
    """The process-wide libsodium, loaded on first use (``TENSORSTREAM_SODIUM`` honoured).

    Raises:
        CryptoUnavailableError: libsodium is not installed; says how to install it.
    """
    global _loaded, _error
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            if _error is not None:
                raise _error
            try:
                _loaded = load(os.environ.get("TENSORSTREAM_SODIUM", "auto") or "auto")
            except CryptoUnavailableError as exc:
                _error = exc
                raise
    return _loaded


def available() -> bool:
    """True when some libsodium build can be loaded."""
    try:
        get()
    except CryptoUnavailableError:
        return False
    return True


def backend() -> str:
    """Short name of the loaded build (``"system"``, ``"pynacl"``, ``"path"``) or ``"none"``."""
    return get().kind if available() else "none"


def describe() -> str:
    """``"system libsodium 1.0.18 (/usr/lib/...)"``, or why encryption is unavailable."""
    try:
        return get().describe()
    except CryptoUnavailableError as exc:
        return f"unavailable: {exc}"
