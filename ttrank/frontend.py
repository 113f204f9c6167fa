"""ONNX loading: bind dynamic dims, simplify when the importer needs it, import into Relax."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import psutil

from .decompose import rewrite_unsupported
from .errors import (DynamicShapeError, ImporterError, ModelLoadError, TooLargeError,
                     UnsafeModelError, UnsupportedOpError)
from .graphopt import clean_up, static_dims
from .layouts import LAYOUTS, apply_layout
from .opsets import modernize
from .partition import DATA_DEPENDENT, Tail, split_tail
from .precision import widen_half
from .util import to_native_log

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
    # its leading dim was dynamic (an exporter's batch axis) and nothing bound it: bound to 1
    batch_defaulted: bool = False


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
    # why the graph was simplified before import (what TVM's importer said of it as exported)
    simplified_because: str = ""
    # the convolutions' activation layout (ttrank.layouts.LAYOUTS); the interface stays NCHW
    layout: str = "nchw"
    # the end of the graph that runs in onnxruntime after ``mod`` (ttrank.partition): a
    # detector's post-processing, whose shapes follow the data
    tail: Tail | None = None
    # its kernels per target (ttrank.kernels.model_kernels): choosing a layout and recommend
    # both need them, and extraction costs seconds on a large network
    kernel_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        return Path(self.path).stem

    def in_layout(self, layout: str, target=None) -> LoadedModel:
        """This model with its convs in ``layout`` (see :func:`load`), from its NCHW import: no
        second import. A graph the layout pass cannot rewrite is one :class:`ModelLoadError`."""
        if layout == self.layout:
            return self
        if layout not in LAYOUTS:
            raise ModelLoadError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
        if self.layout != "nchw":
            raise ModelLoadError(f"{self.path} is loaded in the {self.layout} layout; "
                                 "another layout starts from its NCHW import")
        try:
            mod = apply_layout(self.mod, layout, target)
        except Exception as e:  # noqa: BLE001 - a graph the layout pass cannot rewrite is this model's
            raise ModelLoadError(f"{self.path}: cannot put its convolutions in the {layout} layout "
                                 f"({_short(e)}); --layout nchw keeps them as exported") from None
        return dataclasses.replace(self, mod=mod, layout=layout, kernel_cache={})

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
    """Read and validate an ONNX file; every failure becomes one clear ModelLoadError.

    External data is read only from regular files inside the model's own folder, and only
    after every tensor's declared size has been checked (:func:`check_sizes`).
    """
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a directory, not an ONNX file")
    if not path.is_file():  # a FIFO or device would block or never end
        raise ModelLoadError(f"{path}: not a regular file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError and friends
        raise ModelLoadError(f"{path}: not a valid ONNX file ({type(e).__name__}: "
                             f"{_first_line(e)})") from None
    if not model.graph.node:
        raise ModelLoadError(f"{path}: not a valid ONNX file (no graph nodes; truncated or not ONNX?)")
    external = check_external_data(model, path)
    _check_declared(path, "tensor", [(t.name, list(t.dims), t.data_type) for t in _tensors(model.graph)])
    if external:
        try:
            onnx.load_external_data_for_model(model, str(path.parent))
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read its external data ({type(e).__name__}: "
                                 f"{_first_line(e)})") from None
    return model


def onnx_complaint(model: onnx.ModelProto) -> str:
    """What ONNX's checker (with strict shape inference) finds wrong with the model, or "".

    Not fatal: some exporters bend the spec and TVM imports their graphs anyway. It names
    the cause when TVM fails later on a graph that is not valid ONNX.
    """
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:  # ValidationError, InferenceError, or over 2 GB (not checkable)
        return _first_line(e)
    return ""


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:300]


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor stored in a graph: initializers, constants in attributes, subgraphs."""
    yield from graph.initializer
    for sp in graph.sparse_initializer:
        yield from (sp.values, sp.indices)
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("sparse_tensor"):
                yield from (a.sparse_tensor.values, a.sparse_tensor.indices)
            for sp in a.sparse_tensors:
                yield from (sp.values, sp.indices)
            if a.HasField("g"):
                yield from _tensors(a.g)
            for g in a.graphs:
                yield from _tensors(g)


def check_external_data(model: onnx.ModelProto, path: Path) -> bool:
    """Refuse tensors whose external data lies outside the model's folder (an absolute path,
    ``..``, or a symlink leading out) or is not a regular file; True if any tensor has some.

    A model file must not make ttrank read other files: a shared model could otherwise
    copy any file the user can read into a compiled library or an error message.
    """
    folder = path.resolve().parent
    found = False
    for t in _tensors(model.graph):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        found = True
        loc = next((e.value for e in t.external_data if e.key == "location"), "")
        where = Path(loc)
        full = (folder / where).resolve()
        if not loc or where.is_absolute() or ".." in where.parts or not full.is_relative_to(folder):
            raise UnsafeModelError(f"{path}: refused: tensor {t.name!r} keeps its data at {loc!r}, "
                                   f"outside the model's folder {folder}; external data must be a "
                                   "file inside that folder")
        if not full.is_file():
            raise ModelLoadError(f"{path}: tensor {t.name!r} keeps its data in {loc!r}, which is "
                                 "missing or not a regular file")
    return found


# --------------------------------------------------------------------------------------------
# Sizes: a tensor no machine here could hold is refused before any import, compile or
# allocation (a graph may declare a 100000x100000x1000 input, or compute a 10^12-element one)


def max_tensor_bytes() -> int:
    """The largest tensor ttrank accepts: this machine's memory."""
    return int(psutil.virtual_memory().total)


def _itemsize(elem_type: int) -> int:
    try:
        return int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)
    except Exception:  # unknown or undefined type: the importer will say so; size as float32
        return 4


def _check_declared(path, what: str, tensors: list[tuple[str, list[int], int]]) -> None:
    limit = max_tensor_bytes()
    for name, dims, elem_type in tensors:
        if any(d < 0 for d in dims):
            raise ModelLoadError(f"{path}: {what} {name!r} declares a negative dim "
                                 f"({'x'.join(map(str, dims))})")
        n = math.prod(dims)  # Python ints: no overflow, however absurd the dims
        size = n * _itemsize(elem_type)
        if size > limit:
            raise TooLargeError(
                f"{path}: {what} {name!r} has shape {'x'.join(map(str, dims))} ({n:.3g} values, "
                f"{_bytes(size)}), more than this machine's memory ({_bytes(limit)}); refused "
                "before compiling or allocating anything")


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"


def check_sizes(model: onnx.ModelProto, specs: list[InputSpec], path) -> None:
    """Refuse a model whose bound inputs, or any tensor ONNX shape inference can size from
    them (outputs, intermediates such as a ConstantOfShape), exceed :func:`max_tensor_bytes`."""
    np_types = {v: k for k, v in _ONNX_TO_NUMPY.items()}
    _check_declared(path, "input", [(s.name, s.shape, np_types.get(s.dtype, 1)) for s in specs])
    try:
        with _weights_set_aside(model):
            inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False,
                                                         data_prop=True)
    except Exception as e:  # a graph inference cannot follow: the importer decides
        log.info("%s: shape inference skipped: %s", path, _first_line(e))
        return
    g = inferred.graph
    sized = []
    for v in [*g.value_info, *g.output]:
        tt = v.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            sized.append((v.name, [d.dim_value for d in tt.shape.dim], tt.elem_type))
    _check_declared(path, "tensor", sized)


@contextlib.contextmanager
def _weights_set_aside(model: onnx.ModelProto) -> Iterator[None]:
    """Large initializers without their bytes for a moment: shape inference copies the whole
    model into C++ and back (1 s for ResNet-50's 100 MB), and sizes only need the dims. Small
    ones (the int64 shapes that data propagation reads) keep theirs."""
    kept = {}
    for i, t in enumerate(model.graph.initializer):
        if len(t.raw_data) > 4096:
            kept[i] = t.raw_data
            t.ClearField("raw_data")
    try:
        yield
    finally:
        for i, data in kept.items():
            model.graph.initializer[i].raw_data = data


def _bindings(mod) -> Iterator:
    """Every binding of the module's Relax functions."""
    from tvm import relax

    for func in mod.functions.values():
        if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
            for block in func.body.blocks:
                yield from block.bindings


def check_relax_sizes(mod, path) -> None:
    """The same limit on every tensor of the imported Relax module (what inference missed)."""
    import tvm

    limit = max_tensor_bytes()
    for b in _bindings(mod):
        for sinfo in _tensor_types(b.var.ty):
            dims = [int(d) for d in sinfo.shape.values if isinstance(d, tvm.tirx.IntImm)]
            if len(dims) != sinfo.ndim:
                continue
            n = math.prod(dims)
            size = n * max(1, tvm.DataType(sinfo.dtype).bits // 8) if sinfo.dtype else n * 4
            if size > limit:
                raise TooLargeError(
                    f"{path}: the imported graph computes a {'x'.join(map(str, dims))} "
                    f"tensor ({_bytes(size)}), more than this machine's memory "
                    f"({_bytes(limit)}); refused before compiling or allocating anything")


def unknown_shapes(mod) -> list[str]:
    """The values of the module whose shape is not constant: an importer left a slice or a
    reshape it could not follow until run time, and legalization refuses those."""
    return [str(b.var.name) for b in _bindings(mod) if not _static(b.var.ty)]


def _static(ty) -> bool:
    from tvm import relax

    if isinstance(ty, relax.TensorType):
        return static_dims(ty) is not None
    if isinstance(ty, relax.TupleType):
        return all(_static(f) for f in ty.fields)
    return True


def _tensor_types(ty) -> Iterator:
    """The tensor types with a known shape inside a Relax type (tuples unpacked)."""
    from tvm import relax

    if isinstance(ty, relax.TensorType):
        if isinstance(ty.shape, relax.ShapeExpr):
            yield ty
    elif isinstance(ty, relax.TupleType):
        for f in ty.fields:
            yield from _tensor_types(f)


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def bind_input_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> list[InputSpec]:
    """Write the given shapes into the model's inputs; raise if any dim stays dynamic.

    An input whose only dynamic dim is its leading one (an exporter's batch axis, as
    ``dynamic_axes={"input": {0: "N"}}`` writes it) gets batch 1, as inference servers
    compile for; its spec says so (``batch_defaulted``)."""
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
        free = [i for i, d in enumerate(dims) if not (d.HasField("dim_value") and d.dim_value > 0)]
        defaulted = free == [0] and len(dims) > 1
        if defaulted:
            dims[0].Clear()
            dims[0].dim_value = 1
        dynamic = [dims[i].dim_param or "?" for i in free if not defaulted]
        if dynamic:
            example = ",".join(str(d.dim_value) if d.dim_value > 0 else "N" for d in dims)
            raise DynamicShapeError(
                f"input {inp.name!r} has dynamic dims ({', '.join(dynamic)}); bind them with "
                f"--input-shape {inp.name}:{example}")
        dtype = _ONNX_TO_NUMPY.get(tt.elem_type)
        if dtype is None:
            raise ModelLoadError(f"input {inp.name!r}: unsupported element type {tt.elem_type}")
        specs.append(InputSpec(inp.name, [d.dim_value for d in dims], dtype, defaulted))
    # stale inferred shapes of intermediate values would contradict the bound inputs
    del model.graph.value_info[:]
    return specs


def unsupported_ops(model: onnx.ModelProto) -> list[str]:
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = _get_convert_map()
    ops = {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")}
    # protobuf hands back bytes for a name that is not valid UTF-8 (a damaged file)
    return sorted(op if isinstance(op, str) else repr(op) for op in ops if op not in known)


# ops that compute on quantized activations (onnxruntime's QDQ and QOperator forms, dynamic
# quantization). A DequantizeLinear alone (weights stored as int8, computed in float) is not one
_QUANTIZED = frozenset({"QuantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger",
                        "QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul",
                        "DynamicQuantizeMatMul", "MatMulIntegerToFloat"})


def quantized_ops(model: onnx.ModelProto) -> list[str]:
    """The ops of ``model``'s main graph that compute on quantized activations."""
    return sorted({n.op_type for n in model.graph.node if n.op_type in _QUANTIZED})


def simplify(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fold shape arithmetic into constants (onnxslim), as Paddle2ONNX-style graphs need."""
    import onnxslim

    return onnxslim.slim(model)


def _import(model: onnx.ModelProto, specs: list[InputSpec]) -> tuple[object | None, str, str]:
    """TVM's ONNX import: (module, "", "") or (None, what failed, the ONNX op it was converting).

    What the importer prints (it prints "Error converting operator ..." on stdout before
    raising) goes to the native log: on a try that ttrank recovers from it is not the user's
    answer. A failure comes back as text only, so TVM's half-built module dies here, while
    its messages ("BlockBuilder destroyed ...") still go to the native log.
    """
    from tvm.relax.frontend.onnx import from_onnx

    shape_dict = {s.name: s.shape for s in specs}
    dtype_dict = {s.name: s.dtype for s in specs}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            return from_onnx(model, shape_dict=shape_dict, dtype_dict=dtype_dict), "", ""
    except Exception as e:  # any failure inside the importer is about this graph
        m = re.search(r"Error converting operator (\w+)", printed.getvalue())
        return None, _short(e), m.group(1) if m else ""
    finally:
        to_native_log(printed.getvalue())


def load(path: str | Path, input_shapes: dict[str, list[int]] | None = None,
         simplify_graph: str = "auto", fast_math: bool = True, layout: str = "nchw",
         target=None) -> LoadedModel:
    """Load an ONNX file into Relax.

    ``simplify_graph``: "auto" simplifies only when the plain import fails; "always"/"never".
    ``fast_math``: see :func:`with_fast_math` (the default, as onnxruntime; False keeps libm's
    exact exp/erf/tanh).
    ``layout``: the convolutions' activation layout, one of :data:`ttrank.layouts.LAYOUTS`:
    "nchw" (as imported), "nchwc" (packed x86 convs, blocks sized for ``target``'s vector
    lanes; default target: this host), "nchwc-dense" (its dense convs packed, depthwise ones
    NCHW) or "nhwc". The module's inputs and outputs stay NCHW.
    """
    if layout not in LAYOUTS:
        raise ModelLoadError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    model = read_onnx(path)
    if quantized := quantized_ops(model):
        # TVM runs them in float: on a ResNet-34 in QDQ form its outputs differed from
        # onnxruntime's integer arithmetic by 1.71 (0.8%), a dynamically quantized DistilBERT's
        # by 0.06, and the float emulation cannot be faster than onnxruntime's int8 kernels
        raise UnsupportedOpError(f"{path}: a quantized graph ({', '.join(quantized)}): ttrank compiles "
                                 "float models; give it the float model this one was quantized from")
    specs = bind_input_shapes(model, input_shapes or {})
    check_sizes(model, specs, path)
    # onnxruntime checks the compiled model against the graph as given, not against a rewrite
    reference = model
    simplified, because = False, ""
    model, modernized = modernize(model)
    model, widened = widen_half(model)
    try:
        model, rewritten = rewrite_unsupported(model, str(path))
    except DynamicShapeError as e:
        if simplify_graph == "never":
            raise
        # a sequence length that shape inference cannot follow: onnxslim folds the shape math
        model, rewritten = rewrite_unsupported(_simplify(model, path), str(path))
        simplified, because = True, str(e).split(": ", 1)[-1]
    missing = unsupported_ops(model)
    if missing and simplify_graph != "never" and not simplified:
        # exporters guard shapes with an If on a condition that is constant once the inputs are
        # bound; onnxslim folds such an If into its branch (and the rewrite runs again after it)
        try:
            model = _simplify(model, path)
        except ImporterError:
            pass
        else:
            simplified, because = True, f"{', '.join(missing)} as exported"
            model, more = rewrite_unsupported(model, str(path))
            rewritten = sorted({*rewritten, *more})
            missing = unsupported_ops(model)
    rewritten = [*modernized, *widened, *rewritten]
    tail = None
    if missing or any(n.op_type in DATA_DEPENDENT for n in model.graph.node):
        model, tail = _cut_tail(model, missing, path)
    if rewritten:
        log.info("rewritten for TVM's importer: %s", ", ".join(rewritten))
    if simplify_graph == "always" and not simplified:
        model, simplified = _simplify(model, path), True
    mod, failed, op = _import(model, specs)
    if not failed and simplify_graph == "auto" and not simplified and (dyn := unknown_shapes(mod)):
        # imported, but with run-time shapes (torch.onnx's Shape->Gather->Div channel splits
        # become dynamic slices) that no kernel can be built for: folded, they are constants
        log.info("the import left %d values without a static shape (%s); simplifying the graph",
                 len(dyn), dyn[0])
        folded = _simplify(model, path)
        got, why, _ = _import(folded, specs)
        if not why and not unknown_shapes(got):
            model, mod, simplified = folded, got, True
            because = f"TVM's importer left {len(dyn)} values without a static shape"
    # an invalid file explains a failure best: say so in the error (checked only then: it
    # costs as much as the import on a large model)
    complaint = onnx_complaint(model) if failed else ""
    also = f" (the ONNX checker says the file is not valid: {complaint})" if complaint else ""
    if failed and simplify_graph != "auto":
        raise ImporterError(f"{path}: TVM's ONNX importer failed{' on ' + op if op else ''}: "
                            f"{failed}{also}")
    if failed:
        # exporters (Paddle2ONNX, torch.onnx) compute shapes at run time; folded, they import
        because = (f"TVM's importer cannot convert {'its ' + op if op else 'it'} as exported "
                   f"({failed.split(': ', 1)[-1]})")
        log.info("plain import failed: %s; simplifying the graph and retrying", because)
        model, simplified = _simplify(model, path), True
        mod, failed, op = _import(model, specs)
        if failed:
            raise ImporterError(f"{path}: TVM's ONNX importer failed{' on ' + op if op else ''}, "
                                f"also after graph simplification: {failed}{also}")
    check_relax_sizes(mod, path)
    mod = clean_up(mod)  # batch norms folded, 2x2-stride-2 transposed convs as convs
    if fast_math:
        mod = with_fast_math(mod)
    # weights stay bound as constants: FoldConstant and the tuned kernels see real shapes
    return LoadedModel(str(path), reference if rewritten or tail else model, specs, mod, {}, simplified,
                       fast_math, because, tail=tail).in_layout(layout, target)


def _cut_tail(model: onnx.ModelProto, missing: list[str], path) -> tuple[onnx.ModelProto, Tail | None]:
    """``model`` up to its data-dependent end, and that end (:mod:`ttrank.partition`); an op the
    importer lacks anywhere else is one :class:`UnsupportedOpError`."""
    try:
        got = split_tail(model, missing)
    except ValueError as e:
        got, why = None, f" ({e})"
    else:
        why = ""
    if got is None:
        if missing:
            raise UnsupportedOpError(f"{path}: unsupported ONNX op(s) for TVM's importer: "
                                     + ", ".join(missing) + why)
        return model, None
    head, tail = got
    log.info("the graph from its first %s on (%d nodes) runs in onnxruntime, fed by the compiled part",
             "/".join(tail.ops), tail.nodes)
    return head, tail


def _simplify(model: onnx.ModelProto, path) -> onnx.ModelProto:
    try:
        return simplify(model)
    except Exception as e:  # onnxslim runs onnxruntime on the graph: a broken graph fails here
        raise ImporterError(f"{path}: TVM's ONNX importer cannot import the graph as exported, "
                            f"and simplifying it failed: {_short(e)}") from None


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
