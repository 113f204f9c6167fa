"""A graph whose end has data-dependent shapes, cut in two: the compiled part and a tail that
runs in onnxruntime.

Detectors export their post-processing into the graph: score thresholds (``NonZero``), per
class top-k and ``NonMaxSuppression``, and an ``If`` on whether any box is left. Their output
shapes follow the data, which a statically shaped TVM build cannot take, and TVM's importer
has no ``If``. They are a sliver of the work (on SSDlite the backbone and heads are nearly all
of it), so the graph up to them is compiled and tuned as any model, and the nodes from the
first such op on (everything that reads their results) run in onnxruntime, fed with the
compiled part's outputs. Nothing is dropped: the whole model's outputs are the tail's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import onnx
from onnx import helper

# ops whose output shapes (or whose branches) follow the data
DATA_DEPENDENT = frozenset({"NonZero", "NonMaxSuppression", "Unique", "Compress", "If", "Loop", "Scan"})
# ops worth compiling: the compiled part ends at the last of them before the tail
HEAVY = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "LSTM", "GRU", "RNN"})


@dataclass
class Tail:
    """The end of a graph, run by onnxruntime after the compiled part."""

    model: onnx.ModelProto  # its inputs: ``cut`` and the model inputs it reads
    head: onnx.ModelProto  # the compiled part as ONNX: what its outputs are checked against
    cut: list[str]  # the compiled part's outputs, in order: what the tail reads, and model outputs
    outputs: list[str]  # the whole model's outputs, in order
    ops: list[str]  # the op types that start it
    nodes: int

    @property
    def inputs(self) -> list[str]:
        return [v.name for v in self.model.graph.input]


def split_tail(model: onnx.ModelProto, stop_ops: Iterable[str] = ()) -> tuple[onnx.ModelProto, Tail] | None:
    """``model`` cut before its first node of :data:`DATA_DEPENDENT` on the inputs' data or of
    ``stop_ops`` (ops the importer lacks), and before the light nodes that only feed what
    follows: (the part to compile, its :class:`Tail`), or None when there is nothing to cut or
    no heavy op before the cut. ``model``'s input shapes must be bound: the cut's values are
    typed by shape inference (a value it cannot type is a ValueError)."""
    g = model.graph
    stop_ops = set(stop_ops)
    nodes = list(g.node)
    # values that follow the inputs' data; a Shape's does not once the input shapes are bound,
    # and an op of DATA_DEPENDENT on constants folds (YOLO exports at opset 10 build their grid
    # with NonZero on a ConstantOfShape)
    data = {v.name for v in g.input} - {t.name for t in g.initializer}
    for n in nodes:
        if n.op_type not in ("Shape", "Size") and any(i in data for i in reads(n)):
            data.update(n.output)
    late: set[str] = set()  # values the tail makes
    in_tail, why = [False] * len(nodes), set()
    for j, n in enumerate(nodes):
        stop = n.domain in ("", "ai.onnx") and (n.op_type in stop_ops or (
            n.op_type in DATA_DEPENDENT and any(i in data for i in reads(n))))
        if stop or any(i in late for i in reads(n)):
            in_tail[j] = True
            late.update(o for o in n.output if o)
            if stop:
                why.add(n.op_type)
    if not why:
        return None
    # light nodes that feed only the tail join it: the compiled part ends at its heavy ops,
    # whose float outputs are checked against onnxruntime's (a class ArgMax over near-equal
    # scores, or a threshold, flips between any two engines)
    readers: dict[str, list[int]] = {}
    for j, n in enumerate(nodes):
        for i in set(reads(n)):
            readers.setdefault(i, []).append(j)
    outputs = {v.name for v in g.output}
    for j in reversed(range(len(nodes))):
        n = nodes[j]
        if (not in_tail[j] and n.op_type not in HEAVY and not outputs.intersection(n.output)
                and all(in_tail[r] for o in n.output if o for r in readers.get(o, [])) and n.output):
            in_tail[j] = True
    head = [n for j, n in enumerate(nodes) if not in_tail[j]]
    tail = [n for j, n in enumerate(nodes) if in_tail[j]]
    if not any(n.op_type in HEAVY for n in head):
        return None
    made = {o for n in head for o in n.output if o}
    inputs = [v for v in g.input if v.name not in {t.name for t in g.initializer}]
    tail_reads = {i for n in tail for i in reads(n)}
    cut = sorted(v for v in tail_reads if v in made)
    handed = _unique([*cut, *(v.name for v in g.output if v.name in made)])  # the compiled part's outputs
    if not handed:  # the heavy ops feed nothing that is kept
        return None
    types = _value_types(model)
    if untyped := [v for v in handed if v not in types]:
        raise ValueError(f"shape inference gives no type for {untyped[0]}, where the graph is cut")

    head_model = _with(model, head, inputs, [types[v] for v in handed])
    tail_inputs = [types[v] for v in cut] + [v for v in inputs if v.name in tail_reads]
    tail_model = _with(model, tail, tail_inputs, [v for v in g.output if v.name not in made])
    return head_model, Tail(tail_model, head_model, handed, [v.name for v in g.output], sorted(why), len(tail))


def _with(model: onnx.ModelProto, nodes: list[onnx.NodeProto], inputs, outputs) -> onnx.ModelProto:
    """A model of ``model``'s opsets holding ``nodes`` and the initializers they read."""
    read = {i for n in nodes for i in reads(n)}
    graph = helper.make_graph(nodes, model.graph.name, list(inputs), list(outputs),
                              [t for t in model.graph.initializer if t.name in read])
    out = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return out


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Each value's type and shape, as shape inference gives them."""
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    return {v.name: v for v in (*g.value_info, *g.input, *g.output) if v.type.tensor_type.elem_type}


def subgraphs(n: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """A node's bodies: an If's branches, a Loop's or Scan's body."""
    for a in n.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def reads(n: onnx.NodeProto) -> Iterator[str]:
    """The values a node reads: its inputs, and those its subgraphs take from outside them."""
    yield from (i for i in n.input if i)
    for sub in subgraphs(n):
        yield from _captured(sub)


def _captured(g: onnx.GraphProto) -> Iterator[str]:
    own = {v.name for v in g.input} | {t.name for t in g.initializer}
    for n in g.node:
        for i in reads(n):
            if i not in own:
                yield i
        own.update(n.output)
    yield from (v.name for v in g.output if v.name not in own)


def _unique(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))
