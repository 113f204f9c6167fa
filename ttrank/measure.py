"""Measuring kernels: a warm-pool builder, local and RPC runners, and batch measurement.

The builder and runners implement MetaSchedule's own Builder/Runner interfaces, so the same
objects serve ``ttrank tune`` (inside MetaSchedule's search) and candidate measurement.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult, PyBuilder
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

log = logging.getLogger("ttrank")

# Test hook: a build whose module has this attribute sleeps, to prove timeouts work.
HANG_ATTR = "ttrank.test_hang_seconds"


def _worker_init() -> None:
    # the pool's workers inherit nothing: keep TVM's C++ log quiet unless asked for
    os.environ.setdefault("TVM_LOG_DEBUG", "0")


def _build_export(mod, target, artifact_dir: str) -> str:
    """Build a scheduled PrimFunc module and export it (runs in a pool worker).

    Unlike MetaSchedule's default_build this does not import tvm.s_tir.tensor_intrin, which
    costs ~30 s per fresh worker; scheduling (in the parent) already registered what it needed.
    """
    import tvm
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    func = mod[[gv for gv in mod.functions][0]]
    hang = func.attrs.get(HANG_ATTR) if func.attrs is not None else None
    if hang is not None:
        time.sleep(float(hang))
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    rt_mod = tvm.compile(mod, target=target)
    # one folder per artifact: MetaSchedule's RemoveBuildArtifact removes the artifact's folder
    os.makedirs(artifact_dir, exist_ok=True)
    path = os.path.join(tempfile.mkdtemp(dir=artifact_dir), "kernel.so")
    rt_mod.export_library(path)
    return path


@derived_object
class WarmPoolBuilder(PyBuilder):
    """A MetaSchedule builder whose worker processes live for the whole session.

    MetaSchedule's LocalBuilder starts a new pool for every batch; each worker then imports
    the tensor intrinsics (~30 s here). This pool starts once, and a per-candidate timeout kills
    (and replaces) only a worker whose build hangs.
    """

    def __init__(self, max_workers: int | None = None, timeout_sec: float = 60.0,
                 artifact_dir: str | None = None) -> None:
        super().__init__()
        from .target import host_cores

        self.max_workers = max_workers or host_cores()
        self.timeout_sec = timeout_sec
        self.artifact_dir = artifact_dir or tempfile.mkdtemp(prefix="ttrank-build-")
        os.makedirs(self.artifact_dir, exist_ok=True)
        self._pool: PopenPoolExecutor | None = None

    @property
    def pool(self) -> PopenPoolExecutor:
        if self._pool is None:
            self._pool = PopenPoolExecutor(max_workers=self.max_workers, timeout=self.timeout_sec,
                                           initializer=_worker_init)
        return self._pool

    def build(self, build_inputs: list[BuilderInput]) -> list[BuilderResult]:
        results = []
        args = [(bi.mod, bi.target, self.artifact_dir) for bi in build_inputs]
        for r in self.pool.map_with_error_catching(lambda a: _build_export(*a), args):
            if r.status == StatusKind.COMPLETE:
                results.append(BuilderResult(r.value, None))
            elif r.status == StatusKind.TIMEOUT:
                results.append(BuilderResult(None, f"build timeout: killed after {self.timeout_sec:g} s"))
            else:
                results.append(BuilderResult(None, f"build error: {_last_line(str(r.value))}"))
        return results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        shutil.rmtree(self.artifact_dir, ignore_errors=True)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:500] if lines else text[:500]


# --------------------------------------------------------------------------------------------
# Runners


@dataclass
class RunnerSpec:
    """How to run candidates: locally, or on a device behind a TVM RPC tracker."""

    kind: str = "local"  # "local" or "rpc"
    tracker_host: str | None = None
    tracker_port: int | None = None
    device_key: str | None = None
    number: int = 3
    repeat: int = 3
    min_repeat_ms: int = 50
    cache_flush: bool = True
    timeout_sec: float = 30.0

    @classmethod
    def from_tracker(cls, tracker: str, key: str, **kw) -> RunnerSpec:
        host, _, port = tracker.rpartition(":")
        return cls(kind="rpc", tracker_host=host or "127.0.0.1", tracker_port=int(port),
                   device_key=key, **kw)

    def evaluator_config(self):
        from tvm.s_tir.meta_schedule.runner import EvaluatorConfig

        return EvaluatorConfig(number=self.number, repeat=self.repeat,
                               min_repeat_ms=self.min_repeat_ms,
                               enable_cpu_cache_flush=self.cache_flush)

    def create(self):
        """A MetaSchedule Runner for this spec."""
        from tvm.s_tir.meta_schedule.runner import LocalRunner, RPCConfig, RPCRunner

        if self.kind == "local":
            return LocalRunner(timeout_sec=self.timeout_sec,
                               evaluator_config=self.evaluator_config())
        if self.kind == "rpc":
            cfg = RPCConfig(tracker_host=self.tracker_host, tracker_port=self.tracker_port,
                            tracker_key=self.device_key, session_timeout_sec=int(self.timeout_sec))
            return RPCRunner(rpc_config=cfg, evaluator_config=self.evaluator_config(),
                             max_workers=1)
        raise ValueError(f"unknown runner kind {self.kind!r}")

    def describe(self) -> str:
        if self.kind == "rpc":
            return f"rpc://{self.tracker_host}:{self.tracker_port}/{self.device_key}"
        return "local"


# --------------------------------------------------------------------------------------------
# Batch measurement


@dataclass
class Measurement:
    """The outcome of building and running one scheduled module."""

    latency_s: float | None  # min over repeats; None when it failed
    status: str  # "ok", "build_error", "run_error", "timeout"
    error: str = ""
    all_secs: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Measurer:
    """Builds and runs scheduled PrimFunc modules in batches (one builder, one runner)."""

    def __init__(self, target, runner: RunnerSpec | None = None, build_timeout_sec: float = 60.0,
                 builder: WarmPoolBuilder | None = None):
        self.target = target
        self.spec = runner or RunnerSpec()
        self.builder = builder or WarmPoolBuilder(timeout_sec=build_timeout_sec)
        self._runner = None

    @property
    def runner(self):
        if self._runner is None:
            self._runner = self.spec.create()
        return self._runner

    def measure(self, mods: list) -> list[Measurement]:
        """Build and run each module; a failure of one never stops the batch."""
        from tvm.s_tir.meta_schedule.arg_info import ArgInfo
        from tvm.s_tir.meta_schedule.runner import RunnerInput

        if not mods:
            return []
        built = self.builder.build([BuilderInput(m, self.target) for m in mods])
        out: list[Measurement | None] = [None] * len(mods)
        inputs, idx = [], []
        for i, (m, b) in enumerate(zip(mods, built)):
            if b.error_msg:
                status = "timeout" if "timeout" in b.error_msg else "build_error"
                out[i] = Measurement(None, status, b.error_msg)
                continue
            func = m[[gv for gv in m.functions][0]]
            inputs.append(RunnerInput(b.artifact_path, "cpu", ArgInfo.from_prim_func(func)))
            idx.append(i)
        futures = self.runner.run(inputs) if inputs else []
        for i, fut in zip(idx, futures):
            r = fut.result()
            if r.error_msg:
                status = "timeout" if "Timeout" in r.error_msg or "timeout" in r.error_msg else "run_error"
                out[i] = Measurement(None, status, _last_line(r.error_msg))
            else:
                secs = [float(s) for s in r.run_secs]
                out[i] = Measurement(min(secs), "ok", "", secs)
        for b in built:
            if b.artifact_path:
                _rm(b.artifact_path)
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.builder.close()


def _rm(path: str) -> None:
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def summarize(measurements: list[Measurement]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for m in measurements:
        counts[m.status] = counts.get(m.status, 0) + 1
    return counts
