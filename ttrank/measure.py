"""Measuring kernels: a warm-pool builder, local and RPC runners, and batch measurement.

The builder and runners implement MetaSchedule's own Builder/Runner interfaces, so the same
objects serve ``ttrank tune`` (inside MetaSchedule's search) and candidate measurement.
"""

from __future__ import annotations

import _ctypes
import atexit
import contextlib
import ctypes
import functools
import hashlib
import logging
import math
import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult, PyBuilder
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

from .donors import DonorStore, scheduled
from .errors import DeviceError
from .features import parse_trace
from .fleet import DEVICE_LOST, FleetRunner, Tracker, alloc_in_bounds, last_line, one_cpu, probe
from .target import CpuShare, ForeignLoad, cross_compiler, host_cores, host_target_dict, host_triple, provenance
from .util import file_lock
from .workers import die_on_crash, guard

log = logging.getLogger("ttrank")

# A tracker that has not answered in this long is reported as down (one line, not a hang).
TRACKER_TIMEOUT_S = 10.0
# While a candidate runs over RPC, how often the tracker is asked whether a device is left:
# a session request to a tracker that has no device for the key waits forever.
DEVICE_POLL_S = 3.0

# After the first pass over a batch, a candidate slower than this many times the best latency
# already known for its kernel is not run again: its later passes could not make it the winner
# (one pass varies by well under 1.5x: bench/results/measure_noise.json), and they were a third
# of recommend's run time.
SETTLE_FACTOR = 1.5

# An untuned kernel whose reference run (in the build worker, one call) took this long keeps that
# run as its latency. The runner would call it twice more (a warm-up, then the timed call): for
# big untuned convs that was 2/3 of their measuring (40 of 59 s for DBNet at 640x640), and one
# call of 50 ms or more times to well within what the untuned latency decides (each kernel's
# share of the model, and whether a candidate beats the untuned kernel by far).
SELF_TIMED_S = 0.05

# A candidate whose output check (one call, in its build worker) already took SELF_TIMED_S or
# more, and over this many times the best latency known for its kernel (the untuned kernel's
# included), is not run at all: that call is its latency. One cold call beside the other
# worker's build reads high, not low, and by far less than this; MetaSchedule's design space
# for a [40, 6625] softmax holds schedules 800x slower than the untuned kernel (2.1 s a call,
# recomputing each row's sum per element), which the runner called 3 times a pass.
PRESETTLE_FACTOR = 4.0

# Worker pools outlive the builder or runner that asked for them, shared by every later one with
# the same settings in this process: each worker imports TVM as it starts (4 s for the builder's
# two and 7 s for the two local runners' on a 2-core Zen 1), which a library caller running
# recommend on model after model, or a test suite, paid again for every run. Local runners that
# differ only in their timeout (recommend's own tuning scales it per kernel) are few at once: the
# least recently used beyond SHARED_RUNNERS are dropped (their worker exits with its last user).
SHARED_RUNNERS = 4
_SHARED_POOLS: dict[tuple, PopenPoolExecutor] = {}
_SHARED_RUNNERS: dict[tuple, Any] = {}
_SHARED_LOCK = threading.Lock()


def _shared_pool(max_workers: int, timeout_sec: float) -> PopenPoolExecutor:
    with _SHARED_LOCK:
        key = (max_workers, timeout_sec)
        if key not in _SHARED_POOLS:
            _SHARED_POOLS[key] = guard(PopenPoolExecutor(max_workers=max_workers, timeout=timeout_sec))
        return _SHARED_POOLS[key]


def _shared_runner(key: tuple, make: Callable[[], Any]) -> Any:
    with _SHARED_LOCK:
        runner = _SHARED_RUNNERS.pop(key, None) or make()
        _SHARED_RUNNERS[key] = runner  # the most recently used last
        while len(_SHARED_RUNNERS) > SHARED_RUNNERS:
            _SHARED_RUNNERS.pop(next(iter(_SHARED_RUNNERS)))
        return runner


def _guarded_runner(runner):
    """A LocalRunner whose worker pool cannot hang its caller (:func:`ttrank.workers.guard`)."""
    guard(runner.pool)
    return runner


@atexit.register
def _shut_shared_pools() -> None:
    with _SHARED_LOCK:
        pools = [*_SHARED_POOLS.values(), *(r.pool for r in _SHARED_RUNNERS.values())]
        _SHARED_POOLS.clear()
        _SHARED_RUNNERS.clear()
    for pool in pools:
        with contextlib.suppress(Exception):
            pool.shutdown()


# Test hook: a build whose module has this attribute sleeps, to prove timeouts work.
HANG_ATTR = "ttrank.test_hang_seconds"


class Built(NamedTuple):
    """A module built for measurement: its library, and the seconds of one call the build
    worker made of it (the reference run, or the output check), when it made one."""

    path: str
    once_s: float | None = None
    build_s: float | None = None  # the worker's seconds for it: compile, export, output check


def _build_export(mod, target, artifact_dir: str, keep: bool = False, here: bool = False) -> str:
    """Build a scheduled PrimFunc module and export it (runs in a pool worker).

    Unlike MetaSchedule's default_build this does not import tvm.s_tir.tensor_intrin, which
    costs ~30 s per fresh worker; scheduling (in the parent) already registered what it needed.
    ``keep``: keep its object file for the model's compile (:func:`_export`), when the built
    program is the one given (no weight-layout rewrite stripped).
    """
    import tvm
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    func = mod[[gv for gv in mod.functions][0]]
    hang = func.attrs.get(HANG_ATTR) if func.attrs is not None else None
    if hang is not None:
        time.sleep(float(hang))
    stripped = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    key = object_key(mod, target) if keep and _same_program(stripped, mod) else None
    return _export(tvm.compile(stripped, target=target), artifact_dir, target, key, here)


# The object files of the kernels built for measuring, under a build pool's artifact_dir, by
# object_key: the model's compile links the winners' instead of compiling them again
OBJECTS = "objects"
# attributes that name or classify a kernel but do not change its machine code
_NAMING_ATTRS = ("global_symbol", "op_pattern", "tirx.is_scheduled")


def object_key(mod, target) -> str | None:
    """What a kernel's machine code depends on: its program (parameters, buffers, body and the
    attributes codegen reads) and the target; None for a module of other than one PrimFunc. A
    measured candidate ("main") and the model's kernel it became share it."""
    import tvm
    import tvm_ffi

    funcs = list(mod.functions.values()) if isinstance(mod, tvm.IRModule) else [mod]
    if len(funcs) != 1 or not isinstance(funcs[0], tvm.tirx.PrimFunc):
        return None
    f = funcs[0]
    for attr in _NAMING_ATTRS:
        if f.attrs is not None and attr in f.attrs:
            f = f.without_attr(attr)
    return f"{tvm_ffi.structural_hash(f) & 0xFFFFFFFFFFFFFFFF:016x}-" + hashlib.sha256(
        str(target).encode()).hexdigest()[:12]


def _ld_link(output: str, objects: list[str], options=None, cc=None) -> None:
    """Link a kernel's object files into a shared library with ``ld`` itself, for loading in
    this host's Python processes: 3 ms, where TVM's ``g++ -shared`` takes 26 ms of a candidate's
    270 ms build. Bound now (``-z now``), so a symbol the process cannot give fails the load
    check below, not a later call; its libc and libm calls resolve from the process's own
    (Python's), its compiler helpers come from libgcc.a. Anything else, or a failure, goes to
    TVM's own linker."""
    from tvm.support import cc as tvm_cc

    libgcc = _libgcc()
    if options or not libgcc or not all(str(o).endswith(".o") for o in objects):
        return tvm_cc.create_shared(output, objects, options=options, cc=cc)
    done = subprocess.run(["ld", "-shared", "-z", "now", "-o", output, *map(str, objects), libgcc],
                          capture_output=True)
    try:
        if done.returncode != 0:
            raise OSError(done.stderr.decode(errors="replace")[-300:])
        # every symbol resolves here, or this raises; then unloaded (workers link thousands)
        _ctypes.dlclose(ctypes.CDLL(output, mode=os.RTLD_LOCAL | os.RTLD_NOW)._handle)
    except OSError as e:
        log.debug("ld could not link %s (%s): linking with TVM's compiler driver", output, e)
        tvm_cc.create_shared(output, objects, options=options, cc=cc)


_ld_link.output_format = "so"  # what TVM reads of an fcompile


@functools.cache
def _libgcc() -> str | None:
    """libgcc.a's path (gcc's compiler helpers), when ``ld`` and ``gcc`` are both there."""
    if shutil.which("ld") is None or shutil.which("gcc") is None:
        return None
    done = subprocess.run(["gcc", "-print-libgcc-file-name"], capture_output=True, text=True)
    path = done.stdout.strip()
    return path if done.returncode == 0 and os.path.isfile(path) else None


def _export(rt_mod, artifact_dir: str, target=None, key: str | None = None, here: bool = False) -> str:
    """Export a built kernel into a folder of its own; with ``key``, its object file is kept
    under ``OBJECTS`` by that key (host targets only: the model's compile links it). ``here``:
    it will be loaded on this host only (:func:`_ld_link`)."""
    # one folder per artifact: MetaSchedule's RemoveBuildArtifact removes the artifact's folder
    os.makedirs(artifact_dir, exist_ok=True)
    folder = tempfile.mkdtemp(dir=artifact_dir)
    path = os.path.join(folder, "kernel.so")
    foreign = cross_compiler(target)
    keep = key is not None and foreign is None
    # export_library writes the object (lib0.o) into its workspace: here, when it is kept
    rt_mod.export_library(path, fcompile=foreign or (_ld_link if here else None),  # another architecture: its linker
                          workspace_dir=folder if keep else None)
    if keep:
        kept = os.path.join(artifact_dir, OBJECTS, f"{key}.o")
        os.makedirs(os.path.dirname(kept), exist_ok=True)
        with contextlib.suppress(FileExistsError):  # the same program, built again
            os.link(os.path.join(folder, "lib0.o"), kept)
    return path


def record_build_seconds(work_dir: str | Path, target, min_unroll: float = 64) -> dict[str, float]:
    """Seconds to compile each of a donor set's indexed records on its own workload, by trace
    hash (in this process: run sets side by side, one per core). Records unrolled less than
    ``min_unroll`` are left out: none of the 220 sampled took over 0.3 s."""
    import tvm

    out: dict[str, float] = {}
    for w in DonorStore.load([work_dir], use_cache=False).workloads:
        for r in w.records:
            if parse_trace(r.trace_json)["unroll"] < min_unroll or r.trace_hash in out:
                continue
            mod = scheduled(w, r)
            t0 = time.perf_counter()
            tvm.compile(mod, target=target)
            out[r.trace_hash] = time.perf_counter() - t0
    return out


def _random_args(func, seed: int = 0):
    """Deterministic inputs for a PrimFunc: normal floats, zero integers (always in bounds)."""
    import numpy as np
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    rng = np.random.default_rng(seed)
    arrays = []
    for a in ArgInfo.from_prim_func(func):
        shape = [int(d) for d in a.shape]
        dtype = str(a.dtype)
        if dtype.startswith("float"):
            arr = rng.standard_normal(shape).astype(dtype)
        elif dtype == "bool":
            arr = rng.integers(0, 2, shape).astype(bool)
        else:
            arr = np.zeros(shape, dtype=dtype)
        arrays.append(arr)
    return arrays


def _written(func) -> list[int]:
    """Indices of the parameters ``func`` writes (its outputs); every index when none is found
    (a function without blocks), so a check then compares them all."""
    from tvm import s_tir

    params = list(func.params)
    try:
        sch = s_tir.Schedule(func)
        blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    except Exception:  # noqa: BLE001 - no root block: compare everything
        return list(range(len(params)))
    # TVM 0.27's TIR: a parameter is its buffer's variable, and a block's writes name it
    writes = [r.source for blk in blocks for r in blk.writes]
    out = [i for i, p in enumerate(params) if any(p.same_as(w) for w in writes)]
    return out or list(range(len(params)))


FENCE_MIN_BYTES = 1 << 16  # at least this much guarded memory each side of an argument
FENCE_MAX_BYTES = 1 << 24


class StrayAccess(Exception):
    """A kernel wrote outside its arguments (a transferred schedule whose loops overrun a
    buffer): it must never be measured or shipped, whatever its outputs."""


def _fence_item(dtype, i: int):
    """The bytes of one element of argument ``i``'s fence: for floats a NaN whose payload names
    the argument (arithmetic on a NaN keeps its payload, so a value computed from a stray read
    of one argument and written past another still differs from that one's fence)."""
    import numpy as np

    dt = np.dtype(dtype)
    if dt.kind == "f":
        bits = {2: 0x7E00, 4: 0x7FC00000, 8: 0x7FF8000000000000}[dt.itemsize] | (i + 1)
    else:
        bits = int.from_bytes(bytes([0xA5 ^ (i & 0xFF)]) * dt.itemsize, "little")
    return np.array([bits], dtype=f"<u{dt.itemsize}").view(np.uint8)


def _fenced(arrays: list) -> tuple[list, Callable[[], list[int]]]:
    """TVM tensors over copies of ``arrays``, each inside memory of its own fenced on both
    sides (:func:`_fence_item`), and a function giving the indices of those whose fence was
    written.

    A schedule that overruns a buffer by a little (a transferred tile over an extent it does
    not divide) then writes into the fence, not into the allocator's bookkeeping: seen on
    Xception, where such a candidate corrupted the check worker's heap and hung it; a stray read
    takes NaN, which the output check catches.
    """
    import numpy as np
    import tvm

    tensors, fences = [], []
    for i, a in enumerate(arrays):
        n = a.nbytes
        pad = min(max(n, FENCE_MIN_BYTES), FENCE_MAX_BYTES)
        pad += -pad % 64
        fence = np.tile(_fence_item(a.dtype, i), pad // a.dtype.itemsize)
        raw = np.empty(n + 2 * pad + 64, dtype=np.uint8)
        buf = raw[-raw.ctypes.data % 64:][:n + 2 * pad]  # TVM's kernels assume 64-byte alignment
        buf[:pad] = fence
        buf[pad + n:] = fence
        view = buf[pad:pad + n].view(a.dtype).reshape(a.shape)
        view[...] = a
        tensors.append(tvm.runtime.from_dlpack(view))  # shares the memory
        fences.append((buf, pad, n, fence))

    def strayed() -> list[int]:
        return [i for i, (buf, pad, n, fence) in enumerate(fences)
                if not (np.array_equal(buf[:pad], fence) and np.array_equal(buf[pad + n:], fence))]

    return tensors, strayed


def _run_host(mod, seed: int = 0, built=None) -> tuple[list, list, float]:
    """Build for the host (or take ``built``, a compiled or loaded module) and run on
    deterministic inputs, each argument fenced (:func:`_fenced`): (the inputs as made, every
    argument after the call, the call's seconds). Raises :class:`StrayAccess` if the call wrote
    outside its arguments."""
    import tvm

    func = mod[[gv for gv in mod.functions][0]]
    rt = built if built is not None else tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
    inputs = _random_args(func, seed)
    args, strayed = _fenced(inputs)
    # tvm.compile gives an Executable (JIT on first call), load_module a Module
    main = (rt.jit() if isinstance(rt, tvm.runtime.Executable) else rt).main
    t0 = time.perf_counter()
    main(*args)
    secs = time.perf_counter() - t0
    if bad := strayed():
        raise StrayAccess(f"wrote outside argument {', '.join(map(str, bad))} (a loop overruns its buffer)")
    return inputs, [a.numpy() for a in args], secs


def _reference(ref_mod, ref_key: str, refs_dir: str, built=None) -> tuple[int, dict[int, Any], float]:
    """The untuned kernel's argument count, its outputs on the deterministic inputs by
    parameter index, and the seconds of the run that computed them: computed once per kernel
    and kept in ``refs_dir`` for every build worker (each candidate of the kernel is checked
    against them; recomputing them per candidate was half the build time). ``built``:
    ``ref_mod`` already compiled for this host."""
    import numpy as np

    path = os.path.join(refs_dir, f"{ref_key}.npz")
    with file_lock(path):  # one worker computes, the other waits for it
        if os.path.exists(path):
            with np.load(path, allow_pickle=False) as z:
                return (int(z["n"]), {int(k[1:]): z[k] for k in z.files if k not in ("n", "s")},
                        float(z["s"]))
        func = ref_mod[[gv for gv in ref_mod.functions][0]]
        _, after, secs = _run_host(ref_mod, built=built)
        out = {i: after[i] for i in _written(func)}
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        np.savez(tmp, n=len(after), s=secs, **{f"a{i}": a for i, a in out.items()})
        os.replace(tmp, path)
        return len(after), out, secs


def _check_against(mod, ref_mod, ref_key: str, refs_dir: str, rtol: float, atol: float,
                   built=None) -> tuple[float | str | None, float]:
    """(max abs error of ``mod`` against ``ref_mod`` on the same inputs, or why it is wrong when
    it wrote outside its arguments, or None if they agree (another signature never does); the
    seconds of ``mod``'s call). An argument the reference does not write must come out as it
    went in."""
    import numpy as np

    n, ref, _ = _reference(ref_mod, ref_key, refs_dir)
    try:
        inputs, got, secs = _run_host(mod, built=built)
    except StrayAccess as e:
        return str(e), 0.0
    if len(got) != n:
        return float("inf"), secs
    worst, bad = 0.0, False
    for i, g in enumerate(got):
        r = ref.get(i, inputs[i])
        if g.shape != r.shape:
            return float("inf"), secs
        if g.dtype.kind != "f":
            bad = bad or not np.array_equal(g, r)
            continue
        if not np.isfinite(g).all() and np.isfinite(r).all():  # a stray read, or an overflow
            return float("nan"), secs
        err = float(np.max(np.abs(g.astype(np.float64) - r))) if g.size else 0.0
        worst = max(worst, err)
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        if not np.isfinite(g).all() or err > atol * max(1.0, scale) + rtol * scale:
            bad = True
    return (worst if bad else None), secs


def _build_reference_export(mod, target, artifact_dir: str, ref_key: str) -> Built:
    """Build an untuned kernel for measurement and keep its outputs as the reference its
    candidates are checked against (pool worker, host target): the kernel is compiled and run
    once for both, not once more by the first candidate's check."""
    import tvm

    path = _build_export(mod, target, artifact_dir, keep=True, here=True)
    _, _, secs = _reference(mod, ref_key, os.path.join(artifact_dir, "references"),
                            built=tvm.runtime.load_module(path))
    return Built(path, secs)


def _build_check_export(mod, target, artifact_dir: str, ref_mod, ref_key: str,
                        run_here: bool = False, rtol: float = 1e-3, atol: float = 1e-4):
    """Build for measurement, and check the result against the reference (pool worker).

    ``run_here``: the target runs on this host, so when the measured build is the checked
    program (no weight-layout rewrite to strip) it is compiled once, exported, and the exported
    library is what the check runs (LLVM generates code once: a JIT run before the export
    would generate it twice); that call's seconds come back as the build's ``once_s``.
    Returns (the build, None) or (None, the max abs error of a wrong result, or why it is
    wrong when no error measures it).
    """
    import tvm
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    if ref_mod is None:
        return Built(_build_export(mod, target, artifact_dir)), None
    refs_dir = os.path.join(artifact_dir, "references")
    if run_here:
        stripped = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
        if _same_program(stripped, mod):
            path = _export(tvm.compile(mod, target=target), artifact_dir, target, object_key(mod, target),
                           here=True)
            wrong, secs = _check_against(mod, ref_mod, ref_key, refs_dir, rtol, atol,
                                         built=tvm.runtime.load_module(path))
            if wrong is not None:
                _rm(path)
                return None, wrong
            return Built(path, secs), None
    # the check ran a JIT build of another program (the weights' layout rewrite kept): its
    # call says nothing of the measured build's time
    wrong, _ = _check_against(mod, ref_mod, ref_key, refs_dir, rtol, atol)
    if wrong is not None:
        return None, wrong
    return Built(_build_export(mod, target, artifact_dir, here=run_here)), None


def _compile_object(mod, target, path: str) -> str:
    """Compile a module of kernels to an object file (runs in a pool worker): one part of a
    whole model's kernels, linked into its library at export (:func:`ttrank.runtime.compile_model`)."""
    import tvm

    tvm.tirx.build(mod, target=target).write_to_file(path)
    return path


def _timed(fn: Callable, *args) -> tuple[Any, float]:
    """``fn(*args)`` and its seconds (in a pool worker: what the workers were busy with)."""
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def _warm_worker() -> int:
    """Nothing: unpickling it imports this module in the worker, which imports TVM's."""
    return os.getpid()


def _same_program(a, b) -> bool:
    import tvm_ffi

    return bool(tvm_ffi.structural_equal(a, b))


@derived_object
class WarmPoolBuilder(PyBuilder):
    """A MetaSchedule builder whose worker processes live for the whole process.

    MetaSchedule's LocalBuilder starts a new pool for every batch; each worker then imports
    the tensor intrinsics (~30 s here). This pool starts once, is shared by every builder of
    the same size and timeout (:func:`_shared_pool`), and a per-candidate timeout kills (and
    replaces) only a worker whose build hangs.
    """

    def __init__(self, max_workers: int | None = None, timeout_sec: float = 60.0,
                 artifact_dir: str | None = None) -> None:
        super().__init__()
        self.max_workers = max_workers or host_cores()
        self.timeout_sec = timeout_sec
        self.artifact_dir = artifact_dir or tempfile.mkdtemp(prefix="ttrank-build-")
        os.makedirs(self.artifact_dir, exist_ok=True)
        self._pool: PopenPoolExecutor | None = None
        self._lock = threading.Lock()  # warm() may start the pool from another thread
        # the workers' seconds inside builds: against the builds' wall time x workers, how
        # well a batch kept every worker busy (its slowest build holds the batch)
        self.busy_s = 0.0

    def _map(self, fn: Callable, args: list) -> list:
        """``fn`` over ``args`` on the pool's workers, as ``map_with_error_catching`` gives them,
        each finished one's value unwrapped from its timing (added to :attr:`busy_s`); a
        :class:`Built` value (alone or first of a pair) keeps its own as ``build_s``."""
        out = []
        for r in self.pool.map_with_error_catching(lambda a: _timed(fn, *a), args):
            if r.status == StatusKind.COMPLETE:
                value, secs = r.value
                self.busy_s += secs
                if isinstance(value, Built):
                    value = value._replace(build_s=secs)
                elif isinstance(value, tuple) and value and isinstance(value[0], Built):
                    value = (value[0]._replace(build_s=secs), *value[1:])
                r = r._replace(value=value)
            out.append(r)
        return out

    @property
    def pool(self) -> PopenPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = _shared_pool(self.max_workers, self.timeout_sec)
            return self._pool

    def build(self, build_inputs: list[BuilderInput]) -> list[BuilderResult]:
        results = []
        args = [(bi.mod, bi.target, self.artifact_dir) for bi in build_inputs]
        for r in self._map(_build_export, args):
            status, value = self._outcome(r)
            results.append(BuilderResult(value, None) if status == "ok" else BuilderResult(None, value))
        return results

    def build_references(self, mods: list, target, keys: list[str]) -> list[tuple[str, Any]]:
        """Build untuned kernels to run on this host, keeping each one's outputs as the
        reference under its key (:meth:`build_checked` then checks candidates against them).
        Returns per module ("ok", :class:`Built`, with the reference run's seconds), ("timeout",
        ...) or ("build_error", ...)."""
        args = [(m, target, self.artifact_dir, k) for m, k in zip(mods, keys)]
        return [self._outcome(r) for r in
                self._map(_build_reference_export, args)]

    def _outcome(self, r) -> tuple[str, Any]:
        if r.status == StatusKind.COMPLETE:
            return "ok", r.value
        if r.status == StatusKind.TIMEOUT:
            return "timeout", f"build timeout: killed after {self.timeout_sec:g} s"
        return "build_error", f"build error: {last_line(str(r.value))}"

    def build_checked(self, mods: list, target, ref_mod=None, ref_key: str = "",
                      references: list[tuple[Any, str]] | None = None,
                      run_here: bool = False) -> list[tuple[str, Any]]:
        """Build each module, first checking its output against ``ref_mod``'s (or, per module,
        against ``references[i] = (ref_mod, ref_key)``).

        Returns per module ("ok", :class:`Built`), ("wrong_result", max abs error or why),
        ("timeout", message) or ("build_error", message).
        """
        out = []
        refs = references or [(ref_mod, ref_key)] * len(mods)
        args = [(m, target, self.artifact_dir, r, rk, run_here) for m, (r, rk) in zip(mods, refs)]
        for r in self._map(_build_check_export, args):
            if r.status == StatusKind.COMPLETE:
                built, wrong = r.value
                out.append(("ok", built) if built else ("wrong_result", wrong))
            else:
                out.append(self._outcome(r))
        return out

    def compile_objects(self, mods: list, target) -> list[str]:
        """Compile each module of kernels to an object file, in parallel on the pool's workers.
        Raises on the first that fails or times out (the caller compiles in one process then)."""
        paths = [os.path.join(tempfile.mkdtemp(dir=self.artifact_dir), "kernels.o") for _ in mods]
        out = []
        for r in self._map(_compile_object, [(m, target, p) for m, p in zip(mods, paths)]):
            status, value = self._outcome(r)
            if status != "ok":
                raise RuntimeError(value)
            out.append(value)
        return out

    def kept_objects(self, funcs: list[tuple[str, Any]], target) -> dict[str, str]:
        """Of ``funcs`` (a model's kernels: symbol name, PrimFunc), those whose very program a
        build of this pool compiled for measuring (a winner, or an untuned kernel): name -> that
        object file, its function renamed from "main" to the name the model calls. Host targets
        only (objcopy renames); what is not here is compiled as before."""
        root = os.path.join(self.artifact_dir, OBJECTS)
        objcopy = shutil.which("objcopy")
        if objcopy is None or not os.path.isdir(root) or cross_compiler(target) is not None:
            return {}
        out = {}
        for name, f in funcs:
            key = object_key(f, target)
            src = os.path.join(root, f"{key}.o")
            if key is None or not os.path.exists(src) or f.attrs is None or f.attrs.get("global_symbol") != name:
                continue
            dst = os.path.join(tempfile.mkdtemp(dir=self.artifact_dir), f"{name}.o")
            done = subprocess.run([objcopy, f"--redefine-sym=__tvm_ffi_main=__tvm_ffi_{name}", src, dst],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                out[name] = dst
            else:
                log.warning("could not reuse the measured build of %s: %s", name, last_line(done.stderr))
        return out

    def warm(self) -> None:
        """Start every worker now (each imports TVM and ttrank: seconds) and wait for them."""
        for f in [self.pool.submit(_warm_worker) for _ in range(self.max_workers)]:
            f.result()

    def close(self) -> None:
        """Remove this builder's artifacts; the shared workers stay for the next builder."""
        self._pool = None
        shutil.rmtree(self.artifact_dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Runners


# recommend's protocol: every timed run starts with the kernel's arguments flushed from the caches,
# all but the first (TVM's cache_flush_cpu_non_first_arg), as its weights are inside the model,
# where the layers before evicted them; one run per repeat, since only the first is cold.
# Packed ResNet-50, chosen this way against warm (one process, alternating, 3 x 5 runs): 4-12%
# faster, and its measuring ran 9.5 s instead of 31 s (warm repeats grow to min_repeat_ms).
COLD_CACHE: dict[str, Any] = {"cache_flush": True, "number": 1, "repeat": 5, "min_repeat_ms": 0}


@dataclass
class RunnerSpec:
    """How to run candidates: locally, or on every device under one key of a TVM RPC tracker."""

    kind: str = "local"  # "local" or "rpc"
    tracker_host: str | None = None
    tracker_port: int | None = None
    device_key: str | None = None
    # one run per timed repeat, grown until a repeat lasts min_repeat_ms: a slow candidate is
    # not run 3 times per repeat (bench/results/measure_noise.json: as stable, 40% less time)
    number: int = 1
    repeat: int = 2
    min_repeat_ms: int = 20
    # off, as in MetaSchedule's tuning runs, so donor records and candidates compare directly
    cache_flush: bool = False
    timeout_sec: float = 30.0
    # Passes over the whole batch, each in a new shuffled order; a candidate's latency is the
    # minimum over all passes. On a shared machine the CPU runs in slow stretches of seconds,
    # longer than one candidate's repeats: passes spread each candidate across the batch's
    # time, so the candidates of one kernel are compared side by side, not one after another.
    rounds: int = 3
    # RPC: how long a key with no device is waited for (at the start, and when all have left)
    device_wait_s: float = 30.0
    # RPC: what the key's devices reported about themselves (filled by check())
    device: dict | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_tracker(cls, tracker: str, key: str, **kw) -> RunnerSpec:
        host, _, port = tracker.rpartition(":")
        if not port.isdigit():
            raise DeviceError(f"--rpc-tracker {tracker!r}: expected HOST:PORT, e.g. 127.0.0.1:9190")
        return cls(kind="rpc", tracker_host=host or "127.0.0.1", tracker_port=int(port),
                   device_key=key, **kw)

    def tracker(self) -> Tracker:
        return Tracker(str(self.tracker_host), int(self.tracker_port or 0), str(self.device_key))

    def evaluator_config(self):
        from tvm.s_tir.meta_schedule.runner import EvaluatorConfig

        return EvaluatorConfig(number=self.number, repeat=self.repeat,
                               min_repeat_ms=self.min_repeat_ms,
                               enable_cpu_cache_flush=self.cache_flush)

    def create(self):
        """A MetaSchedule Runner for this spec: over RPC, one that measures on every device
        under the key at once (:class:`ttrank.fleet.FleetRunner`)."""
        from tvm.s_tir.meta_schedule.runner import LocalRunner

        if self.kind == "local":  # one per settings in this process (_shared_runner)
            return _shared_runner(
                ("local", self.timeout_sec, self.number, self.repeat, self.min_repeat_ms, self.cache_flush),
                lambda: _guarded_runner(LocalRunner(timeout_sec=self.timeout_sec,
                                                    evaluator_config=self.evaluator_config(),
                                                    f_alloc_argument=alloc_in_bounds,
                                                    initializer=die_on_crash)))
        if self.kind == "rpc":
            return FleetRunner(self.tracker(), self.evaluator_config(),
                               session_timeout_s=self.timeout_sec, device_wait_s=self.device_wait_s)
        raise ValueError(f"unknown runner kind {self.kind!r}")

    def protocol(self) -> dict[str, int]:
        """What a latency is the minimum of, for the provenance of each measurement."""
        return {"number": self.number, "repeat": self.repeat, "rounds": self.rounds,
                "min_repeat_ms": self.min_repeat_ms, "cache_flush": self.cache_flush}

    def describe(self) -> str:
        if self.kind == "rpc":
            return f"rpc://{self.tracker_host}:{self.tracker_port}/{self.device_key}"
        return "local"

    def devices(self, timeout_s: float | None = None) -> int:
        """How many devices (RPC servers, free or busy) the tracker lists under our key.

        :class:`DeviceError` when the tracker cannot be reached or says nothing for
        ``timeout_s`` seconds: a silent tracker costs that long, never a hang.
        """
        return self.tracker().devices(TRACKER_TIMEOUT_S if timeout_s is None else timeout_s)

    def check(self, timeout_s: float | None = None) -> dict | None:
        """Before measuring: the tracker answers, lists a device with our key (waited for up to
        ``device_wait_s``), and the devices report one CPU. Returns what they reported."""
        if self.kind != "rpc":
            return None
        if self.device is None:
            tracker = self.tracker()
            n = tracker.wait_for_device(self.device_wait_s,
                                        TRACKER_TIMEOUT_S if timeout_s is None else timeout_s)
            self.device = one_cpu(probe(tracker, n, self.device_wait_s), tracker.key)
        return self.device

    def target(self) -> dict:
        """The target the key's devices report: what to compile for when none is given."""
        info = self.check()
        if not info or not info.get("mcpu"):
            return host_target_dict()
        t: dict[str, Any] = {"kind": "llvm", "mcpu": info["mcpu"]}
        if info.get("threads"):
            t["num-cores"] = info["threads"]
        if info.get("triple") and info["triple"].split("-")[0] != host_triple().split("-")[0]:
            t["mtriple"] = info["triple"]  # another architecture: cross-compile
        return t

    def provenance(self, target=None) -> dict[str, Any]:
        """What measured: the host's provenance, or the devices' own CPU, threads and triple."""
        prov = provenance(target)
        if self.kind != "rpc":
            return prov
        info = self.check() or {}
        mcpu = info.get("mcpu")
        want = target.attrs.get("mcpu") if target is not None else None
        if mcpu and want and str(want) != mcpu:
            raise DeviceError(f"the target is for {want} but the devices under key {self.device_key!r} "
                              f"report {mcpu}: pass --target for them, or leave it out to build for "
                              "what they report")
        return {**prov, "cpu": f"{mcpu or 'unknown'} ({info.get('triple') or '?'})", "mcpu": mcpu,
                "cores": info.get("threads"), "threads": info.get("threads"), "load_1m": None,
                "device_key": self.device_key, "device_triple": info.get("triple"),
                "devices": info.get("devices"), "tracker": f"{self.tracker_host}:{self.tracker_port}"}


# --------------------------------------------------------------------------------------------
# Batch measurement


@dataclass
class Measurement:
    """The outcome of building and running one scheduled module."""

    latency_s: float | None  # min over repeats; None when it failed
    status: str  # "ok", "build_error", "run_error", "timeout"
    error: str = ""
    all_secs: list[float] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)  # RPC: the device of each run, in order
    build_s: float | None = None  # its build's seconds in a pool worker (check included)
    # locally: the cores other processes kept busy (and the hypervisor took) while its batch ran
    foreign: CpuShare | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def foreign_json(self) -> dict | None:
        """:attr:`foreign` as its measurement row stores it."""
        return self.foreign.to_json() if self.foreign is not None else None


class Measurer:
    """Builds and runs scheduled PrimFunc modules in batches (one builder, one runner)."""

    def __init__(self, target, runner: RunnerSpec | None = None, build_timeout_sec: float = 60.0,
                 builder: WarmPoolBuilder | None = None):
        self.target = target
        self.spec = runner or RunnerSpec()
        self.builder = builder or WarmPoolBuilder(timeout_sec=build_timeout_sec)
        self._runner = None
        self._lock = threading.Lock()  # the runners are made once, by warm()'s thread or the caller
        self._warming: threading.Thread | None = None
        self._baselines: list[Measurer] = []  # their runners are closed with this one's
        # where measuring time goes; "build_wait": the part of "build" that the runs did not
        # hide (measure_stream builds the next batch while this one runs)
        self.seconds = {"build": 0.0, "run": 0.0, "build_wait": 0.0}
        self.foreign: list[CpuShare] = []  # locally, per batch run: what other work took meanwhile

    @property
    def runner(self):
        with self._lock:
            if self._runner is None:
                self.spec.check()  # a tracker that is down, no device, mixed CPUs: one clear error now
                self._runner = self.spec.create()
            return self._runner

    def warm(self) -> None:
        """Start the build workers and the local runners in the background, so that they are
        ready when the first batch comes: each worker process imports TVM (about 2 s), and a
        LocalRunner waits for its worker when it is made. Over RPC nothing is started early (the
        tracker's errors belong to the caller's thread)."""
        if self.spec.kind != "local" or self._warming is not None:
            return

        def run() -> None:
            # a failure here is met again, and reported, where the workers are used
            with contextlib.suppress(Exception):
                self.builder.warm()
                _ = self.baseline().runner, self.runner

        self._warming = threading.Thread(target=run, name="ttrank-warm", daemon=True)
        self._warming.start()

    def _result(self, fut, measured: int):
        """A runner future's result. Over RPC, the tracker is asked every few seconds while
        the candidate waits: with no device left for the key (for longer than the spec's
        ``device_wait_s``), the session request would wait forever, so this raises
        :class:`DeviceError` instead."""
        if self.spec.kind != "rpc":
            return fut.result()
        next_check, empty_since = time.time() + DEVICE_POLL_S, None
        while not fut.done():
            if time.time() >= next_check:
                if self.spec.devices():
                    empty_since = None
                else:
                    empty_since = empty_since or time.time()
                    if time.time() - empty_since >= self.spec.device_wait_s:
                        raise self._no_device_left(measured)
                next_check = time.time() + DEVICE_POLL_S
            time.sleep(0.02)
        return fut.result()

    def _no_device_left(self, measured: int) -> DeviceError:
        return DeviceError(
            f"no device with key {self.spec.device_key!r} is left at RPC tracker "
            f"{self.spec.tracker_host}:{self.spec.tracker_port} (it went away while measuring, "
            f"after {measured} candidate run(s)); what was measured is kept, rerun to resume")

    def _abandon(self, futures: list) -> None:
        """Stop an RPC runner whose workers wait for sessions that will never come.

        Its worker processes are killed, not shut down: a thread blocked on a worker holds its
        pipe, so TVM's own shutdown (which closes that pipe first) would wait for it forever,
        and so would the interpreter's exit.
        """
        runner, self._runner = self._runner, None
        if runner is None:
            return
        # the waiting worker is killed; what it ran then fails at once, so every future ends
        # and nothing waits at exit
        stop = getattr(runner, "stop", None)
        if stop is not None:  # a fleet: no retry of what is cut off now
            stop()
        pool = getattr(runner, "pool", None)
        for worker in list(getattr(pool, "_worker_map", {}).values()):
            proc = getattr(worker, "_proc", None)
            if proc is not None:
                with contextlib.suppress(OSError):
                    proc.kill()
        deadline = time.time() + 30
        while time.time() < deadline and not all(f.done() for f in futures):
            time.sleep(0.1)

    def measure(self, mods: list, reference=None, reference_key: str = "",
                references: list[tuple[Any, str]] | None = None,
                as_references: list[str] | None = None) -> list[Measurement]:
        """Build and run each module; a failure of one never stops the batch.

        With ``reference`` (the untuned kernel), each module's output is first compared with
        the reference's on the same random inputs, and a mismatch is a ``wrong_result``.
        ``references`` gives each module its own (reference, key), so one batch can hold the
        candidates of several kernels and keep every build worker busy. ``as_references``
        (untuned kernels, measured on this host): each module's outputs become the reference
        of its key, from the same build.
        """
        if not mods:
            return []
        if as_references is not None and self.spec.kind == "local":
            t0 = time.time()
            built = self.builder.build_references(mods, self.target, as_references)
            self.seconds["build"] += time.time() - t0
            return self._run_references(mods, built)
        return self._run(mods, self._build(mods, reference, reference_key, references))

    def measure_stream(self, batches: Iterable[tuple], stop: Callable[[], bool] | None = None
                       ) -> Iterator[list[Measurement]]:
        """Measure batches of (modules, references[, known]), one result list per batch, in order.

        Over RPC the next batch is built while this one runs, so a fleet of devices does not
        wait for the host's builds (then the next batch is taken from ``batches`` before this
        one runs); a candidate is built once, whichever device runs it. ``stop`` (a budget) is asked
        before every batch but the first runs: once it says so, nothing more runs.
        ``known()`` gives per module the best latency already known for its kernel (or None),
        and turns on settling: a module whose output check already took over
        :data:`PRESETTLE_FACTOR` times that (and :data:`SELF_TIMED_S` or more) is not run, and
        after the first pass, one over :data:`SETTLE_FACTOR` times that or the best of its
        kernel's modules in the batch is run no more.
        """
        it = iter(batches)
        # Locally, the candidates run on the cores that build: a build beside a run slows it
        # and skews its timing, and saves no time when both saturate the cores (the sum of the
        # work is the same). So the next batch is built ahead only for remote devices.
        ahead = self.spec.kind != "local"

        def start(ex: ThreadPoolExecutor):
            job = next(it, None)
            if job is None:
                return None
            mods, refs, *known = job
            return (mods, (known or [None])[0], [key for _, key in refs] if refs else None,
                    ex.submit(self._build, mods, None, "", refs) if mods else None)

        with ThreadPoolExecutor(1, thread_name_prefix="ttrank-build-ahead") as ex:
            nxt, first = start(ex), True
            while nxt is not None:
                mods, known, keys, fut = nxt
                t0 = time.time()
                built = fut.result() if fut is not None else []
                self.seconds["build_wait"] += time.time() - t0
                if not first and stop is not None and stop():
                    for status, value in built:  # built ahead, never to run
                        if status == "ok":
                            _rm(value.path)
                    return
                first = False
                if ahead:
                    nxt = start(ex)
                    yield self._run(mods, built, known, keys) if mods else []
                else:
                    results = self._run(mods, built, known, keys) if mods else []
                    nxt = start(ex)
                    yield results

    def _build(self, mods: list, reference=None, reference_key: str = "",
               references: list[tuple[Any, str]] | None = None) -> list[tuple[str, Any]]:
        t0 = time.time()
        if references is not None or reference is not None:
            built = self.builder.build_checked(mods, self.target, reference, reference_key, references,
                                               run_here=self.spec.kind == "local")
        else:
            built = [("ok", Built(b.artifact_path)) if not b.error_msg else
                     ("timeout" if "timeout" in b.error_msg else "build_error", b.error_msg)
                     for b in self.builder.build([BuilderInput(m, self.target) for m in mods])]
        self.seconds["build"] += time.time() - t0
        return built

    def _run(self, mods: list, built: list[tuple[str, Any]],
             known: Callable[[], list[float | None]] | None = None,
             keys: list[str] | None = None) -> list[Measurement]:
        """Run the built modules (:meth:`measure_stream` says how ``known`` settles them;
        ``keys``, each module's kernel, lets the batch's own first pass settle them too)."""
        from tvm.s_tir.meta_schedule.runner import RunnerInput

        out: list[Measurement | None] = [None] * len(mods)
        inputs, idx, paths = [], [], []
        for i, (m, (status, value)) in enumerate(zip(mods, built)):
            if status == "wrong_result":
                why = value if isinstance(value, str) else f"max abs error {value:.3g} against the untuned kernel"
                out[i] = Measurement(None, status, f"wrong result: {why}")
                continue
            if status != "ok":
                out[i] = Measurement(None, status, str(value))
                continue
            inputs.append(RunnerInput(value.path, "cpu", _run_args(m)))
            idx.append(i)
            paths.append(value.path)
        t1 = time.time()
        load = ForeignLoad() if self.spec.kind == "local" else None  # a remote device's is not ours to see
        if load is not None:
            load.start()
        secs: dict[int, list[float]] = {i: [] for i in idx}
        devices: dict[int, list[str]] = {i: [] for i in idx}
        errors: dict[int, str] = {}
        order = list(range(len(inputs)))
        rng = random.Random(len(inputs))
        lost: dict[int, str] = {}  # RPC: the device went away mid-run; the next pass retries
        settled: set[int] = set()  # far slower than its kernel's best: run no more
        if known is not None:  # the output check's call was enough for some
            for i, best in enumerate(known()):
                once = built[i][1].once_s if i in secs else None
                if best is not None and once is not None and once >= SELF_TIMED_S \
                        and once > PRESETTLE_FACTOR * best:
                    secs[i] = [once]
                    settled.add(i)
        presettled = frozenset(settled)
        runs = 0
        for rnd in range(max(1, self.spec.rounds)):
            if rnd == 1 and known is not None:
                mins = {i: min(s) for i, s in secs.items() if s}
                batch_best: dict = {}  # per kernel (each module its own without keys), this pass
                # only timed runs set it: a check's one cold call is another kind of measurement
                # (and those settled by it are over 4x the kernel's best known anyway)
                for i, m in mins.items():
                    if i in presettled:
                        continue
                    kernel = keys[i] if keys else i
                    batch_best[kernel] = min(batch_best.get(kernel, m), m)
                for i, best in enumerate(known()):
                    kernel = keys[i] if keys else i
                    if i in mins and mins[i] > SETTLE_FACTOR * min(batch_best.get(kernel, math.inf),
                                                                   best if best is not None else math.inf):
                        settled.add(i)
            live = [j for j in order if idx[j] not in errors and idx[j] not in settled]
            if not live:
                break
            resize = getattr(self.runner, "resize", None)
            if resize is not None:  # a fleet: devices that joined or left since the last batch
                try:
                    resize()
                except DeviceError:  # they were there when checked: they went away
                    raise self._no_device_left(runs) from None
            futures = self.runner.run([inputs[j] for j in live])
            for j, fut in zip(live, futures):
                try:
                    r = self._result(fut, runs)
                    device_lost = bool(r.error_msg and self.spec.kind == "rpc"
                                       and DEVICE_LOST.search(r.error_msg))
                    if device_lost and not self.spec.devices():
                        raise self._no_device_left(runs)
                except DeviceError:
                    self._abandon(futures)
                    raise
                runs += 1
                if device_lost:  # another device may measure it in a later pass
                    lost[idx[j]] = (f"RPC device lost mid-measure ({last_line(r.error_msg)}); "
                                    "no later pass could measure it")
                elif r.error_msg:
                    errors[idx[j]] = r.error_msg
                else:
                    secs[idx[j]] += [float(s) for s in r.run_secs]
            conflict = getattr(self._runner, "conflict", "")
            if conflict:  # a device that joined reports another CPU than the key's
                raise DeviceError(conflict)
            rng.shuffle(order)
        runs_of = getattr(self._runner, "runs_of", None)
        if runs_of is not None:  # a fleet: which device ran each pass
            for i, p in zip(idx, paths):
                devices[i] = runs_of(p)
        for i in idx:
            msg = errors.get(i)
            is_timeout = msg is not None and ("Timeout" in msg or "timeout" in msg)
            # a later pass that times out under load does not undo the passes that finished
            if secs[i] and (msg is None or is_timeout):
                out[i] = Measurement(min(secs[i]), "ok", "", secs[i], devices[i])
            elif msg is None and i in lost:
                out[i] = Measurement(None, "run_error", lost[i], devices=devices[i])
            else:
                out[i] = Measurement(None, "timeout" if is_timeout else "run_error", last_line(msg or ""),
                                     devices=devices[i])
        foreign = load.stop() if load is not None else None
        if foreign is not None:
            self.foreign.append(foreign)
        for i in idx:  # where the measuring time went, per candidate
            out[i].build_s = built[i][1].build_s
            out[i].foreign = foreign
        for p in paths:
            _rm(p)
        self.seconds["run"] += time.time() - t1
        return out  # type: ignore[return-value]

    def _run_references(self, mods: list, built: list[tuple[str, Any]]) -> list[Measurement]:
        """Untuned kernels whose reference run took :data:`SELF_TIMED_S` or more keep that run's
        time; the others are run as usual."""
        out: list[Measurement | None] = [None] * len(mods)
        rest = []
        for i, (status, value) in enumerate(built):
            if status == "ok" and value.once_s >= SELF_TIMED_S:
                out[i] = Measurement(value.once_s, "ok", "", [value.once_s])
                _rm(value.path)
            else:
                rest.append(i)
        ran = self._run([mods[i] for i in rest],
                        [built[i] for i in rest])
        for i, m in zip(rest, ran):
            out[i] = m
        return out  # type: ignore[return-value]

    @property
    def build_busy_s(self) -> float | None:
        """Seconds each build worker was busy building, on average (None: not a pool of ours);
        beside ``seconds["build"]`` it says how much of the builds' wall time the workers used."""
        b = self.builder
        return b.busy_s / b.max_workers if isinstance(b, WarmPoolBuilder) else None

    def compile_objects(self, mods: list, target) -> list[str]:
        """Compile modules of kernels to object files on the build pool's workers (see
        :meth:`WarmPoolBuilder.compile_objects`); a builder of another kind compiles nothing
        here, and the caller compiles in one process."""
        if not isinstance(self.builder, WarmPoolBuilder):
            raise NotImplementedError(f"{type(self.builder).__name__} compiles no object files")
        return self.builder.compile_objects(mods, target)

    def kept_objects(self, funcs: list[tuple[str, Any]], target) -> dict[str, str]:
        """The measured builds the model's compile can link (see :meth:`WarmPoolBuilder.kept_objects`);
        none from a builder of another kind."""
        return self.builder.kept_objects(funcs, target) if isinstance(self.builder, WarmPoolBuilder) else {}

    def busiest(self) -> CpuShare | None:
        """Of the batches run so far (locally), the one that other work disturbed most."""
        return max(self.foreign, key=lambda f: f.cores, default=None)

    def baseline(self) -> Measurer:
        """A measurer sharing this builder that runs once: for slow untuned kernels, where
        one run is long enough to time and repeats would cost seconds each."""
        with self._lock:
            if not self._baselines:
                spec = RunnerSpec(**{**self.spec.__dict__, "number": 1, "repeat": 1, "min_repeat_ms": 0,
                                     "rounds": 1})
                m = Measurer(self.target, spec, builder=self.builder)
                m.seconds, m.foreign = self.seconds, self.foreign  # one account for both
                self._baselines.append(m)
            return self._baselines[0]

    def fleet_usage(self) -> dict[str, int]:
        """Over RPC: the most devices that measured at once, and the runs, of this measurer
        and its baselines (zeros when measuring locally)."""
        runners = [m._runner for m in [self, *self._baselines] if hasattr(m._runner, "peak")]
        return {"servers_used": max((r.peak() for r in runners), default=0),
                "runs": sum(len(r.sessions) for r in runners)}

    def close(self) -> None:
        if self._warming is not None:  # no worker may start after the pools are shut
            self._warming.join()
        for m in [self, *self._baselines]:
            close = getattr(m._runner, "close", None)
            if close is not None:  # a fleet runner's pool
                close()
        self.builder.close()


def _run_args(mod):
    """The built kernel's arguments: a pre-packed (layout-rewritten) schedule is built without
    its weight-rewrite block, so it takes the weight in the packed layout, as MetaSchedule's
    own runner inputs say (``from_entry_func(remove_preproc=True)``)."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    try:
        return ArgInfo.from_entry_func(mod, remove_preproc=True)
    except Exception:  # noqa: BLE001 - no single entry function
        return ArgInfo.from_prim_func(mod[[gv for gv in mod.functions][0]])


def _rm(path: str) -> None:
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def summarize(measurements: list[Measurement]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for m in measurements:
        counts[m.status] = counts.get(m.status, 0) + 1
    return counts
