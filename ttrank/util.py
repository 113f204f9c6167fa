"""Small I/O helpers: atomic writes, file locks, append-only JSON-lines logs, and outputs
replaced as one step."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import gzip
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from joblib import Parallel, delayed

from .target import host_cores


def cache_dir() -> Path:
    """User-level cache: $TTRANK_CACHE, else $XDG_CACHE_HOME/ttrank, else ~/.cache/ttrank."""
    root = os.environ.get("TTRANK_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ttrank"


@contextlib.contextmanager
def environ(name: str, value: str | Path) -> Iterator[None]:
    """Run with the environment variable ``name`` set to ``value``, for this process and its
    children; its earlier value (or its absence) comes back after."""
    before = os.environ.get(name)
    os.environ[name] = str(value)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


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
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@functools.lru_cache(maxsize=1)
def current_umask() -> int:
    """The process umask (what new files and folders are created with)."""
    # read once: os.umask can only be read by setting it, which is not thread-safe
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


class LockedError(OSError):
    """Another process holds the lock (only raised with ``blocking=False``)."""


def lock_path(path: str | Path) -> Path:
    """The sidecar lock file of ``path``: ``.<name>.lock`` beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def file_lock(path: str | Path, blocking: bool = True, shared: bool = False) -> Iterator[None]:
    """Hold a lock on ``path`` (a file or folder) across processes.

    The lock is ``flock`` on a sidecar file, not on ``path`` itself: ``path`` may be replaced by
    a rename or not exist yet, and the lock must outlive both. The kernel drops it when the holder
    dies (even by kill -9), so a crash never leaves a stale lock. ``shared``: readers, who
    exclude writers but not each other; where no lock file can be made (a read-only folder, so
    no writer either) a reader goes on without one. ``blocking=False`` raises
    :class:`LockedError` at once when another process holds it.
    """
    lp = lock_path(path)
    try:
        lp.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        if not shared:
            raise
        yield
        return
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            raise LockedError(errno.EWOULDBLOCK, "locked by another process", str(path)) from None
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the lock


def append_jsonl(path: str | Path, rows: list[dict] | dict) -> None:
    """Append rows to a JSON-lines log; each row is one whole line, then fsync.

    Writers hold :func:`file_lock` on the log, so two processes appending at once (two
    ``recommend`` runs on one data dir, ``collect`` beside ``recommend``) never interleave parts
    of lines. A crash can leave at most a partial last line, which :func:`read_jsonl` skips; the
    log is never rewritten, so earlier rows are never lost.
    """
    if isinstance(rows, dict):
        rows = [rows]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode()
    with file_lock(path), open(path, "a+b") as f:
        # a partial line left by a crash must not swallow the next row
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                data = b"\n" + data
        f.write(data)
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


# what a failed write says, whoever wrote it (Python, TVM's C++ writer, the system linker)
_WRITE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.EDQUOT)


def write_failure(e: BaseException) -> str | None:
    """Why a write failed, if ``e`` is the file system saying no (full disk, read-only folder,
    no permission, file too large); None for any other failure."""
    if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:
        return e.strerror
    text = str(e)
    for code in _WRITE_ERRNOS:
        if os.strerror(code) in text:
            return os.strerror(code)
    return None


def free_space_problem(path: str | Path, need_bytes: int) -> str | None:
    """Why ``need_bytes`` will not fit in folder ``path``'s file system, or None if they may.

    Checked before compiling: LLVM ends the whole process (exit 1, no Python error) when it
    cannot write an object file, so a full disk must be noticed before it gets there."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None  # not there yet: writable_dir decides
    if free >= need_bytes:
        return None
    return f"only {free / 1e6:.1f} MB free, and this needs about {need_bytes / 1e6:.0f} MB"


def writable_dir(path: str | Path) -> str | None:
    """Why files cannot be created in folder ``path`` (made if missing), or None if they can.

    Tried by creating a file, not by permission bits: root ignores those, and a read-only mount
    or a full disk says no only when asked."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".ttrank-probe-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


# --------------------------------------------------------------------------------------------
# Several outputs replaced as one step. A run that writes a database folder and a library
# stages both beside their places, writes a plan, then renames; a kill between the renames
# leaves the plan, and the next run (or anyone calling finish_moves) completes it. So readers
# who go through finish_moves see all the old outputs or all the new ones, never a mix.


def commit_moves(moves: list[tuple[Path, Path]], plan: Path) -> None:
    """Move each staged ``src`` (file or folder, beside ``dst``) onto ``dst``, all or nothing."""
    plan = Path(plan)
    with file_lock(plan):
        _finish_moves(plan)  # an older interrupted plan first: its outputs must not win later
        atomic_write_json(plan, {"moves": [[str(s), str(d)] for s, d in moves]})
        _finish_moves(plan)


def finish_moves(plan: str | Path) -> bool:
    """Complete a plan that a kill interrupted; True if there was one."""
    plan = Path(plan)
    if not plan.exists():
        return False
    with file_lock(plan):
        return _finish_moves(plan)


def _finish_moves(plan: Path) -> bool:
    try:
        moves = json.loads(plan.read_text())["moves"]
    except FileNotFoundError:
        return False
    except (ValueError, KeyError, TypeError):  # not ours (plans are written atomically)
        plan.unlink(missing_ok=True)
        return False
    for src, dst in moves:
        _move(Path(src), Path(dst))
    plan.unlink(missing_ok=True)
    return True


def _move(src: Path, dst: Path) -> None:
    """One step of a plan; safe to repeat after a kill at any point inside it."""
    old = dst.with_name(f".{dst.name}.old")
    if src.is_dir():
        # a folder cannot be renamed over a non-empty one: the old one steps aside first
        if dst.exists():
            shutil.rmtree(old, ignore_errors=True)
            dst.rename(old)
        src.rename(dst)
    elif src.exists():
        os.replace(src, dst)
    _fsync_dir(dst.parent)
    if old.is_dir():
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sha256_of(*paths: str | Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Ctrl-C inside MetaSchedule's native search loop: a KeyboardInterrupt raised there, in the
# middle of a C++ -> Python callback, can crash the process (seen: SIGSEGV). Raised inside TVM's
# PopenPoolExecutor while it holds its lock (shutting down its workers), it leaves the lock held,
# and the pool's __del__ then waits on it forever (seen: a Ctrl-C'd tune hung for an hour).
# Inside ``stop_at_safe_points()`` the first Ctrl-C only asks the code to stop at its next safe
# point; the second ends the process at once, as a kill would (every log is append-only and
# every database line torn by a kill is repaired on the next run).

STOP_REQUESTED = threading.Event()
_SAFE_SECTIONS = [0]
USER_STDERR_FD = [2]  # the terminal's stderr while fd 2 is captured into a log (cli)


def say(line: str) -> None:
    """One line for the user (stderr), also while fd 2 is captured into a log.

    Where the host process replaced ``sys.stderr`` (a test harness, an application embedding
    the CLI), the line goes there: that is where it wants to read it.
    """
    text = f"ttrank: {line}\n"
    if sys.stderr is not None and sys.stderr is not sys.__stderr__:
        sys.stderr.write(text)
        sys.stderr.flush()
        return
    with contextlib.suppress(OSError):
        os.write(USER_STDERR_FD[0], text.encode())


def to_native_log(text: str) -> None:
    """Text that belongs with TVM's own messages: the native log while the CLI captures fd 2
    (shown with -v, kept when it explains a failure), else the ``ttrank`` logger at INFO."""
    if not text.strip():
        return
    if USER_STDERR_FD[0] != 2:
        with contextlib.suppress(OSError):
            os.write(2, (text.rstrip("\n") + "\n").encode())
    else:
        logging.getLogger("ttrank").info("%s", text.rstrip("\n"))


@contextlib.contextmanager
def stop_at_safe_points() -> Iterator[None]:
    """Within: the first Ctrl-C sets :data:`STOP_REQUESTED` (checked between batches)."""
    _SAFE_SECTIONS[0] += 1
    try:
        yield
    finally:
        _SAFE_SECTIONS[0] -= 1


def on_sigint(signum, frame) -> None:
    """SIGINT handler: inside a safe section, a stop request the first time and the end of
    the process the second; outside, a KeyboardInterrupt as usual.

    The request is recorded either way: TVM's native code can swallow the KeyboardInterrupt
    (a Python callback's exception becomes a failed candidate), and the loops check
    :data:`STOP_REQUESTED` between tasks. Whoever installs the handler clears it first.
    """
    first = not STOP_REQUESTED.is_set()
    STOP_REQUESTED.set()
    if _SAFE_SECTIONS[0]:
        with contextlib.suppress(OSError):
            os.write(USER_STDERR_FD[0], b"ttrank: stopping after the current batch (Ctrl-C again to stop at once)\n"
                     if first else b"ttrank: stopped; finished work is kept, rerun to resume\n")
        if first:
            return
        os._exit(130)  # no unwinding through TVM's pools (see above)
    signal.default_int_handler(signum, frame)


_WATCHED_PARENT: list[int] = []  # in a worker process: the parent it watches (set once)


def exit_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """In a worker process started by ``parent``: end this process once ``parent`` has ended.
    In ``parent`` itself (a pool that ran the job in-process), nothing.

    loky keeps its workers, and lets a running job finish, after the process that started them
    was killed: a killed recommend or train would go on using the cores its user wanted back.
    A daemon thread polls the parent; PR_SET_PDEATHSIG would follow the *thread* that spawned
    the worker, and loky spawns replacements from its manager thread."""
    if parent == os.getpid() or _WATCHED_PARENT:
        return
    _WATCHED_PARENT.append(parent)
    if os.getppid() != parent:  # it ended before this job started
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="ttrank-exit-with-parent", daemon=True).start()


def orphan_safe(job: Callable) -> Callable:
    """``job`` as a worker pool's job (joblib's ``delayed(orphan_safe(job))(...)``): the worker
    that runs it ends when this process does (:func:`exit_with_parent`)."""
    return functools.partial(_job_in_worker, os.getpid(), job)


def _job_in_worker(parent: int, job: Callable, *args, **kwargs):
    exit_with_parent(parent)
    return job(*args, **kwargs)


def fill_caches(paths: dict[Path, Path], job, *args) -> list[Path]:
    """Make the missing cache files of ``paths`` (source -> its cache file) on every core, one
    source per worker process: ``job(str(source), *args, str(cache))``. With one missing, or one
    core, nothing runs here. Returns the sources whose cache is still missing (the caller makes
    those itself)."""
    todo = [src for src, cache in paths.items() if not cache.exists()]
    if len(todo) > 1 and host_cores() > 1:
        with warnings.catch_warnings():
            # loky replaces a worker whose memory grew (TVM's allocations do) and warns that
            # "a worker stopped"; its jobs go to the new worker, so the user has nothing to do
            warnings.filterwarnings("ignore", message="A worker stopped while some jobs")
            Parallel(n_jobs=min(host_cores(), len(todo)))(
                delayed(orphan_safe(job))(str(src), *args, str(paths[src])) for src in todo)
        todo = [src for src in todo if not paths[src].exists()]
    return todo
