"""XSalsa20-Poly1305 (libsodium secretbox, detached) over tensor memory, in place.

tensorizer's scheme: the data is cut into ``chunk_size`` pieces (2 MiB by
default, the last one shorter); piece ``i`` is sealed with nonce
``initial_nonce + i`` (little-endian, as ``sodium_increment`` counts) and its
16-byte MAC goes into the tensor header. Ciphertext is as long as plaintext.

Memory is given as a writable, C-contiguous buffer (``bytearray``, ``memoryview``,
numpy array), a CPU ``torch.Tensor`` (through ``data_ptr()``), or an
``(address, nbytes)`` pair the caller keeps alive. Each chunk is one ctypes call,
which releases the GIL, so chunks spread over threads run in parallel.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from tensorstream.crypto import sodium
from tensorstream.crypto.cryptinfo import (
    DEFAULT_CHUNK_SIZE,
    EMPTY,
    MAC_BYTES,
    NONCE_BYTES,
    CryptInfo,
    KeyDerivation,
    XSalsa20Parallel,
    XSalsa20Sequential,
    check_chunk_size,
)
from tensorstream.errors import ConfigError, CryptoError, DecryptionError, FormatError

__all__ = [
    "Buffer",
    "KEY_BYTES",
    "decrypt_chunks",
    "decrypt_chunks_parallel",
    "decrypt_sequential",
    "encrypt_chunks",
    "encrypt_chunks_parallel",
    "encrypt_sequential",
    "nonce_at",
    "open_chunk",
    "open_tensor",
    "random_nonce",
    "seal_chunk",
    "seal_copy",
    "seal_tensor",
    "shared_pool",
]

KEY_BYTES = 32

#: Memory the functions accept: a writable buffer-protocol object, a CPU
#: ``torch.Tensor``, or an ``(address, nbytes)`` tuple. (Typed loosely on purpose:
#: torch is not imported here.)
Buffer = Any

# A real address for zero-length calls; libsodium is never handed NULL.
_EMPTY = ctypes.create_string_buffer(1)
_EMPTY_ADDR = ctypes.addressof(_EMPTY)


def _region(buf: Buffer) -> tuple[int, int, object]:
    """``(address, nbytes, keepalive)`` of writable, contiguous CPU memory."""
    if isinstance(buf, tuple):
        addr, nbytes = buf
        if not isinstance(addr, int) or not isinstance(nbytes, int) or nbytes < 0:
            raise ConfigError("an (address, nbytes) region needs two non-negative ints")
        if nbytes and not addr:
            raise ConfigError("an (address, nbytes) region has a NULL address")
        return (addr or _EMPTY_ADDR), nbytes, None
    if hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):  # torch.Tensor, duck-typed
        device = getattr(buf, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            raise ConfigError(
                f"cannot encrypt or decrypt memory on {device}: decrypt in host memory "
                "(a pinned staging buffer) before copying to the device"
            )
        if not buf.is_contiguous():
            raise ConfigError("tensor memory must be contiguous; call .contiguous() first")
        nbytes = buf.numel() * buf.element_size()
        return (buf.data_ptr() or _EMPTY_ADDR), nbytes, buf
    try:
        view = memoryview(buf)
    except TypeError as exc:
        raise ConfigError(
            f"expected a writable buffer, a CPU tensor or (address, nbytes); got {type(buf).__name__}"
        ) from exc
    if view.readonly:
        raise ConfigError("the buffer is read-only; encryption works in place on writable memory")
    if not view.c_contiguous:
        raise ConfigError("the buffer must be C-contiguous")
    if view.nbytes == 0:
        return _EMPTY_ADDR, 0, view
    flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    holder = (ctypes.c_ubyte * flat.nbytes).from_buffer(flat)
    return ctypes.addressof(holder), flat.nbytes, holder


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
        # Never echo the key itself; its length is harmless and helps.
        size = len(key) if isinstance(key, (bytes, bytearray, memoryview)) else type(key).__name__
        raise ConfigError(f"an encryption key must be exactly {KEY_BYTES} bytes (got {size})")
    return bytes(key)


def _check_nonce(nonce: bytes) -> bytes:
    if len(nonce) != NONCE_BYTES:
        raise ConfigError(f"a nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
    return bytes(nonce)


def random_nonce() -> bytes:
    """24 random bytes from the OS; the start of one tensor's nonce sequence."""
    return secrets.token_bytes(NONCE_BYTES)


def nonce_at(initial_nonce: bytes, index: int) -> bytes:
    """``initial_nonce`` incremented ``index`` times, little-endian, wrapping like libsodium."""
    value = (int.from_bytes(_check_nonce(initial_nonce), "little") + index) % (
        1 << (8 * NONCE_BYTES)
    )
    return value.to_bytes(NONCE_BYTES, "little")


def seal_chunk(addr: int, nbytes: int, key: bytes, nonce: bytes) -> bytes:
    """Encrypt ``nbytes`` at ``addr`` in place; return the 16-byte MAC.

    Low level: no argument checks beyond libsodium's. Safe to call from many threads.
    """
    lib = sodium.get()
    mac = ctypes.create_string_buffer(MAC_BYTES)
    if lib.secretbox_detached(addr, mac, addr, nbytes, nonce, key) != 0:
        raise CryptoError(f"crypto_secretbox_detached refused a {nbytes}-byte chunk")
    return mac.raw


def open_chunk(
    addr: int, nbytes: int, key: bytes, nonce: bytes, mac: bytes, source: int | None = None
) -> bool:
    """Verify and decrypt ``nbytes`` at ``addr`` in place; False (memory untouched) on a bad MAC.

    With ``source``, the ciphertext is read from that address instead and only the
    plaintext is written at ``addr`` (the two must not overlap): one pass instead of
    a copy followed by in-place decryption.
    """
    src = addr if source is None else source
    return sodium.get().secretbox_open_detached(addr, src, mac, nbytes, nonce, key) == 0


def _gather(futures: Sequence[Future[Any]]) -> list[Any]:
    """Every future's result, in order; the first exception only once all have finished.

    A chunk still running must never write into memory the caller may already be
    freeing while it handles our exception.
    """
    results = []
    first_exc: BaseException | None = None
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as exc:  # re-raised below, after all workers stopped
            first_exc = first_exc or exc
    if first_exc is not None:
        raise first_exc
    return results


def _spans(nbytes: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_size, nbytes)) for s in range(0, nbytes, chunk_size)]


def _mac_error(label: str | None, index: int, count: int, start: int, end: int) -> DecryptionError:
    what = label or "the buffer"
    return DecryptionError(
        f"decryption of {what} failed at chunk {index} of {count} (data bytes {start}..{end}): "
        "the MAC does not match. The key or passphrase is wrong, or the file is corrupted "
        "or was tampered with."
    )


def _run(
    buf: Buffer,
    key: bytes,
    initial_nonce: bytes,
    chunk_size: int,
    macs: Sequence[bytes] | None,
    executor: Executor | None,
    label: str | None,
    source: int | None = None,
) -> list[bytes]:
    key = _check_key(key)
    initial_nonce = _check_nonce(initial_nonce)
    check_chunk_size(chunk_size)
    addr, nbytes, keep = _region(buf)
    spans = _spans(nbytes, chunk_size)
    if macs is not None:
        macs = [bytes(m) for m in macs]
        if len(macs) != len(spans):
            raise FormatError(
                f"{label or 'the buffer'} has {nbytes} bytes, i.e. {len(spans)} chunks of "
                f"{chunk_size}, but the header stores {len(macs)} MACs; the header is corrupt"
            )
        if any(len(m) != MAC_BYTES for m in macs):
            raise FormatError(f"{label or 'the buffer'}: a stored MAC is not {MAC_BYTES} bytes")

    def one(i: int) -> bytes | bool:
        start, end = spans[i]
        nonce = nonce_at(initial_nonce, i)
        if macs is None:
            return seal_chunk(addr + start, end - start, key, nonce)
        src = None if source is None else source + start
        return open_chunk(addr + start, end - start, key, nonce, macs[i], src)

    if executor is None or len(spans) <= 1:
        results = [one(i) for i in range(len(spans))]
    else:
        results = _gather([executor.submit(one, i) for i in range(len(spans))])
    del keep
    if macs is None:
        return [r for r in results if isinstance(r, bytes)]
    for i, ok in enumerate(results):
        if not ok:
            raise _mac_error(label, i, len(spans), *spans[i])
    return macs


def encrypt_chunks(
    buf: Buffer,
    key: bytes,
    initial_nonce: bytes,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> list[bytes]:
    """Encrypt ``buf`` in place, chunk by chunk, on the calling thread.

    Args:
        buf: writable contiguous CPU memory (see the module docstring).
        key: the 32-byte key.
        initial_nonce: 24 bytes, fresh and random for every tensor.
        chunk_size: bytes per chunk; a multiple of 64, at least 1024.

    Returns:
        One 16-byte MAC per chunk; empty for an empty buffer.

    Raises:
        ConfigError: bad key, nonce, chunk size or buffer.
        CryptoUnavailableError: libsodium is not installed.

    Example:
        >>> buf = bytearray(5000)
        >>> len(encrypt_chunks(buf, bytes(32), bytes(24), 2048))
        3
    """
    return _run(buf, key, initial_nonce, chunk_size, None, None, None)


def decrypt_chunks(
    buf: Buffer,
    key: bytes,
    initial_nonce: bytes,
    chunk_size: int,
    macs: Sequence[bytes],
    *,
    label: str | None = None,
) -> None:
    """Verify and decrypt ``buf`` in place on the calling thread.

    Args:
        buf: the ciphertext, overwritten with plaintext.
        key: the 32-byte key.
        initial_nonce: the tensor's first nonce.
        chunk_size: the chunk size the file records.
        macs: one MAC per chunk, as stored in the header.
        label: what to call the memory in errors, e.g. ``"tensor 'w' (offset 262217 in x.tensors)"``.

    Raises:
        DecryptionError: a MAC does not match; names the chunk index and byte range.
        FormatError: the MAC count does not match the data length.
        ConfigError: bad key, nonce, chunk size or buffer.
    """
    _run(buf, key, initial_nonce, chunk_size, macs, None, label)


_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def shared_pool() -> ThreadPoolExecutor:
    """A process-wide pool with one thread per usable CPU, created on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            try:
                workers = len(os.sched_getaffinity(0))
            except AttributeError:  # not Linux
                workers = os.cpu_count() or 1
            _pool = ThreadPoolExecutor(
                max_workers=max(1, workers), thread_name_prefix="tensorstream-crypto"
            )
        return _pool


def encrypt_chunks_parallel(
    buf: Buffer,
    key: bytes,
    initial_nonce: bytes,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    executor: Executor | None = None,
) -> list[bytes]:
    """``encrypt_chunks`` with chunks spread over ``executor`` (default ``shared_pool()``).

    Blocks until every chunk is done. Do not call it from a task already running
    on the same bounded executor (it would wait on its own pool).
    """
    return _run(buf, key, initial_nonce, chunk_size, None, executor or shared_pool(), None)


def decrypt_chunks_parallel(
    buf: Buffer,
    key: bytes,
    initial_nonce: bytes,
    chunk_size: int,
    macs: Sequence[bytes],
    executor: Executor | None = None,
    *,
    label: str | None = None,
) -> None:
    """``decrypt_chunks`` with chunks spread over ``executor`` (default ``shared_pool()``).

    Every chunk finishes (or fails) before this returns or raises. To overlap
    reading with decryption, read chunk ``i`` yourself and submit
    ``open_chunk(addr + start, n, key, nonce_at(nonce, i), macs[i])`` instead.

    Raises:
        DecryptionError: the lowest-numbered chunk whose MAC failed.
    """
    _run(buf, key, initial_nonce, chunk_size, macs, executor or shared_pool(), label)


def encrypt_sequential(buf: Buffer, key: bytes, nonce: bytes) -> bytes:
    """Encrypt the whole buffer under one nonce; return its single MAC (chunk type 3)."""
    key, nonce = _check_key(key), _check_nonce(nonce)
    addr, nbytes, keep = _region(buf)
    mac = seal_chunk(addr, nbytes, key, nonce)
    del keep
    return mac


def decrypt_sequential(
    buf: Buffer, key: bytes, nonce: bytes, mac: bytes, *, label: str | None = None
) -> None:
    """Verify and decrypt a buffer sealed as one piece (chunk type 3, or type 2 with one MAC).

    Raises:
        DecryptionError: the MAC does not match.
    """
    key, nonce = _check_key(key), _check_nonce(nonce)
    if len(mac) != MAC_BYTES:
        raise FormatError(f"{label or 'the buffer'}: the stored MAC is not {MAC_BYTES} bytes")
    addr, nbytes, keep = _region(buf)
    ok = open_chunk(addr, nbytes, key, nonce, bytes(mac))
    del keep
    if not ok:
        raise _mac_error(label, 0, 1, 0, nbytes)


def seal_tensor(
    buf: Buffer,
    key: bytes,
    *,
    key_derivation: KeyDerivation | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    nonce: bytes | None = None,
    executor: Executor | None = None,
) -> CryptInfo:
    """Encrypt one tensor's data in place and return the CryptInfo for its header.

    Args:
        buf: the tensor's bytes (already hashed: hashes cover the plaintext).
        key: the 32-byte key (``EncryptionParams.key``).
        key_derivation: ``EncryptionParams.key_derivation``; stored in every tensor.
        chunk_size: bytes per chunk.
        nonce: the initial nonce; random when omitted (the normal case).
        executor: spread chunks over this pool; ``None`` runs on the calling thread.

    Returns:
        ``[KeyDerivation?, XSalsa20Parallel]``, or the empty CryptInfo for a
        zero-length buffer (the same block tensorizer writes for meta tensors,
        which its reader accepts; see ``sealed_crypt_info_size``).
    """
    addr, nbytes, keep = _region(buf)
    if nbytes == 0:
        return EMPTY
    start = random_nonce() if nonce is None else _check_nonce(nonce)
    macs = _run((addr, nbytes), key, start, chunk_size, None, executor, None)
    del keep
    return _parallel_info(start, chunk_size, macs, key_derivation)


def _parallel_info(
    nonce: bytes, chunk_size: int, macs: Sequence[bytes], key_derivation: KeyDerivation | None
) -> CryptInfo:
    cipher = XSalsa20Parallel(chunk_size=chunk_size, nonce=nonce, macs=tuple(macs))
    return CryptInfo((key_derivation, cipher) if key_derivation is not None else (cipher,))


def seal_copy(
    src: Buffer,
    dst: Buffer,
    key: bytes,
    *,
    hasher: Any = None,
    key_derivation: KeyDerivation | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    nonce: bytes | None = None,
    executor: Executor | None = None,
) -> CryptInfo:
    """Copy ``src`` into ``dst`` and encrypt the copy, one chunk at a time.

    Each chunk is copied, handed to ``hasher.update`` as plaintext while it is still
    in cache, then sealed: one pass over the source instead of three (hash, copy,
    encrypt), and the caller's memory is never modified. With ``executor``, sealing
    chunk ``i`` overlaps copying and hashing chunk ``i + 1`` on the calling thread.

    Args:
        src: the plaintext (any contiguous buffer; only read).
        dst: writable contiguous memory of at least ``len(src)`` bytes; receives the
            ciphertext in its first ``len(src)`` bytes.
        key: the 32-byte key.
        hasher: a ``hashlib`` object fed the plaintext in order, or ``None``.
        key_derivation, chunk_size, nonce: as for ``seal_tensor``.
        executor: pool to seal chunks on; ``None`` seals on the calling thread.

    Returns:
        The tensor's CryptInfo, as ``seal_tensor`` returns it.

    Raises:
        ConfigError: bad key, nonce or chunk size, or ``dst`` too small.
    """
    key = _check_key(key)
    check_chunk_size(chunk_size)
    source = memoryview(src).cast("B") if not isinstance(src, memoryview) else src
    if source.ndim != 1 or source.format != "B":
        source = source.cast("B")
    nbytes = source.nbytes
    target = memoryview(dst)
    if target.format != "B" or target.ndim != 1:
        target = target.cast("B")
    if target.nbytes < nbytes:
        raise ConfigError(f"seal_copy: the destination holds {target.nbytes} bytes, need {nbytes}")
    if nbytes == 0:
        if hasher is not None:
            hasher.update(b"")
        return EMPTY
    addr, _, keep = _region(target[:nbytes])
    start = random_nonce() if nonce is None else _check_nonce(nonce)
    spans = _spans(nbytes, chunk_size)
    macs: list[bytes] = []
    futures: list[Future[bytes]] = []
    try:
        for i, (lo, hi) in enumerate(spans):
            target[lo:hi] = source[lo:hi]
            if hasher is not None:
                hasher.update(target[lo:hi])  # the copy: in cache, and it is plaintext still
            if executor is None:
                macs.append(seal_chunk(addr + lo, hi - lo, key, nonce_at(start, i)))
            else:
                futures.append(
                    executor.submit(seal_chunk, addr + lo, hi - lo, key, nonce_at(start, i))
                )
    finally:
        macs.extend(_gather(futures))
    del keep
    return _parallel_info(start, chunk_size, macs, key_derivation)


def _is_parallel(info: CryptInfo) -> bool:
    cipher = info.cipher()
    return isinstance(cipher, XSalsa20Parallel) and len(cipher.macs) > 1


def open_tensor(
    buf: Buffer,
    info: CryptInfo,
    key: bytes,
    *,
    label: str | None = None,
    executor: Executor | None = None,
    source: Buffer | None = None,
) -> None:
    """Verify and decrypt one tensor's data in place, whatever form its CryptInfo takes.

    Follows tensorizer's reader: a parallel chunk with exactly one MAC covers the
    whole buffer with one nonce; an empty CryptInfo (or zero MACs) is accepted
    only for zero-length data.

    Args:
        source: read the ciphertext from here (as many bytes as ``buf``, not
            overlapping it, left unmodified) and write only the plaintext into
            ``buf``; e.g. straight from a mapping of the file into fresh tensors.

    Raises:
        DecryptionError: a MAC does not match (wrong key or tampered data).
        FormatError: the CryptInfo does not fit the data (no method, wrong MAC count).
    """
    addr, nbytes, keep = _region(buf)
    what = label or "the tensor"
    source_addr: int | None = None
    source_keep: object = None
    if source is not None:
        source_addr, source_bytes, source_keep = _region(source)
        if source_bytes != nbytes:
            raise ConfigError(
                f"{what}: the ciphertext source holds {source_bytes} bytes, the destination {nbytes}"
            )
        if not (info.is_empty or _is_parallel(info)):
            # Rare single-MAC forms: copy, then decrypt in place as usual.
            ctypes.memmove(addr, source_addr, nbytes)
            source_addr = None
    if info.is_empty:
        if nbytes:
            raise FormatError(
                f"{what} has {nbytes} bytes of data but no encryption info, in a file "
                "marked encrypted; the file is corrupt"
            )
        return
    cipher = info.cipher()
    if isinstance(cipher, XSalsa20Sequential):
        decrypt_sequential((addr, nbytes), key, cipher.nonce, cipher.mac, label=label)
    elif len(cipher.macs) == 1:
        decrypt_sequential((addr, nbytes), key, cipher.nonce, cipher.macs[0], label=label)
    elif nbytes:
        _run(
            (addr, nbytes),
            key,
            cipher.nonce,
            cipher.chunk_size,
            cipher.macs,
            executor,
            label,
            source_addr,
        )
    elif cipher.macs:
        raise FormatError(f"{what} has no data but {len(cipher.macs)} MACs; the header is corrupt")
    del keep, source_keep
