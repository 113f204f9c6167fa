"""Ops TVM's ONNX importer lacks (LSTM, GRU, RNN, Celu, LpNormalization) are rewritten into ops it
has; the rewrite computes what onnxruntime computes, and a CRNN-style text recogniser compiles and
matches onnxruntime end to end. An If that the bound input shapes make constant folds away."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ttrank import frontend, runtime
from ttrank.decompose import rewrite_unsupported
from ttrank.errors import UnsupportedOpError

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _recurrent_model(kind: str, direction: str = "forward", steps: int = 5, batch: int = 2, inp: int = 3,
                     hidden: int = 4, initial: bool = False, peepholes: bool = False, opset: int = 17,
                     constant_weights: bool = True, **attrs) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    dirs, g = (2 if direction == "bidirectional" else 1), GATES[kind]
    arrays = {"W": rng.normal(size=(dirs, g * hidden, inp)), "R": rng.normal(size=(dirs, g * hidden, hidden)),
              "B": rng.normal(size=(dirs, 2 * g * hidden))}
    names = ["x", "W", "R", "B", "", "", "", ""]
    if initial:
        arrays["h0"], names[5] = rng.normal(size=(dirs, batch, hidden)), "h0"
        if kind == "LSTM":
            arrays["c0"], names[6] = rng.normal(size=(dirs, batch, hidden)), "c0"
    if peepholes:
        arrays["P"], names[7] = rng.normal(size=(dirs, 3 * hidden)), "P"
    while names[-1] == "":
        names.pop()
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, batch, inp])]
    inits = [numpy_helper.from_array(a.astype("float32"), n) for n, a in arrays.items()]
    if not constant_weights:  # W fed at run time
        inputs.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, list(arrays["W"].shape)))
        inits = [i for i in inits if i.name != "W"]
    outs = ["y", "y_h"] + (["y_c"] if kind == "LSTM" else [])
    node = helper.make_node(kind, names, outs, hidden_size=hidden, direction=direction, **attrs)
    graph = helper.make_graph([node], kind.lower(), inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ort(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


@pytest.mark.parametrize("kind, options", [
    ("LSTM", dict(direction="bidirectional", initial=True)),
    ("LSTM", dict(direction="reverse", peepholes=True, clip=2.0, initial=True)),
    ("LSTM", dict(activations=["HardSigmoid", "Tanh", "Softsign"], input_forget=1)),
    ("LSTM", dict(direction="bidirectional", initial=True, opset=9)),  # Slice and Squeeze by attributes
    ("GRU", dict(linear_before_reset=1, direction="bidirectional")),  # as PyTorch exports it
    ("GRU", dict(linear_before_reset=0, direction="bidirectional", initial=True)),
    ("LSTM", dict(direction="bidirectional", peepholes=True, clip=3.0)),
    # directions whose activations differ step apart
    ("LSTM", dict(direction="bidirectional", activations=["Sigmoid", "Tanh", "Tanh", "HardSigmoid", "Tanh", "Relu"])),
    ("GRU", dict(linear_before_reset=0, initial=True, opset=11)),
    ("RNN", dict(direction="reverse", initial=True, activations=["Relu"])),
])
def test_recurrent_layers_are_unrolled_into_what_onnxruntime_computes(kind, options):
    model = _recurrent_model(kind, **options)
    x = np.random.default_rng(1).normal(size=(5, 2, 3)).astype("float32")
    rewritten, ops = rewrite_unsupported(model)
    assert ops == [kind] and not any(n.op_type == kind for n in rewritten.graph.node)
    for want, got in zip(_ort(model, {"x": x}), _ort(rewritten, {"x": x}), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_both_directions_of_a_layer_step_together(kind):
    """A step's recurrent products are latency, not arithmetic: the forward direction's step s
    and the reverse one's step T-1-s are one product, batched over the directions."""
    model = _recurrent_model(kind, direction="bidirectional", steps=5, initial=True,
                             **({"linear_before_reset": 1} if kind == "GRU" else {}))
    rewritten, _ = rewrite_unsupported(model)
    matmuls = [n for n in rewritten.graph.node if n.op_type == "MatMul"]
    assert len(matmuls) == 2 + 5  # the two directions' input projections, then one a step
    x = np.random.default_rng(1).normal(size=(5, 2, 3)).astype("float32")
    for want, got in zip(_ort(model, {"x": x}), _ort(rewritten, {"x": x}), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op, attrs", [("Celu", dict(alpha=0.7)), ("LpNormalization", dict(axis=1, p=2)),
                                       ("LpNormalization", dict(axis=-1, p=1))])
def test_elementwise_ops_become_their_formulas(op, attrs):
    shape = [2, 5, 3]
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], **attrs)], op.lower(),
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(2).normal(size=shape).astype("float32")
    rewritten, ops = rewrite_unsupported(model)
    assert ops == [op]
    np.testing.assert_allclose(_ort(rewritten, {"x": x})[0], _ort(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_a_graph_without_such_ops_is_returned_as_it_is():
    model = _recurrent_model("LSTM")
    del model.graph.node[:]
    assert rewrite_unsupported(model) == (model, [])


def test_weights_computed_at_run_time_are_one_clear_error():
    with pytest.raises(UnsupportedOpError, match="input weight W is computed at run time"):
        rewrite_unsupported(_recurrent_model("GRU", constant_weights=False), "m.onnx")


def _crnn(path, steps: int = 24) -> str:
    """A CRNN-style text recogniser: a conv over the image height, the columns as a sequence,
    a bidirectional LSTM over them, a per-step classifier (as torch.onnx exports one)."""
    rng = np.random.default_rng(3)
    c, h, classes = 16, 24, 11
    inits = {"cw": rng.normal(size=(c, 3, 8, 1)) * 0.2, "W": rng.normal(size=(2, 4 * h, c)) * 0.2,
             "R": rng.normal(size=(2, 4 * h, h)) * 0.2, "B": rng.normal(size=(2, 8 * h)) * 0.1,
             "fw": rng.normal(size=(2 * h, classes)) * 0.2}
    tensors = [numpy_helper.from_array(a.astype("float32"), n) for n, a in inits.items()]
    tensors += [numpy_helper.from_array(np.array([2], np.int64), "axis"),
                numpy_helper.from_array(np.array([steps, 1, 2 * h], np.int64), "shape")]
    nodes = [helper.make_node("Conv", ["image", "cw"], ["f"]), helper.make_node("Relu", ["f"], ["r"]),
             helper.make_node("Squeeze", ["r", "axis"], ["cols"]),
             helper.make_node("Transpose", ["cols"], ["seq"], perm=[2, 0, 1]),
             helper.make_node("LSTM", ["seq", "W", "R", "B"], ["y"], hidden_size=h, direction="bidirectional"),
             helper.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["yt", "shape"], ["feat"]),
             helper.make_node("MatMul", ["feat", "fw"], ["logits"])]
    graph = helper.make_graph(nodes, "crnn", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 8, steps])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [steps, 1, classes])], tensors)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def test_a_crnn_text_recogniser_compiles_and_matches_onnxruntime(tmp_path, target):
    model = frontend.load(_crnn(tmp_path / "crnn.onnx"))
    # onnxruntime's reference is the graph as given, LSTM and all
    assert any(n.op_type == "LSTM" for n in model.onnx_model.graph.node)
    built = runtime.CompiledModel.load(runtime.export(runtime.compile_model(model, target), tmp_path / "m.so"),
                                       model)
    res = runtime.check_against_onnxruntime(built, model)
    assert res.ok, res.max_abs_error


def test_a_sequence_length_computed_by_shape_ops_is_followed(tmp_path, target):
    """torch.onnx writes reshapes whose target shape is computed from Shape(x) at run time."""
    rng = np.random.default_rng(4)
    steps, feat, hidden = 6, 8, 5
    inits = [numpy_helper.from_array(rng.normal(size=(1, 3 * hidden, feat)).astype("float32"), "W"),
             numpy_helper.from_array(rng.normal(size=(1, 3 * hidden, hidden)).astype("float32"), "R"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([1, -1], np.int64), "rest")]
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "zero", "one"], ["n"]),  # the sequence length, at run time
             helper.make_node("Concat", ["n", "rest"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["seq"]),
             helper.make_node("GRU", ["seq", "W", "R"], ["y"], hidden_size=hidden, linear_before_reset=1)]
    graph = helper.make_graph(nodes, "gru", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, 2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [steps, 1, 2, hidden])], inits)
    path = tmp_path / "gru.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    model = frontend.load(path)
    built = runtime.CompiledModel.load(runtime.export(runtime.compile_model(model, target), tmp_path / "m.so"),
                                       model)
    assert runtime.check_against_onnxruntime(built, model).ok


def test_an_if_on_a_condition_fixed_by_the_bound_shapes_folds_away(tmp_path, target):
    """An exporter's shape guard: If(batch == 1) -> Relu else Sigmoid. TVM's importer has no If;
    with the input shapes bound the condition is a constant, and the graph imports without it."""
    def branch(op, out):
        return helper.make_graph([helper.make_node(op, ["a"], [out])], op.lower(), [],
                                 [helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, 4])])

    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
             helper.make_node("Equal", ["n", "one"], ["cond"]), helper.make_node("Abs", ["x"], ["a"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=branch("Relu", "t"),
                              else_branch=branch("Sigmoid", "e"))]
    graph = helper.make_graph(nodes, "guard", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                              [numpy_helper.from_array(np.array(0, np.int64), "i0"),
                               numpy_helper.from_array(np.array(1, np.int64), "one")])
    path = tmp_path / "guard.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    model = frontend.load(path)
    assert model.simplified and "If" in model.simplified_because
    built = runtime.CompiledModel.load(runtime.export(runtime.compile_model(model, target), tmp_path / "m.so"),
                                       model)
    assert runtime.check_against_onnxruntime(built, model).ok
