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
thread here kills a worker whose call overran the pool's timeout by ``grace_s``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref

from tvm.support.popen_pool import PopenPoolExecutor

# what a worker past its timeout gets before it is killed: its own timer answers within
# milliseconds when it can run at all
GRACE_S = 10.0
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
    Workers it starts from now on die on a crash (unless it has an initializer of its own),
    and a call that runs ``grace_s`` past the pool's timeout has its worker killed: the call
    then fails with ``ChildProcessError``, and the pool starts a new worker for the next."""
    global _watchdog
    if getattr(pool, "_ttrank_started", None) is not None:
        return pool
    if pool._initializer is None:
        pool._initializer = die_on_crash
    started: dict[int, float] = {}  # the pool's thread -> when its worker's current call began
    run = pool._worker_run

    def timed_run(fn, args, kwargs):
        tid = threading.get_ident()
        started[tid] = time.monotonic()
        try:
            return run(fn, args, kwargs)
        finally:
            started.pop(tid, None)

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
            if pool._timeout is None:
                continue
            now = time.monotonic()
            for tid, t0 in list(pool._ttrank_started.items()):
                if now - t0 <= pool._timeout + pool._ttrank_grace_s:
                    continue
                proc = getattr(pool._worker_map.get(tid), "_proc", None)
                if proc is not None:
                    # the waiting thread's read then ends, and the pool cleans up as for a crash
                    try:
                        os.kill(proc.pid, signal.SIGKILL)
                    except OSError:
                        pass
                pool._ttrank_started.pop(tid, None)
