"""HTTP download with progress, resume and an atomic, verified rename.

The file is written to ``<target>.part``.  If a ``.part`` is already there (an earlier
download was interrupted), the request asks for the missing bytes (``Range``); a server
that ignores the header answers 200 and the file is fetched from the start.  Only after
the complete file's checksum matches is it renamed to ``target`` (``os.replace`` is
atomic on one filesystem), so ``target`` is either absent or verified.  A mismatch deletes
the ``.part`` so that nothing corrupt is left behind or resumed later.
"""
from __future__ import annotations

import hashlib
import os
import stat
import sys
import urllib.error
import urllib.request
from pathlib import Path

from bnlab.data._integrity import ChecksumError, verify_digest

__all__ = ["download_file", "DownloadTooLargeError"]


class DownloadTooLargeError(ValueError):
    """The server sent (or announced) more bytes than the download's size limit."""

_CHUNK = 1 << 16


def _leftover_part(part: Path) -> bool:
    """Whether an earlier download left ``part`` to resume.  Anything but a regular file there is refused
    with an ``OSError`` naming it, never opened: reading a FIFO blocks until something writes to it (the
    download hung), and appending through a planted link would write into the link's target."""
    try:
        mode = os.lstat(part).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(mode):
        raise OSError(f"the partial download {str(part)!r} is not a regular file (a link, FIFO, folder or device); "
                      "bnlab neither reads nor writes through it: remove it")
    return True


def _hash_existing(path: Path, hashers) -> int:
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            size += len(chunk)
            for h in hashers:
                h.update(chunk)
    return size


def _write_part(response, part: Path, have: int, hashers, max_bytes: int | None, url: str, bar) -> None:
    """Append (``have`` > 0) or write ``response``'s bytes to ``part``, hashing them, within ``max_bytes``."""
    # O_NOFOLLOW | O_NONBLOCK: what _leftover_part checked cannot have become a link or a FIFO since
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if have else os.O_TRUNC)
    fd = os.open(part, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    with os.fdopen(fd, "ab" if have else "wb") as out:
        size = have
        for chunk in iter(lambda: response.read(_CHUNK), b""):
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise DownloadTooLargeError(
                    f"download of {url} stopped: more than {max_bytes} bytes (the expected archive's size); it is "
                    "not the expected file"
                )
            out.write(chunk)
            for h in hashers:
                h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
        out.flush()
        os.fsync(out.fileno())


def download_file(
    url: str,
    target: Path,
    *,
    sha256: str,
    md5: str | None = None,
    progress: bool = True,
    timeout: float = 60.0,
    max_bytes: int | None = None,
) -> Path:
    """Download ``url`` to ``target`` and verify it; return ``target``.

    Parameters
    ----------
    url : str
        ``http://``, ``https://`` or ``file://`` address.
    target : Path
        Final path; its folder is created.
    sha256 : str
        Expected SHA-256 (hex) of the complete file.
    md5 : str, optional
        Also check this MD5 (the checksum CIFAR's authors publish).
    progress : bool
        Show a tqdm progress bar on stderr.
    max_bytes : int, optional
        Size limit: a ``Content-Length`` above it is refused before reading, and the
        transfer stops (the ``.part`` removed) as soon as the file would exceed it
        (``file:///dev/zero`` or a hostile server cannot fill the disk).

    Raises
    ------
    ChecksumError
        The downloaded file's hash differs; the partial file is removed.
    OSError
        Network or file-system failure; a partial ``.part`` file is kept for resuming.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    sha = hashlib.sha256()
    md = hashlib.md5() if md5 else None
    hashers = [h for h in (sha, md) if h is not None]

    leftover = _leftover_part(part)
    if leftover and max_bytes is not None and part.stat().st_size > max_bytes:
        part.unlink()  # a leftover larger than the file can be is not resumed
        leftover = False
    have = _hash_existing(part, hashers) if leftover else 0
    request = urllib.request.Request(url, headers={"User-Agent": "bnlab"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # requested range starts at/after the end: the .part is complete
            response = None
        else:
            raise OSError(f"download of {url} failed: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise OSError(f"download of {url} failed: {exc.reason}") from None

    if response is not None:
        with response:
            status = getattr(response, "status", 200)
            if have and status != 206:
                # The server ignored the Range request: start over.
                have = 0
                sha = hashlib.sha256()
                md = hashlib.md5() if md5 else None
                hashers = [h for h in (sha, md) if h is not None]
            length = response.headers.get("Content-Length")
            total = have + int(length) if length is not None and length.isdigit() else None
            if max_bytes is not None and total is not None and total > max_bytes:
                part.unlink(missing_ok=True)
                raise DownloadTooLargeError(
                    f"download of {url} refused: the server announces {total} bytes, more than the limit of "
                    f"{max_bytes} bytes (the expected archive's size)"
                )
            bar = None
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024,
                           desc=target.name, file=sys.stderr, leave=True)
            try:
                _write_part(response, part, have, hashers, max_bytes, url, bar)
            except DownloadTooLargeError:
                part.unlink(missing_ok=True)
                raise
            finally:
                if bar is not None:
                    bar.close()
    try:
        verify_digest(f"download of {url}", sha.hexdigest(), sha256)
        if md is not None:
            verify_digest(f"download of {url}", md.hexdigest(), md5, "md5")
    except ChecksumError:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, target)
    return target
