"""Worker pools that never hang the process that waits on them.

TVM's :class:`~tvm.support.popen_pool.PopenPoolExecutor` times a call out from a Python timer
thread inside the worker. That thread cannot run while the worker's main thread holds the GIL
in a C call that never returns, and a candidate kernel that writes out of bounds can make one:
on znver4, a transferred schedule for tf_xception corrupted the heap of the build worker that
checked its outputs, the worker faulted inside ``malloc``, TVM's crash handler called
``malloc`` again to print the backtrace and waited forever on its lock, and ``recommend``
waited forever on the worker (the CPU idle, no timeout ever answered).

:func:`guard` fixes both ends: a worker started by a guarded pool dies on a fatal signal (the
parent's read ends at once, and the call fails like any crashed candidate), and a watchdog
thread here kills a worker whose call overran the pool's timeout by ``grace_s``, with every
process it started (a linker, a pool of its own), which would otherwise live on.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import weakref

import psutil
from tvm.support.popen_pool import PopenPoolExecutor

# what a worker past its timeout gets before it is killed: the deadline also covers starting a
# new worker (TVM's import, 4-7 s on a 2-core Zen 1, more on a loaded machine), which the
# worker's own timer does not count
GRACE_S = 30.0
WATCH_EVERY_S = 1.0
FATAL_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")

_guarded: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()
_watchdog: threading.Thread | None = None


def die_on_crash() -> None:
    """A worker's initializer: fatal signals kill the process outright, instead of going to a
    crash handler that may itself need the heap the crash corrupted."""
    for name in FATAL_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def guard(pool: PopenPoolExecutor, grace_s: float = GRACE_S) -> PopenPoolExecutor:
    """Make ``pool`` (a new one, or one a MetaSchedule runner made) safe to wait on; returns it.
    Workers it starts from now on die on a crash (unless it has an initializer of its own; a
    LocalRunner's is given :func:`die_on_crash` when it is made), and a call that runs past
    twice the pool's timeout plus ``grace_s`` has its worker killed: the call then fails with
    ``ChildProcessError``, and the pool starts a new worker for the next."""
    global _watchdog
    if getattr(pool, "_ttrank_started", None) is not None:
        return pool
    if pool._initializer is None:
        pool._initializer = die_on_crash
    started: dict[int, list[float]] = {}  # the pool's thread -> [when its worker's current call began]
    own = weakref.ref(pool)  # the pool holds this function: a strong reference would be a cycle
    run = type(pool)._worker_run

    def timed_run(fn, args, kwargs):
        tid, call = threading.get_ident(), [time.monotonic()]
        started[tid] = call
        try:
            return run(own(), fn, args, kwargs)
        finally:
            if started.get(tid) is call:
                del started[tid]

    pool._worker_run = timed_run
    pool._ttrank_started = started
    pool._ttrank_grace_s = grace_s
    with _lock:
        _guarded.add(pool)
        if _watchdog is None or not _watchdog.is_alive():
            _watchdog = threading.Thread(target=_watch, name="ttrank-worker-watchdog", daemon=True)
            _watchdog.start()
    return pool


def _watch() -> None:
    while True:
        time.sleep(WATCH_EVERY_S)
        with _lock:
            pools = list(_guarded)
        for pool in pools:
            try:
                _kill_overdue(pool)
            except Exception:  # noqa: BLE001 - the watchdog outlives any one pool's surprise
                pass
        del pools  # a pool dropped meanwhile is not kept alive by the sleeping watchdog


def _kill_overdue(pool: PopenPoolExecutor) -> None:
    if pool._timeout is None:
        return
    limit = 2 * pool._timeout + pool._ttrank_grace_s
    for tid, call in list(pool._ttrank_started.items()):
        if time.monotonic() - call[0] <= limit:
            continue
        proc = getattr(pool._worker_map.get(tid), "_proc", None)
        # the same call still running (not a next one of that thread that began meanwhile)
        if proc is not None and pool._ttrank_started.get(tid) is call:
            # the waiting thread's read then ends, and the pool cleans up as for a crash
            kill_tree(proc.pid)
        if pool._ttrank_started.get(tid) is call:
            del pool._ttrank_started[tid]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every process under it. Its children are found first: once it is
    dead they belong to init, and nothing would find them."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
