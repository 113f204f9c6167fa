"""Half-precision graphs computed in single precision, with their interface kept.

A model exported in float16 (``model.half()`` before torch.onnx, onnxconverter-common's
``convert_float_to_float16``, mixed-precision exports that keep float32 inputs) imports into
Relax as float16 arithmetic end to end: each conv and matmul accumulates in float16. On a
ResNet-18 that put the outputs 0.033 away from onnxruntime's, whose CPU kernels compute those
ops in float32 and round between ops. x86 CPUs without AVX512-FP16 have no float16 arithmetic
anyway (LLVM converts each element to float32 and back), and the donors' schedules are float32
ones. So every float16 value inside the graph becomes a float32 one: weights widened once,
casts to float16 retargeted to float32, and a cast at each float16 input and output, where the
compiled model keeps the types the user gave it. onnxruntime still runs the graph as given.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .partition import subgraphs

F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
# ops whose attribute names the type of what they make
_DTYPE_ATTR = {"Cast": "to", "EyeLike": "dtype", "RandomNormal": "dtype", "RandomUniform": "dtype",
               "RandomNormalLike": "dtype", "RandomUniformLike": "dtype", "Multinomial": "dtype",
               "Bernoulli": "dtype"}
# ops whose tensor attribute is a value of the graph
_TENSOR_ATTR = {"Constant": "value", "ConstantOfShape": "value"}
# what the float32 twin of a float16 graph input or output is called inside the graph
SUFFIX = "__ttrank_f32"


def is_half(model: onnx.ModelProto) -> bool:
    """Whether the graph holds a float16 tensor anywhere: an input, output, weight or cast."""
    g = model.graph
    return (any(_elem(v) == F16 for v in (*g.input, *g.output, *g.value_info))
            or any(t.data_type == F16 for t in g.initializer)
            or any(_makes_half(n) for n in _all_nodes(g)))


def widen_half(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` computing in float32 where it computed in float16, its inputs and outputs
    keeping their float16 types, and what was changed (none: ``model`` itself comes back)."""
    if not is_half(model):
        return model, []
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    _widen_graph(g)
    head = []  # float16 inputs cast up as they enter
    for v in g.input:
        if _elem(v) == F16 and v.name not in {t.name for t in g.initializer}:
            _rename_uses(g, v.name, v.name + SUFFIX)
            head.append(helper.make_node("Cast", [v.name], [v.name + SUFFIX], to=F32,
                                         name=v.name + SUFFIX + "_in"))
    tail = []  # float16 outputs cast down as they leave
    for v in g.output:
        if _elem(v) == F16:
            inner = v.name + SUFFIX
            if any(v.name == i.name for i in g.input):  # an input passed straight through
                continue
            for n in g.node:
                n.output[:] = [inner if o == v.name else o for o in n.output]
            for t in g.initializer:  # a constant output
                if t.name == v.name:
                    t.name = inner
            _rename_uses(g, v.name, inner)
            tail.append(helper.make_node("Cast", [inner], [v.name], to=F16, name=inner + "_out"))
    nodes = [*head, *g.node, *tail]
    del g.node[:]
    g.node.extend(nodes)
    return out, ["float16 computed in float32"]


def _widen_graph(g: onnx.GraphProto) -> None:
    """Every float16 value made inside ``g`` (and its subgraphs) made in float32 instead."""
    for i, t in enumerate(g.initializer):
        if t.data_type == F16:
            g.initializer[i].CopyFrom(_widened(t))
    for v in g.value_info:
        if _elem(v) == F16:
            v.type.tensor_type.elem_type = F32
    for n in g.node:
        for a in n.attribute:
            if a.name == _DTYPE_ATTR.get(n.op_type) and a.i == F16 and n.domain in ("", "ai.onnx"):
                a.i = F32
            elif a.name == _TENSOR_ATTR.get(n.op_type) and a.t.data_type == F16:
                a.t.CopyFrom(_widened(a.t))
        for sub in subgraphs(n):
            _widen_graph(sub)
            # a body's own inputs and outputs (a Loop's, an If's) are values of the outer graph
            for v in (*sub.input, *sub.output):
                if _elem(v) == F16:
                    v.type.tensor_type.elem_type = F32


def _widened(t: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)


def _rename_uses(g: onnx.GraphProto, old: str, new: str) -> None:
    """Each node input ``old`` (subgraphs' captured ones too) reads ``new``."""
    for n in g.node:
        n.input[:] = [new if i == old else i for i in n.input]
        for sub in subgraphs(n):
            if not any(v.name == old for v in sub.input):  # a body's own input shadows it
                _rename_uses(sub, old, new)
                for v in sub.output:  # a body that returns the outer value as it is
                    if v.name == old:
                        v.name = new


def _elem(v: onnx.ValueInfoProto) -> int:
    return v.type.tensor_type.elem_type if v.type.HasField("tensor_type") else 0


def _makes_half(n: onnx.NodeProto) -> bool:
    return any((a.name == _DTYPE_ATTR.get(n.op_type) and a.i == F16)
               or (a.name == _TENSOR_ATTR.get(n.op_type) and a.t.data_type == F16)
               for a in n.attribute)


def _all_nodes(g: onnx.GraphProto):
    for n in g.node:
        yield n
        for sub in subgraphs(n):
            yield from _all_nodes(sub)
