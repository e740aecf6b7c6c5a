"""Loading libsodium: both builds, identical output, the missing-library error, GIL release."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tensorstream.crypto as crypto
from tensorstream.crypto import encrypt_sequential, sodium
from tensorstream.errors import CryptoUnavailableError

KEY = bytes(range(32))
NONCE = bytes(range(24))


def test_available_and_described() -> None:
    assert crypto.available is True
    text = crypto.describe()
    assert "libsodium" in text and sodium.get().path in text


def test_system_build_is_preferred_and_described() -> None:
    lib = sodium.load("auto")
    assert lib.kind == "system"
    assert os.path.exists(lib.path)
    assert lib.describe().startswith("system libsodium 1.0.")


def test_both_builds_produce_identical_output() -> None:
    outputs = []
    for which in ("system", "pynacl"):
        lib = sodium.load(which)
        assert lib.kind == which
        buf = ctypes.create_string_buffer(b"tensor bytes" * 500)
        mac = ctypes.create_string_buffer(16)
        assert lib.secretbox_detached(buf, mac, buf, len(buf), NONCE, KEY) == 0
        outputs.append((buf.raw, mac.raw))
        assert lib.secretbox_open_detached(buf, buf, mac, len(buf), NONCE, KEY) == 0
        assert buf.raw.startswith(b"tensor bytes")
    assert outputs[0] == outputs[1]
    assert "PyNaCl" in sodium.load("pynacl").describe()


def test_missing_library_error_says_what_to_install() -> None:
    with pytest.raises(CryptoUnavailableError) as info:
        sodium.load("/nonexistent/libsodium.so")
    message = str(info.value)
    assert "apt-get install libsodium23" in message and "pip install pynacl" in message
    assert isinstance(info.value, ImportError)


def test_unavailable_process_wide() -> None:
    code = (
        "import tensorstream.crypto as c\n"
        "from tensorstream.errors import CryptoUnavailableError\n"
        "assert c.available is False\n"
        "assert c.describe().startswith('unavailable:')\n"
        "try:\n"
        "    c.encrypt_chunks(bytearray(2000), bytes(32), bytes(24))\n"
        "except CryptoUnavailableError as e:\n"
        "    assert 'apt-get install libsodium23' in str(e)\n"
        "    print('ok')\n"
    )
    env = dict(os.environ, TENSORSTREAM_SODIUM="/nonexistent/libsodium.so")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_pynacl_build_selected_by_environment() -> None:
    code = "from tensorstream.crypto import sodium; print(sodium.backend())"
    env = dict(os.environ, TENSORSTREAM_SODIUM="pynacl")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "pynacl", out.stderr


def test_calls_release_the_gil() -> None:
    # A pure-Python thread records timestamps while the main thread sits in ctypes calls.
    buf = np.ones(64 << 20, dtype=np.uint8)
    stamps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        inside = 0
        for _ in range(10):  # the machine may be busy; the spinner needs a free core
            t0 = time.perf_counter()
            encrypt_sequential(buf, KEY, NONCE)
            t1 = time.perf_counter()
            # A GIL-holding call lets the spinner run only after it returns (at most one
            # 5 ms switch interval before t1), so stamps in the first 3/4 prove release.
            early = t0 + (t1 - t0) * 3 / 4
            inside = sum(1 for t in stamps[-500_000:] if t0 < t < early)
            if inside > 100:
                break
    finally:
        stop.set()
        spinner.join()
    assert inside > 100


def test_public_names_sorted_and_resolvable() -> None:
    import importlib

    for name in ("", ".sodium", ".secretbox", ".cryptinfo", ".kdf", ".params", ".keyfile"):
        module = importlib.import_module("tensorstream.crypto" + name)
        assert list(module.__all__) == sorted(module.__all__), module.__name__
        for public in module.__all__:
            assert getattr(module, public) is not None, (module.__name__, public)
