"""Whole-model compile, export, run, time, and check against onnxruntime."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CheckError, TTRankError
from .frontend import LoadedModel

log = logging.getLogger("ttrank")


def compile_model(model: LoadedModel, target, database=None):
    """Compile with the default CPU pipeline, or with a MetaSchedule database's schedules."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    if database is None:
        with tvm.transform.PassContext(opt_level=3):
            return tvm.compile(model.mod, target=target)
    return ms.relax_integration.compile_relax(database, model.mod, target, params=None)


def export(executable, path: str | Path) -> Path:
    """Export a compiled model to a shared library, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix or ".so")
    os.close(fd)
    try:
        executable.export_library(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


class CompiledModel:
    """A compiled model loaded in a Relax VM."""

    def __init__(self, lib, inputs):
        import tvm
        from tvm import relax

        self.dev = tvm.cpu()
        self.vm = relax.VirtualMachine(lib, self.dev)
        self.inputs = inputs

    @classmethod
    def load(cls, path: str | Path, model: LoadedModel) -> CompiledModel:
        import tvm

        return cls(tvm.runtime.load_module(str(path)), model.inputs)

    @classmethod
    def from_executable(cls, executable, model: LoadedModel) -> CompiledModel:
        return cls(executable, model.inputs)

    def _args(self, feed: dict[str, np.ndarray]):
        import tvm

        return [tvm.runtime.tensor(feed[s.name], self.dev) for s in self.inputs]

    def run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        out = self.vm["main"](*self._args(feed))
        return [o.numpy() for o in out] if not hasattr(out, "numpy") else [out.numpy()]

    def time_ms(self, feed: dict[str, np.ndarray], repeat: int = 5, min_repeat_ms: int = 200) -> float:
        """Minimum over repeats of the mean latency (ms), with time_evaluator."""
        self.vm.set_input("main", *self._args(feed))
        f = self.vm.time_evaluator("invoke_stateful", self.dev, number=1, repeat=repeat,
                                   min_repeat_ms=min_repeat_ms)
        return 1e3 * min(f("main").results)


def onnxruntime_session(model: LoadedModel, threads: int | None = None):
    import onnxruntime as ort

    from .target import host_cores

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or host_cores()
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.onnx_model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def onnxruntime_reference(model: LoadedModel, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return onnxruntime_session(model).run(None, feed)


def onnxruntime_time_ms(model: LoadedModel, feed: dict[str, np.ndarray], repeat: int = 5,
                        min_repeat_ms: int = 200) -> float:
    sess = onnxruntime_session(model)
    sess.run(None, feed)
    best = float("inf")
    for _ in range(repeat):
        n, t0 = 0, time.perf_counter()
        while True:
            sess.run(None, feed)
            n += 1
            el = time.perf_counter() - t0
            if el * 1e3 >= min_repeat_ms:
                break
        best = min(best, el / n)
    return best * 1e3


@dataclass
class CheckResult:
    max_abs_error: float
    max_rel_error: float
    outputs: int
    ok: bool
    atol: float
    rtol: float

    def to_json(self) -> dict:
        return self.__dict__.copy()


def check_outputs(got: list[np.ndarray], ref: list[np.ndarray], atol: float = 1e-3,
                  rtol: float = 1e-3) -> CheckResult:
    """Compare outputs; errors are scaled by each reference's magnitude for the verdict."""
    if len(got) != len(ref):
        raise CheckError(f"compiled model has {len(got)} outputs, onnxruntime {len(ref)}")
    max_abs, max_rel, ok = 0.0, 0.0, True
    for g, r in zip(got, ref):
        r = np.asarray(r)
        if g.shape != r.shape:
            raise CheckError(f"output shape {g.shape} differs from onnxruntime's {r.shape}")
        err = float(np.max(np.abs(g.astype(np.float64) - r))) if g.size else 0.0
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        max_abs = max(max_abs, err)
        max_rel = max(max_rel, err / scale if scale > 0 else err)
        ok = ok and bool(np.allclose(g, r, atol=atol * max(1.0, scale), rtol=rtol))
    return CheckResult(max_abs, max_rel, len(got), ok, atol, rtol)


def check_against_onnxruntime(compiled: CompiledModel, model: LoadedModel, seed: int = 0,
                              atol: float = 1e-3, rtol: float = 1e-3) -> CheckResult:
    feed = model.random_inputs(seed)
    try:
        ref = onnxruntime_reference(model, feed)
    except Exception as e:
        raise TTRankError(f"onnxruntime cannot run this model, so outputs cannot be checked: "
                          f"{str(e).splitlines()[0][:300]}") from None
    return check_outputs(compiled.run(feed), ref, atol, rtol)


def model_latencies(model: LoadedModel, target, database=None, repeat: int = 3,
                    untuned: bool = True) -> dict:
    """Whole-model latency (ms): untuned, with the database, and onnxruntime, side by side."""
    from .target import provenance

    feed = model.random_inputs()
    out: dict = {}
    if untuned:
        out["untuned"] = CompiledModel.from_executable(compile_model(model, target), model).time_ms(
            feed, repeat=repeat, min_repeat_ms=0)
    if database is not None:
        tuned = CompiledModel.from_executable(compile_model(model, target, database), model)
        out["tuned"] = tuned.time_ms(feed, repeat=repeat)
        out["check_max_abs_error"] = check_against_onnxruntime(tuned, model).max_abs_error
    out["onnxruntime"] = onnxruntime_time_ms(model, feed, repeat=repeat)
    out["provenance"] = provenance(target)
    return out
