"""Small I/O helpers: atomic writes and append-only JSON-lines logs."""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import json
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """User-level cache: $TTRANK_CACHE, else $XDG_CACHE_HOME/ttrank, else ~/.cache/ttrank."""
    root = os.environ.get("TTRANK_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ttrank"


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes the file private (0600); the result should have the usual mode
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@functools.lru_cache(maxsize=1)
def _umask() -> int:
    # read once: os.umask can only be read by setting it, which is not thread-safe
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


def append_jsonl(path: str | Path, rows: list[dict] | dict) -> None:
    """Append rows to a JSON-lines log; each row is one write of one whole line, then fsync.

    A crash can leave at most a partial last line, which :func:`read_jsonl` skips; the log is
    never rewritten, so earlier rows are never lost.
    """
    if isinstance(rows, dict):
        rows = [rows]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)
    with open(path, "a+b") as f:
        # a partial line left by a crash must not swallow the next row
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                data = "\n" + data
        f.write(data.encode())
        f.flush()
        os.fsync(f.fileno())


def open_text(path: str | Path):
    """Open a text file that may be gzip-compressed (by suffix)."""
    path = Path(path)
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def read_jsonl(path: str | Path, bad: list[str] | None = None) -> Iterator[Any]:
    """Yield parsed rows; malformed lines are skipped and described in ``bad``."""
    path = Path(path)
    if not path.exists():
        return
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                if bad is not None:
                    bad.append(f"{path.name}:{lineno}: {e.msg}")


def sha256_of(*paths: str | Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Ctrl-C inside MetaSchedule's native search loop: a KeyboardInterrupt raised there, in the
# middle of a C++ -> Python callback, can crash the process (seen: SIGSEGV). Inside
# ``stop_at_safe_points()`` the first Ctrl-C only asks the code to stop at its next safe point.

STOP_REQUESTED = threading.Event()
_SAFE_SECTIONS = [0]
USER_STDERR_FD = [2]  # the terminal's stderr while fd 2 is captured into a log (cli)


@contextlib.contextmanager
def stop_at_safe_points() -> Iterator[None]:
    """Within: the first Ctrl-C sets :data:`STOP_REQUESTED` (checked between batches)."""
    if not _SAFE_SECTIONS[0]:
        STOP_REQUESTED.clear()
    _SAFE_SECTIONS[0] += 1
    try:
        yield
    finally:
        _SAFE_SECTIONS[0] -= 1


def on_sigint(signum, frame) -> None:
    """SIGINT handler: a stop request inside a safe section, else (or the second time) a
    KeyboardInterrupt as usual."""
    if _SAFE_SECTIONS[0] and not STOP_REQUESTED.is_set():
        STOP_REQUESTED.set()
        with contextlib.suppress(OSError):
            os.write(USER_STDERR_FD[0], b"ttrank: stopping after the current batch (Ctrl-C again to stop at once)\n")
        return
    signal.default_int_handler(signum, frame)
