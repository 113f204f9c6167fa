"""ONNX ops that TVM's importer lacks, rewritten into ops it has, before the import.

Recurrent layers (LSTM, GRU, RNN: OCR recognisers, speech and time-series models) are unrolled
over their sequence, whose length is static once the inputs' shapes are bound; Celu and
LpNormalization become their formulas. So do the onnxruntime contrib ops that its transformer
optimizer and its saved, graph-optimized models write and that TVM's importer lacks
(:data:`CONTRIB`: FusedMatMul, QuickGelu, the RMS norms of LLaMA-style models, and
MultiHeadAttention over separate query, key and value). Those TVM imports itself (Gelu,
BiasGelu, FastGelu, SkipLayerNormalization) are rewritten too: ONNX's shape inference, and so
the graph simplifier that folds an export's shape arithmetic, stops at any contrib op (a
DistilBERT as onnxruntime saves its optimized graph kept 21 run-time Shape ops that TVM could not
import), and TVM's SkipLayerNormalization requires a beta and a bias (CLIP's has neither). The rewrite uses only ops whose signature no opset
changed (MatMul, Reshape, Concat, Transpose, element-wise ops), and Split and Squeeze in the
form of the model's own opset. onnxruntime still runs the original graph: it stays the reference each
compiled model is checked against, so a wrong rewrite cannot pass unnoticed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import DynamicShapeError, UnsupportedOpError
from .partition import reads

# what this module rewrites, and the gates per recurrent op (in ONNX's weight order)
RECURRENT_GATES = {"LSTM": "iofc", "GRU": "zrh", "RNN": "i"}
REWRITTEN = (*RECURRENT_GATES, "Celu", "LpNormalization")
# onnxruntime's contrib ops rewritten (its com.microsoft domain; SimplifiedLayerNormalization is
# registered in the ONNX domain as well)
CONTRIB = ("FusedMatMul", "QuickGelu", "SimplifiedLayerNormalization",
           "SkipSimplifiedLayerNormalization", "MultiHeadAttention", "Gelu", "BiasGelu", "FastGelu",
           "SkipLayerNormalization")
MS_DOMAIN = "com.microsoft"
# of those, the ones TVM's importer has a converter for
TVM_IMPORTS = ("Gelu", "BiasGelu", "FastGelu", "SkipLayerNormalization")
# the default activations per recurrent op (f, g, h)
_DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}
# activations with an alpha / a beta, and ONNX's defaults for them
_ALPHA = {"LeakyRelu": 0.01, "ThresholdedRelu": 1.0, "HardSigmoid": 0.2, "Elu": 1.0, "Affine": 1.0,
          "ScaledTanh": 1.0}
_BETA = {"HardSigmoid": 0.5, "Affine": 0.0, "ScaledTanh": 1.0}
_PLAIN = ("Sigmoid", "Tanh", "Relu", "Softsign", "Softplus")


def rewrite_unsupported(model: onnx.ModelProto, path: str = "") -> tuple[onnx.ModelProto, list[str]]:
    """``model`` with each node of :data:`REWRITTEN` and :data:`CONTRIB` in its main graph
    rewritten, and the op types rewritten (none: ``model`` itself comes back). ``model``'s
    input shapes must be bound (:func:`ttrank.frontend.bind_input_shapes`): unrolling needs the
    sequence length. ONNX's shape inference stops at a contrib op, so a node whose input shape
    is unknown waits for a pass after the ones before it are rewritten."""
    done: set[str] = set()
    while True:
        model, did, waiting = _rewrite_pass(model, path)
        done |= did
        if not waiting:
            return model, sorted(done)
        if not did:  # no pass can tell it more
            raise waiting[0]


class _ShapeUnknown(DynamicShapeError):
    """A rewrite needs a shape that shape inference did not reach."""


def _rewrite_pass(model: onnx.ModelProto, path: str
                  ) -> tuple[onnx.ModelProto, set[str], list[_ShapeUnknown]]:
    nodes = list(model.graph.node)
    if not any(rewritable(n) for n in nodes):
        return model, set(), []
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = _Graph(out, path)
    new_nodes: list[onnx.NodeProto] = []
    done: set[str] = set()
    waiting: list[_ShapeUnknown] = []
    for n in nodes:
        if rewritable(n):
            g.nodes = []
            try:
                _REWRITES[n.op_type](g, n)
            except _ShapeUnknown as e:
                waiting.append(e)
                new_nodes.append(n)
                continue
            except UnsupportedOpError:
                if n.op_type not in TVM_IMPORTS:
                    raise
                new_nodes.append(n)  # a form not rewritten: TVM's importer may take it
                continue
            new_nodes.extend(g.nodes)
            done.add(n.op_type)
        else:
            new_nodes.append(n)
    del out.graph.node[:]
    out.graph.node.extend(new_nodes)
    # the rewritten nodes' weights now live transposed and split in new constants; what a
    # subgraph (an If's branch) reads, or the graph lists as an input, stays
    used = ({i for n in new_nodes for i in reads(n)} | {o.name for o in out.graph.output}
            | {v.name for v in out.graph.input})
    keep = [i for i in out.graph.initializer if i.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    return out, done, waiting


def rewritable(node: onnx.NodeProto) -> bool:
    """Whether :func:`rewrite_unsupported` rewrites ``node``."""
    if node.domain in ("", "ai.onnx"):
        return node.op_type in REWRITTEN or node.op_type == "SimplifiedLayerNormalization"
    return node.domain == MS_DOMAIN and node.op_type in CONTRIB


class _Graph:
    """Appends nodes and constants to a graph with fresh names; knows static shapes and
    constant values."""

    def __init__(self, model: onnx.ModelProto, path: str) -> None:
        self.model, self.path = model, path
        self.nodes: list[onnx.NodeProto] = []
        self._n = 0
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        taken = {i.name for i in model.graph.initializer} | {v.name for v in model.graph.input}
        taken |= {o for n in model.graph.node for o in n.output} | {n.name for n in model.graph.node}
        self._taken = taken
        self.consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        for n in model.graph.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                self.consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
        try:
            # data_prop: shapes computed by Shape/Gather/Concat (as exporters write them) too
            inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        except Exception:  # noqa: BLE001 - a graph shape inference cannot follow: no static shapes
            inferred = model
        self.shapes: dict[str, list[int | None]] = {}
        for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
            if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
                self.shapes[v.name] = [d.dim_value if d.HasField("dim_value") else None
                                       for d in v.type.tensor_type.shape.dim]
        for name, value in self.consts.items():  # weights: inference lists only values it computed
            self.shapes.setdefault(name, list(value.shape))

    def fresh(self, hint: str) -> str:
        while True:
            self._n += 1
            name = f"{hint}__ttrank{self._n}"
            if name not in self._taken:
                self._taken.add(name)
                return name

    def const(self, hint: str, value: np.ndarray) -> str:
        name = self.fresh(hint)
        self.model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], hint: str, out: str | None = None, **attrs) -> str:
        out = out or self.fresh(hint)
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.fresh(hint), **attrs))
        return out

    def split(self, x: str, n: int, hint: str, axis: int = 0, squeeze: bool = True) -> list[str]:
        """``x`` cut into ``n`` equal parts along ``axis`` (``squeeze``: that axis, of length
        ``n``, dropped): one Split, in the form of the model's opset. (A Gather or Slice per
        step would each be a program of its own, its offset differing: every one measured.)"""
        parts = [x] if n == 1 else [self.fresh(hint) for _ in range(n)]
        if n > 1:  # before opset 18 no sizes mean equal parts; from 18 num_outputs says so
            extra = {"num_outputs": n} if self.opset >= 18 else {}
            self.nodes.append(helper.make_node("Split", [x], parts, name=self.fresh(hint), axis=axis, **extra))
        if not squeeze:
            return parts
        if self.opset < 13:
            return [self.op("Squeeze", [p], hint, axes=[axis]) for p in parts]
        axes = self.const("axis", np.array([axis], np.int64))
        return [self.op("Squeeze", [p, axes], hint) for p in parts]

    def gates(self, x: str, n: int, size: int, hint: str) -> list[str]:
        """``x``'s last axis cut into ``n`` parts of ``size``: constant Slices, which TVM fuses into
        the gate arithmetic that reads them (a Split is a kernel of its own), the same program at
        every step."""
        out = []
        for i in range(n):
            if self.opset < 10:  # bounds were attributes then
                out.append(self.op("Slice", [x], hint, starts=[i * size], ends=[(i + 1) * size], axes=[-1]))
            else:
                out.append(self.op("Slice", [x, self.const("start", np.array([i * size], np.int64)),
                                             self.const("end", np.array([(i + 1) * size], np.int64)),
                                             self.const("axis", np.array([-1], np.int64))], hint))
        return out

    def const_input(self, node: onnx.NodeProto, i: int, what: str) -> np.ndarray | None:
        """Input ``i`` of ``node`` as a constant, None when absent; not constant: refused."""
        name = node.input[i] if i < len(node.input) else ""
        if not name:
            return None
        if name not in self.consts:
            raise UnsupportedOpError(f"{self.path}: {node.op_type} {node.name!r}: its {what} is computed at "
                                     "run time; ttrank rewrites recurrent layers whose weights are constants")
        return self.consts[name]


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _activation(g: _Graph, name: str, alpha: float | None, beta: float | None) -> Callable[[str], str]:
    """An RNN activation by its ONNX name, as a function appending its nodes."""
    name = name.decode() if isinstance(name, bytes) else name
    key = {k.lower(): k for k in (*_PLAIN, *_ALPHA)}.get(name.lower())
    if key is None:
        raise UnsupportedOpError(f"{g.path}: recurrent activation {name!r} is not supported")
    a = _ALPHA.get(key) if alpha is None else alpha
    b = _BETA.get(key) if beta is None else beta
    if key in _PLAIN:
        return lambda x: g.op(key, [x], key.lower())
    if key in ("LeakyRelu", "ThresholdedRelu", "Elu"):
        return lambda x: g.op(key, [x], key.lower(), alpha=float(a))
    if key == "HardSigmoid":
        return lambda x: g.op(key, [x], "hardsigmoid", alpha=float(a), beta=float(b))
    if key == "Affine":
        return lambda x: g.op("Add", [g.op("Mul", [x, g.const("alpha", np.float32(a))], "affine"),
                                      g.const("beta", np.float32(b))], "affine")
    # ScaledTanh: alpha * tanh(beta * x)
    return lambda x: g.op("Mul", [g.op("Tanh", [g.op("Mul", [x, g.const("beta", np.float32(b))], "stanh")],
                                       "stanh"), g.const("alpha", np.float32(a))], "stanh")


def _activation_specs(g: _Graph, node: onnx.NodeProto, at: dict, directions: int) -> list[list[tuple]]:
    """Per direction, the op's activations (f, g, h) as (name, alpha, beta), alphas and betas
    consumed in order by the activations that take one."""
    per = len(_DEFAULT_ACTIVATIONS[node.op_type])
    names = list(at.get("activations") or _DEFAULT_ACTIVATIONS[node.op_type] * directions)
    if len(names) == per and directions == 2:
        names = names * 2
    if len(names) != per * directions:
        raise UnsupportedOpError(f"{g.path}: {node.op_type} {node.name!r}: {len(names)} activations "
                                 f"for {directions} direction(s)")
    alphas, betas = list(at.get("activation_alpha") or []), list(at.get("activation_beta") or [])
    specs = []
    for nm in names:
        s = nm.decode() if isinstance(nm, bytes) else nm
        takes_a = s.lower() in {k.lower() for k in _ALPHA}
        takes_b = s.lower() in {k.lower() for k in _BETA}
        a = alphas.pop(0) if takes_a and alphas else None
        b = betas.pop(0) if takes_b and betas else None
        specs.append((s, a, b))
    return [specs[d * per:(d + 1) * per] for d in range(directions)]


def _recurrent(g: _Graph, node: onnx.NodeProto) -> None:
    """LSTM, GRU or RNN, unrolled: the input projections of all steps and gates in one MatMul,
    then per step one recurrent MatMul for all gates and the gate arithmetic of the ONNX spec.

    The two directions of a bidirectional layer step together when their activations are the
    same (as every exporter writes them): step s is the forward direction's step s and the
    reverse one's step T-1-s, as one MatMul batched over the directions and one set of gate
    kernels: half the per-step launches of one-row products, which cannot use the cores (a
    CRNN's recurrent products: 128 x 15 us cold-cache kernel time, then 62 x 16 us)."""
    kind, gates = node.op_type, RECURRENT_GATES[node.op_type]
    at = _attrs(node)
    direction = at.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    dirs = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}.get(direction)
    if dirs is None:
        raise UnsupportedOpError(f"{g.path}: {kind} {node.name!r}: unknown direction {direction!r}")
    layout = int(at.get("layout", 0))
    clip = at.get("clip")
    W = g.const_input(node, 1, "input weight W")
    R = g.const_input(node, 2, "recurrent weight R")
    B = g.const_input(node, 3, "bias B")
    P = g.const_input(node, 7, "peephole weight P") if kind == "LSTM" else None
    H = int(at.get("hidden_size") or R.shape[-1])
    G = len(gates)
    x = node.input[0]
    shape = g.shapes.get(x)
    steps = shape[layout] if shape and len(shape) == 3 else None
    if not steps:
        raise DynamicShapeError(f"{g.path}: {kind} {node.name!r}: its sequence length is known only at "
                                "run time; bind the input shapes (--input-shape) to unroll it")
    lens_name = node.input[4] if len(node.input) > 4 else ""
    if lens_name:
        lens = g.consts.get(lens_name)
        if lens is None or not np.all(lens == steps):
            raise UnsupportedOpError(f"{g.path}: {kind} {node.name!r}: per-sample sequence lengths "
                                     "(sequence_lens) are not supported")
    if layout == 1:  # [batch, seq, in] -> [seq, batch, in]
        x = g.op("Transpose", [x], "x_seq_first", perm=[1, 0, 2])
    init_h = node.input[5] if len(node.input) > 5 and node.input[5] else None
    init_c = node.input[6] if kind == "LSTM" and len(node.input) > 6 and node.input[6] else None
    if init_h and layout == 1:
        init_h = g.op("Transpose", [init_h], "h0", perm=[1, 0, 2])
    if init_c and layout == 1:
        init_c = g.op("Transpose", [init_c], "c0", perm=[1, 0, 2])
    specs = _activation_specs(g, node, at, len(dirs))
    lbr = int(at.get("linear_before_reset", 0))
    sl = {gate: slice(i * H, (i + 1) * H) for i, gate in enumerate(gates)}
    # the gates whose recurrent term is h R^T: one MatMul a step for all of them (GRU's h~
    # without linear_before_reset takes (r * h) R^T, its own MatMul)
    rec = [gate for gate in gates if not (kind == "GRU" and gate == "h" and not lbr)]

    def clipped(v: str) -> str:
        if clip is None:
            return v
        lo, hi = g.const("clip_lo", np.array(-clip, W.dtype)), g.const("clip_hi", np.array(clip, W.dtype))
        return g.op("Min", [g.op("Max", [v, lo], "clip"), hi], "clip")

    def biases(d: int) -> tuple[np.ndarray, np.ndarray]:
        return ((B[d][:G * H], B[d][G * H:]) if B is not None
                else (np.zeros(G * H, W.dtype), np.zeros(G * H, W.dtype)))

    def projection(d: int) -> str:
        """Every gate's input projection for every step of direction ``d`` in one MatMul:
        [seq, batch, G*H]. GRU's recurrent bias of h~ goes inside r * (...) when
        linear_before_reset, so not here."""
        wb, rb = biases(d)
        bias = wb + rb
        if kind == "GRU" and lbr:
            bias[sl["h"]] = wb[sl["h"]]
        return g.op("Add", [g.op("MatMul", [x, g.const("w", W[d].T)], "xw"),
                            g.const("b", bias.astype(W.dtype))], "xw")

    ys, last_h, last_c = [], [], []
    together = len(dirs) == 2 and specs[0] == specs[1]
    # the reverse direction's steps in time order, and back (only when the directions step together)
    backwards = g.const("backwards", np.arange(steps - 1, -1, -1, dtype=np.int64)) if together else None
    for ds in ([[0, 1]] if together else [[d] for d in range(len(dirs))]):
        n = len(ds)
        f, gg, hh = ([_activation(g, *sp) for sp in specs[ds[0]]] + [None, None])[:3]

        def stacked(hint: str, arrays: list[np.ndarray], matrix: bool = False) -> str:
            """Per-direction constants: one direction's as they are; two stacked on an axis
            that broadcasts against the steps' [1, 2, batch, K] (vectors as [2, 1, K])."""
            if n == 1:
                return g.const(hint, arrays[0])
            a = np.stack(arrays)
            return g.const(hint, a if matrix else a[:, None, :])

        if n == 1:
            # a step keeps its axis ([1, batch, G*H]): a Squeeze would be one more kernel a step
            xs = g.split(projection(ds[0]), steps, "x", squeeze=False)
            order = list(reversed(range(steps)) if dirs[ds[0]] else range(steps))
        else:
            # [seq, 2, batch, G*H]: the reverse direction's projections in its own step order
            parts = [projection(0), g.op("Gather", [projection(1), backwards], "xw_rev", axis=0)]
            both = g.op("Concat", [g.op("Reshape", [p, g.const("shape", np.array([steps, 1, -1, G * H], np.int64))],
                                        "xw") for p in parts], "xw", axis=1)
            xs, order = g.split(both, steps, "x", squeeze=False), list(range(steps))
        r_rec = stacked("r", [np.concatenate([R[d][sl[gate]] for gate in rec]).T for d in ds], matrix=True)
        r_bias = (stacked("rb", [np.concatenate([biases(d)[1][sl[gt]] if gt == "h" else np.zeros(H, W.dtype)
                                                 for gt in rec]) for d in ds])
                  if kind == "GRU" and lbr else None)
        r_h = stacked("rh", [R[d][sl["h"]].T for d in ds], matrix=True) if kind == "GRU" and not lbr else None
        def initial(v: str | None) -> str | None:
            if v is None:
                return None
            if n == 1:
                return g.split(v, len(dirs), "h0", squeeze=False)[ds[0]]
            return g.op("Reshape", [v, g.const("shape", np.array([1, n, -1, H], np.int64))], "h0")

        h, c = initial(init_h), initial(init_c)
        # peepholes, in P's order i, o, f
        peeps = ({k: stacked(f"p{k}", [P[d][i * H:(i + 1) * H] for d in ds]) for i, k in enumerate("iof")}
                 if P is not None else {})
        outs = {}
        for t in order:
            xt = dict(zip(gates, g.gates(xs[t], G, H, "xg")))
            if h is not None:
                hr = g.op("MatMul", [h, r_rec], "hr")
                if r_bias is not None:
                    hr = g.op("Add", [hr, r_bias], "hr")
                ht = dict(zip(rec, g.gates(hr, len(rec), H, "hg")))

            def pre(gate: str, extra: str | None = None) -> str:
                """x_t W^T + h_{t-1} R^T (+ extra) for one gate; no recurrent term at h = 0."""
                v = xt[gate] if h is None else g.op("Add", [xt[gate], ht[gate]], "pre")
                return v if extra is None else g.op("Add", [v, extra], "pre")

            if kind == "LSTM":
                def peep(gate: str, cell: str | None) -> str | None:
                    return g.op("Mul", [peeps[gate], cell], "peep") if peeps and cell is not None else None

                i_t = f(clipped(pre("i", peep("i", c))))
                if int(at.get("input_forget", 0)):
                    f_t = g.op("Sub", [g.const("one", np.ones((), W.dtype)), i_t], "f")
                else:
                    f_t = f(clipped(pre("f", peep("f", c))))
                c_new = g.op("Mul", [i_t, gg(clipped(pre("c")))], "ic")
                if c is not None:
                    c_new = g.op("Add", [g.op("Mul", [f_t, c], "fc"), c_new], "c")
                o_t = f(clipped(pre("o", peep("o", c_new))))
                h, c = g.op("Mul", [o_t, hh(c_new)], "h"), c_new
            elif kind == "GRU":
                z_t, r_t = f(clipped(pre("z"))), f(clipped(pre("r")))
                if lbr:  # h~ = g(x Wh^T + Wbh + r * (h Rh^T + Rbh))
                    rec_h = ht["h"] if h is not None else stacked("rbh", [biases(d)[1][sl["h"]] for d in ds])
                    cand = g.op("Add", [xt["h"], g.op("Mul", [r_t, rec_h], "rh")], "pre")
                elif h is None:  # (r * 0) Rh^T vanishes
                    cand = xt["h"]
                else:  # h~ = g(x Wh^T + (r * h) Rh^T + Wbh + Rbh)
                    cand = g.op("Add", [xt["h"], g.op("MatMul", [g.op("Mul", [r_t, h], "rh"), r_h], "hr")], "pre")
                h_new = gg(clipped(cand))
                # (1 - z) * h~ + z * h, as h~ + z * (h - h~); with h = 0, h~ - z * h~
                if h is None:
                    h = g.op("Sub", [h_new, g.op("Mul", [z_t, h_new], "zh")], "h")
                else:
                    h = g.op("Add", [h_new, g.op("Mul", [z_t, g.op("Sub", [h, h_new], "d")], "zd")], "h")
            else:
                h = f(clipped(pre("i")))
            outs[t] = h
        if n == 1:
            step_shape = g.const("shape", np.array([1, 1, -1, H], np.int64))
            ys.append(g.op("Concat", [g.op("Reshape", [outs[t], step_shape], "y_t") for t in range(steps)],
                           "y", axis=0))
        else:  # [seq, 2, batch, H] in step order; the reverse direction's back in time order
            y = g.op("Concat", [outs[t] for t in range(steps)], "y", axis=0)
            fwd, rev = g.split(y, 2, "y", axis=1, squeeze=False)
            ys += [fwd, g.op("Gather", [rev, backwards], "y_rev", axis=0)]
        last_h.append(g.op("Reshape", [h, g.const("shape", np.array([n, -1, H], np.int64))], "h_last"))
        if kind == "LSTM":
            last_c.append(g.op("Reshape", [c, g.const("shape", np.array([n, -1, H], np.int64))], "c_last"))
    outputs = list(node.output) + [""] * 3

    def emit(parts: list[str], axis: int, perm: list[int] | None, name: str) -> None:
        if not name:
            return
        whole = parts[0] if len(parts) == 1 else g.op("Concat", parts, "dirs", axis=axis)
        if perm is not None:
            g.op("Transpose", [whole], "out", out=name, perm=perm)
        else:
            g.op("Identity", [whole], "out", out=name)

    emit(ys, 1, [2, 0, 1, 3] if layout == 1 else None, outputs[0])
    emit(last_h, 0, [1, 0, 2] if layout == 1 else None, outputs[1])
    if kind == "LSTM":
        emit(last_c, 0, [1, 0, 2] if layout == 1 else None, outputs[2])


def _celu(g: _Graph, node: onnx.NodeProto) -> None:
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
    a = float(_attrs(node).get("alpha", 1.0))
    x, zero = node.input[0], g.const("zero", np.float32(0))
    neg = g.op("Mul", [g.op("Sub", [g.op("Exp", [g.op("Div", [x, g.const("alpha", np.float32(a))], "celu")],
                                         "celu"), g.const("one", np.float32(1))], "celu"),
                       g.const("alpha", np.float32(a))], "celu")
    g.op("Add", [g.op("Max", [x, zero], "celu"), g.op("Min", [neg, zero], "celu")], "celu", out=node.output[0])


def _lp_normalization(g: _Graph, node: onnx.NodeProto) -> None:
    """x / ||x||_p along ``axis`` (p 1 or 2), the norm kept as a broadcastable axis."""
    at = _attrs(node)
    axis, p = int(at.get("axis", -1)), int(at.get("p", 2))
    if p not in (1, 2):
        raise UnsupportedOpError(f"{g.path}: LpNormalization {node.name!r}: p={p} (ONNX allows 1 and 2)")
    x = node.input[0]
    shape = g.shapes.get(x)
    if not shape:
        raise UnsupportedOpError(f"{g.path}: LpNormalization {node.name!r}: the input's rank is unknown")
    axis %= len(shape)
    # a MatMul by a ones column sums over the last axis in any opset (ReduceSum's axes moved)
    perm = [i for i in range(len(shape)) if i != axis] + [axis]
    back = list(np.argsort(perm))
    xt = g.op("Transpose", [x], "lpn", perm=perm) if axis != len(shape) - 1 else x
    mag = g.op("Abs", [xt], "lpn") if p == 1 else g.op("Mul", [xt, xt], "lpn")
    n = shape[axis]
    if not n:
        raise UnsupportedOpError(f"{g.path}: LpNormalization {node.name!r}: the normalised axis is dynamic")
    norm = g.op("MatMul", [mag, g.const("ones", np.ones((n, 1), np.float32))], "lpn")
    if p == 2:
        norm = g.op("Sqrt", [norm], "lpn")
    y = g.op("Div", [xt, norm], "lpn")
    if axis != len(shape) - 1:
        g.op("Transpose", [y], "lpn", out=node.output[0], perm=[int(i) for i in back])
    else:
        g.op("Identity", [y], "lpn", out=node.output[0])


def _rank(g: _Graph, node: onnx.NodeProto, name: str, what: str) -> list[int | None]:
    shape = g.shapes.get(name)
    if shape is None:
        raise _ShapeUnknown(f"{g.path}: {node.op_type} {node.name!r}: the {what}'s shape is unknown")
    return shape


def _fused_matmul(g: _Graph, node: onnx.NodeProto) -> None:
    """alpha * op(A) @ op(B), op transposing the last two axes when transA / transB is set."""
    at = _attrs(node)
    if at.get("transBatchA") or at.get("transBatchB"):
        raise UnsupportedOpError(f"{g.path}: FusedMatMul {node.name!r}: transBatchA/transBatchB are not supported")
    a, b = node.input[0], node.input[1]
    for flag, name, what in (("transA", a, "first input"), ("transB", b, "second input")):
        if at.get(flag) and (r := len(_rank(g, node, name, what))) >= 2:  # a vector has nothing to swap
            t = g.op("Transpose", [name], "fmm", perm=[*range(r - 2), r - 1, r - 2])
            a, b = (t, b) if flag == "transA" else (a, t)
    alpha = float(at.get("alpha", 1.0))
    if alpha == 1.0:
        g.op("MatMul", [a, b], "fmm", out=node.output[0])
    else:
        g.op("Mul", [g.op("MatMul", [a, b], "fmm"), g.const("alpha", np.float32(alpha))], "fmm", out=node.output[0])


def _quick_gelu(g: _Graph, node: onnx.NodeProto) -> None:
    """x * sigmoid(alpha * x) (CLIP's activation)."""
    x, alpha = node.input[0], float(_attrs(node).get("alpha", 1.702))
    gate = g.op("Sigmoid", [g.op("Mul", [x, g.const("alpha", np.float32(alpha))], "qgelu")], "qgelu")
    g.op("Mul", [x, gate], "qgelu", out=node.output[0])


def _gelu(g: _Graph, x: str, hint: str, out: str | None = None) -> str:
    """0.5 x (1 + erf(x / sqrt(2)))."""
    half = g.op("Mul", [x, g.const("half", np.float32(0.5))], hint)
    e = g.op("Erf", [g.op("Mul", [x, g.const("rsqrt2", np.float32(1 / np.sqrt(2)))], hint)], hint)
    return g.op("Mul", [half, g.op("Add", [e, g.const("one", np.float32(1))], hint)], hint, out=out)


def _contrib_gelu(g: _Graph, node: onnx.NodeProto) -> None:
    """Gelu(x), BiasGelu(x, bias) = Gelu(x + bias)."""
    x = node.input[0]
    if len(node.input) > 1 and node.input[1]:
        x = g.op("Add", [x, node.input[1]], "gelu")
    _gelu(g, x, "gelu", out=node.output[0])


def _fast_gelu(g: _Graph, node: onnx.NodeProto) -> None:
    """The tanh approximation, of x (+ bias): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    x = node.input[0]
    if len(node.input) > 1 and node.input[1]:
        x = g.op("Add", [x, node.input[1]], "fgelu")
    cube = g.op("Mul", [g.op("Mul", [x, x], "fgelu"), x], "fgelu")
    inner = g.op("Add", [x, g.op("Mul", [cube, g.const("c", np.float32(0.044715))], "fgelu")], "fgelu")
    t = g.op("Tanh", [g.op("Mul", [inner, g.const("k", np.float32(np.sqrt(2 / np.pi)))], "fgelu")], "fgelu")
    half = g.op("Mul", [x, g.const("half", np.float32(0.5))], "fgelu")
    g.op("Mul", [half, g.op("Add", [t, g.const("one", np.float32(1))], "fgelu")], "fgelu", out=node.output[0])


def _mean_last(g: _Graph, x: str, axes: list[int], hint: str, node: onnx.NodeProto | None = None) -> str:
    if g.opset < 11 and node is not None and min(axes) < 0:  # negative axes came with opset 11
        r = len(_rank(g, node, node.input[0], "input"))
        axes = [a % r for a in axes]
    if g.opset >= 18:
        return g.op("ReduceMean", [x, g.const("axes", np.array(axes, np.int64))], hint, keepdims=1)
    return g.op("ReduceMean", [x], hint, axes=axes, keepdims=1)


def _skip_layer_norm(g: _Graph, node: onnx.NodeProto) -> None:
    """s = input + skip (+ bias); output LayerNorm(s) * gamma (+ beta), s as the fourth output."""
    _only_first_output(g, node, keep=(0, 3))
    ins = [*node.input, *[""] * (5 - len(node.input))]
    eps = float(_attrs(node).get("epsilon", 1e-12))
    s = g.op("Add", [ins[0], ins[1]], "skipln")
    if ins[4]:
        s = g.op("Add", [s, ins[4]], "skipln")
    if g.opset >= 17:
        y = g.op("LayerNormalization", [s, ins[2], *([ins[3]] if ins[3] else [])], "skipln", axis=-1, epsilon=eps)
    else:
        centred = g.op("Sub", [s, _mean_last(g, s, [-1], "skipln", node)], "skipln")
        var = _mean_last(g, g.op("Mul", [centred, centred], "skipln"), [-1], "skipln", node)
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [var, g.const("eps", np.float32(eps))], "skipln")],
                                       "skipln")], "skipln")
        y = g.op("Mul", [g.op("Mul", [centred, inv], "skipln"), ins[2]], "skipln")
        if ins[3]:
            y = g.op("Add", [y, ins[3]], "skipln")
    g.op("Identity", [y], "skipln", out=node.output[0])
    if len(node.output) > 3 and node.output[3]:
        g.op("Identity", [s], "skipln", out=node.output[3])


def _rms(g: _Graph, node: onnx.NodeProto, x: str, axis: int, eps: float, scale: str) -> str:
    """x / sqrt(mean(x^2 over the axes from ``axis`` on) + eps) * scale (a non-negative ``axis``
    of the rank of ``node``'s first input)."""
    axes = (list(range(axis, 0)) if axis < 0
            else list(range(axis, len(_rank(g, node, node.input[0], "input")))))
    mean = _mean_last(g, g.op("Mul", [x, x], "rms"), axes, "rms", node)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [mean, g.const("eps", np.float32(eps))], "rms")], "rms")],
               "rms")
    return g.op("Mul", [g.op("Mul", [x, inv], "rms"), scale], "rms")


def _only_first_output(g: _Graph, node: onnx.NodeProto, keep: tuple[int, ...] = (0,)) -> None:
    used = {i for n in g.model.graph.node for i in n.input} | {o.name for o in g.model.graph.output}
    extra = [o for i, o in enumerate(node.output) if o and i not in keep and o in used]
    if extra:
        raise UnsupportedOpError(f"{g.path}: {node.op_type} {node.name!r}: its output {extra[0]!r} "
                                 "(statistics or caches) is used, which ttrank does not rewrite")


def _simplified_layer_norm(g: _Graph, node: onnx.NodeProto) -> None:
    """RMSNorm: x / sqrt(mean(x^2) + epsilon) * scale, over the axes from ``axis`` on."""
    at = _attrs(node)
    _only_first_output(g, node)
    y = _rms(g, node, node.input[0], int(at.get("axis", -1)), float(at.get("epsilon", 1e-5)), node.input[1])
    g.op("Identity", [y], "rms", out=node.output[0])


def _skip_simplified_layer_norm(g: _Graph, node: onnx.NodeProto) -> None:
    """s = input + skip (+ bias); output RMSNorm(s) * gamma, and s as the fourth output."""
    at = _attrs(node)
    _only_first_output(g, node, keep=(0, 3))
    s = g.op("Add", [node.input[0], node.input[1]], "skiprms")
    if len(node.input) > 3 and node.input[3]:
        s = g.op("Add", [s, node.input[3]], "skiprms")
    y = _rms(g, node, s, -1, float(at.get("epsilon", 1e-12)), node.input[2])  # onnxruntime's default
    g.op("Identity", [y], "skiprms", out=node.output[0])
    if len(node.output) > 3 and node.output[3]:
        g.op("Identity", [s], "skiprms", out=node.output[3])


def _multi_head_attention(g: _Graph, node: onnx.NodeProto) -> None:
    """softmax(Q K^T * scale + attention_bias [+ causal mask]) V per head, over separate 3-D
    query [B, S, D], key [B, L, D] and value [B, L, Dv], with an optional packed bias [D + D + Dv].
    Packed QKV, key padding masks and past key/value caches are refused in one line."""
    at = _attrs(node)
    heads = int(at["num_heads"])
    ins = [*node.input, *[""] * (8 - len(node.input))]
    q, k, v, bias, key_mask, attn_bias = ins[:6]
    if not k or not v or any(ins[6:]) or key_mask:
        raise UnsupportedOpError(f"{g.path}: MultiHeadAttention {node.name!r}: only separate query, key and value "
                                 "without a key padding mask or past key/value are supported")
    _only_first_output(g, node)
    shapes = [_rank(g, node, x, what) for x, what in ((q, "query"), (k, "key"), (v, "value"))]
    if any(len(sh) != 3 for sh in shapes):
        raise UnsupportedOpError(f"{g.path}: MultiHeadAttention {node.name!r}: only 3-D query, key and value "
                                 "are supported (not packed ones)")
    if any(None in sh for sh in shapes):
        raise _ShapeUnknown(f"{g.path}: MultiHeadAttention {node.name!r}: needs the static shapes of query, key "
                            "and value (bind the inputs with --input-shape)")
    (b, s, d), (_, l, _), (_, _, dv) = shapes
    if bias:
        parts = g.gates(bias, 3, d, "mha") if dv == d else None
        if parts is None:
            raise UnsupportedOpError(f"{g.path}: MultiHeadAttention {node.name!r}: a bias with Dv != D")
        q, k, v = (g.op("Add", [x, p], "mha") for x, p in zip((q, k, v), parts))
    hd, hdv = d // heads, dv // heads
    scale = float(at.get("scale", 0.0)) or 1.0 / float(np.sqrt(hd))

    def heads_first(x: str, n: int, size: int) -> str:  # [B, n, H*size] -> [B, H, n, size]
        r = g.op("Reshape", [x, g.const("shape", np.array([b, n, heads, size], np.int64))], "mha")
        return g.op("Transpose", [r], "mha", perm=[0, 2, 1, 3])

    qh, vh = heads_first(q, s, hd), heads_first(v, l, hdv)
    kt = g.op("Transpose", [g.op("Reshape", [k, g.const("shape", np.array([b, l, heads, hd], np.int64))], "mha")],
              "mha", perm=[0, 2, 3, 1])
    scores = g.op("Mul", [g.op("MatMul", [qh, kt], "mha"), g.const("scale", np.float32(scale))], "mha")
    if attn_bias:
        scores = g.op("Add", [scores, attn_bias], "mha")
    if int(at.get("unidirectional", 0)):
        causal = np.triu(np.full((s, l), np.finfo(np.float32).min, np.float32), k=1 + l - s)
        scores = g.op("Add", [scores, g.const("causal", causal)], "mha")
    probs = g.op("Softmax", [scores], "mha", axis=-1)  # the last axis in every opset
    ctx = g.op("Transpose", [g.op("MatMul", [probs, vh], "mha")], "mha", perm=[0, 2, 1, 3])
    g.op("Reshape", [ctx, g.const("shape", np.array([b, s, dv], np.int64))], "mha", out=node.output[0])


_REWRITES: dict[str, Callable[[_Graph, onnx.NodeProto], None]] = {
    "LSTM": _recurrent, "GRU": _recurrent, "RNN": _recurrent, "Celu": _celu, "LpNormalization": _lp_normalization,
    "FusedMatMul": _fused_matmul, "QuickGelu": _quick_gelu,
    "SimplifiedLayerNormalization": _simplified_layer_norm,
    "SkipSimplifiedLayerNormalization": _skip_simplified_layer_norm, "MultiHeadAttention": _multi_head_attention,
    "Gelu": _contrib_gelu, "BiasGelu": _contrib_gelu, "FastGelu": _fast_gelu, "SkipLayerNormalization": _skip_layer_norm}
