"""ONNX loading: bind dynamic dims, simplify when the importer needs it, import into Relax."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from .errors import DynamicShapeError, ModelLoadError, UnsupportedOpError

log = logging.getLogger("ttrank")

_ONNX_TO_NUMPY = {
    onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.DOUBLE: "float64", onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.BOOL: "bool",
}


@dataclass
class InputSpec:
    name: str
    shape: list[int]
    dtype: str


@dataclass
class LoadedModel:
    """An ONNX model with every input shape bound, and its Relax import."""

    path: str
    onnx_model: onnx.ModelProto
    inputs: list[InputSpec]
    mod: object  # tvm.IRModule
    params: dict = field(default_factory=dict)
    simplified: bool = False
    fast_math: bool = False

    @property
    def name(self) -> str:
        return Path(self.path).stem

    def random_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Deterministic inputs: normal floats; small non-negative ints (valid token ids/masks)."""
        rng = np.random.default_rng(seed)
        out = {}
        for spec in self.inputs:
            if spec.dtype.startswith("float"):
                out[spec.name] = rng.standard_normal(spec.shape).astype(spec.dtype)
            elif spec.dtype == "bool":
                out[spec.name] = np.ones(spec.shape, dtype=bool)
            else:
                # ids must index the smallest embedding table; masks are 0/1, ones are safe
                hi = 2 if "mask" in spec.name.lower() else 100
                lo = 1 if "mask" in spec.name.lower() else 0
                out[spec.name] = rng.integers(lo, hi, spec.shape).astype(spec.dtype)
        return out


def parse_input_shapes(items: list[str] | None) -> dict[str, list[int]]:
    """Parse repeated ``NAME:1,3,224,224`` flags."""
    shapes: dict[str, list[int]] = {}
    for item in items or []:
        name, sep, dims = item.rpartition(":")
        if not sep or not name:
            raise ModelLoadError(f"--input-shape {item!r}: expected NAME:D1,D2,... e.g. input:1,3,224,224")
        try:
            shapes[name] = [int(d) for d in dims.split(",") if d.strip()]
        except ValueError:
            raise ModelLoadError(f"--input-shape {item!r}: dims must be integers") from None
        if not shapes[name] or any(d <= 0 for d in shapes[name]):
            raise ModelLoadError(f"--input-shape {item!r}: dims must be positive integers")
    return shapes


def read_onnx(path: str | Path) -> onnx.ModelProto:
    """Read and validate an ONNX file; every failure becomes one clear ModelLoadError."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a directory, not an ONNX file")
    try:
        model = onnx.load(str(path))
    except Exception as e:  # protobuf raises DecodeError and friends
        raise ModelLoadError(f"{path}: not a valid ONNX file ({type(e).__name__}: {e})") from None
    if not model.graph.node:
        raise ModelLoadError(f"{path}: not a valid ONNX file (no graph nodes; truncated or not ONNX?)")
    try:
        onnx.checker.check_model(model)
    except Exception as e:
        # graphs over 2 GB cannot be checked in memory, and some exporters bend the spec; warn only
        log.warning("%s: ONNX checker: %s", path, str(e).splitlines()[0])
    return model


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def bind_input_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> list[InputSpec]:
    """Write the given shapes into the model's inputs; raise if any dim stays dynamic."""
    inputs = graph_inputs(model)
    names = {i.name for i in inputs}
    for name in shapes:
        if name not in names:
            raise ModelLoadError(f"--input-shape names {name!r}, but the model's inputs are: "
                                 + ", ".join(sorted(names)))
    specs = []
    for inp in inputs:
        tt = inp.type.tensor_type
        dims = tt.shape.dim
        if inp.name in shapes:
            want = shapes[inp.name]
            if len(want) != len(dims):
                raise ModelLoadError(f"--input-shape {inp.name}: model input has rank {len(dims)}, "
                                     f"got {len(want)} dims")
            for d, v in zip(dims, want):
                if d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != v:
                    raise ModelLoadError(f"--input-shape {inp.name}: dim {d.dim_value} is fixed "
                                         f"in the model, got {v}")
                d.Clear()
                d.dim_value = v
        dynamic = [d.dim_param or "?" for d in dims if not (d.HasField("dim_value") and d.dim_value > 0)]
        if dynamic:
            example = ",".join(str(d.dim_value) if d.dim_value > 0 else "N" for d in dims)
            raise DynamicShapeError(
                f"input {inp.name!r} has dynamic dims ({', '.join(dynamic)}); bind them with "
                f"--input-shape {inp.name}:{example}")
        dtype = _ONNX_TO_NUMPY.get(tt.elem_type)
        if dtype is None:
            raise ModelLoadError(f"input {inp.name!r}: unsupported element type {tt.elem_type}")
        specs.append(InputSpec(inp.name, [d.dim_value for d in dims], dtype))
    # stale inferred shapes of intermediate values would contradict the bound inputs
    del model.graph.value_info[:]
    return specs


def unsupported_ops(model: onnx.ModelProto) -> list[str]:
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = _get_convert_map()
    ops = {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")}
    return sorted(op for op in ops if op not in known)


def simplify(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fold shape arithmetic into constants (onnxslim), as Paddle2ONNX-style graphs need."""
    import onnxslim

    return onnxslim.slim(model)


def _import(model: onnx.ModelProto, specs: list[InputSpec]):
    from tvm.relax.frontend.onnx import from_onnx

    shape_dict = {s.name: s.shape for s in specs}
    dtype_dict = {s.name: s.dtype for s in specs}
    return from_onnx(model, shape_dict=shape_dict, dtype_dict=dtype_dict)


def load(path: str | Path, input_shapes: dict[str, list[int]] | None = None,
         simplify_graph: str = "auto", fast_math: bool = False) -> LoadedModel:
    """Load an ONNX file into Relax.

    ``simplify_graph``: "auto" simplifies only when the plain import fails; "always"/"never".
    ``fast_math``: see :func:`with_fast_math`.
    """
    model = read_onnx(path)
    specs = bind_input_shapes(model, input_shapes or {})
    missing = unsupported_ops(model)
    if missing:
        raise UnsupportedOpError(f"{path}: unsupported ONNX op(s) for TVM's importer: "
                                 + ", ".join(missing))
    simplified = False
    if simplify_graph == "always":
        model, simplified = simplify(model), True
    try:
        mod = _import(model, specs)
    except Exception as first:
        if simplify_graph != "auto":
            raise ModelLoadError(f"{path}: TVM's ONNX importer failed: {_short(first)}") from None
        log.info("plain import failed (%s); simplifying the graph and retrying", _short(first))
        try:
            model = simplify(model)
            simplified = True
            mod = _import(model, specs)
        except Exception as second:
            raise ModelLoadError(f"{path}: TVM's ONNX importer failed, also after graph "
                                 f"simplification: {_short(second)}") from None
    if fast_math:
        mod = with_fast_math(mod)
    # weights stay bound as constants: FoldConstant and the tuned kernels see real shapes
    return LoadedModel(str(path), model, specs, mod, {}, simplified, fast_math)


def with_fast_math(mod):
    """Vectorisable approximations of the transcendental activations (max error ~1e-6).

    TVM lowers ``exp``/``erf``/``tanh`` to scalar libm calls on CPU: a swish or GELU epilogue
    then costs more than the convolution or matmul it follows (EfficientNet, BERT). Sigmoid and
    GELU are rewritten in terms of exp and erf, and TVM's FastMathTransform replaces those
    with polynomial versions (topi.fast_exp/fast_erf/fast_tanh), as onnxruntime's MLAS does.
    """
    import tvm
    from tvm import relax

    @relax.expr_functor.mutator
    class _Activations(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not isinstance(call.op, tvm.ir.Op) or not call.args:
                return call
            x = call.args[0]
            if call.op.name == "relax.sigmoid":
                one = relax.const(1.0, x.ty.dtype)
                return relax.op.divide(one, relax.op.add(one, relax.op.exp(relax.op.negative(x))))
            if call.op.name == "relax.nn.gelu":
                dt = x.ty.dtype
                half, one = relax.const(0.5, dt), relax.const(1.0, dt)
                inner = relax.op.erf(relax.op.multiply(x, relax.const(0.7071067811865476, dt)))
                return relax.op.multiply(relax.op.multiply(half, x), relax.op.add(one, inner))
            return call

    mod = mod.clone()  # the caller's module stays as it was
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = _Activations().visit_expr(func)
    return relax.transform.FastMathTransform()(mod)


def _short(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]
