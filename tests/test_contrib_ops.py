"""onnxruntime's contrib ops that its transformer optimizer and its saved optimized graphs
write, and TVM's importer lacks: rewritten into standard ops, checked against onnxruntime
running the contrib ops themselves."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ttrank import frontend, runtime
from ttrank.decompose import rewrite_unsupported
from ttrank.errors import UnsupportedOpError

MS = "com.microsoft"
B, S, D, HEADS = 2, 8, 32, 4


def _block(opset: int = 17, unidirectional: int = 1, mha_inputs: int = 4) -> onnx.ModelProto:
    """A pre-norm attention block as ORT's optimizer leaves one: RMS norm with the residual,
    projections as FusedMatMul, MultiHeadAttention with a packed bias, QuickGelu, RMS norm."""
    rng = np.random.default_rng(0)

    def w(name, *shape):
        return numpy_helper.from_array(rng.normal(scale=0.2, size=shape).astype("float32"), name)

    inits = [w("gamma", D), w("wq_t", D, D), w("wk", D, D), w("wv", D, D), w("qkv_bias", 3 * D), w("scale", D)]
    nodes = [
        helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["h", "", "", "sum"],
                         domain=MS, epsilon=1e-6),
        helper.make_node("FusedMatMul", ["h", "wq_t"], ["q"], domain=MS, transB=1),
        helper.make_node("FusedMatMul", ["h", "wk"], ["k"], domain=MS, alpha=0.5),
        helper.make_node("MatMul", ["h", "wv"], ["v"]),
        helper.make_node("MultiHeadAttention", ["q", "k", "v", "qkv_bias"][:mha_inputs], ["att"], domain=MS,
                         num_heads=HEADS, unidirectional=unidirectional),
        helper.make_node("QuickGelu", ["att"], ["act"], domain=MS, alpha=1.702),
        helper.make_node("Add", ["act", "sum"], ["res"]),
        helper.make_node("SimplifiedLayerNormalization", ["res", "scale"], ["y"], axis=-1, epsilon=1e-5),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, S, D]) for n in ("x", "skip", "y")]
    graph = helper.make_graph(nodes, "block", io[:2], io[2:], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])


def _ort(model: onnx.ModelProto, feed: dict) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _feed() -> dict:
    rng = np.random.default_rng(1)
    return {n: rng.normal(size=(B, S, D)).astype("float32") for n in ("x", "skip")}


@pytest.mark.parametrize("opset, unidirectional, mha_inputs", [(17, 1, 4), (18, 0, 3), (13, 0, 4)])
def test_contrib_ops_become_standard_ops_that_compute_the_same(opset, unidirectional, mha_inputs):
    model = _block(opset, unidirectional, mha_inputs)
    rewritten, ops = rewrite_unsupported(model)
    assert ops == ["FusedMatMul", "MultiHeadAttention", "QuickGelu", "SimplifiedLayerNormalization",
                   "SkipSimplifiedLayerNormalization"]
    assert all(n.domain in ("", "ai.onnx") and n.op_type not in ops for n in rewritten.graph.node)
    np.testing.assert_allclose(_ort(rewritten, _feed()), _ort(model, _feed()), rtol=1e-4, atol=1e-5)


def test_a_transformer_block_with_contrib_ops_compiles_and_matches_onnxruntime(tmp_path, target):
    path = tmp_path / "block.onnx"
    onnx.save(_block(), str(path))
    model = frontend.load(path)
    assert any(n.domain == MS for n in model.onnx_model.graph.node)  # the reference is the file as given
    built = runtime.CompiledModel.load(runtime.export(runtime.compile_model(model, target), tmp_path / "m.so"),
                                       model)
    res = runtime.check_against_onnxruntime(built, model)
    assert res.ok, res.max_abs_error


def test_a_contrib_op_in_a_form_not_rewritten_is_one_clear_error():
    model = _block()
    past = helper.make_tensor_value_info("past_key", TensorProto.FLOAT, [B, HEADS, S, D // HEADS])
    model.graph.input.append(past)
    mha = next(n for n in model.graph.node if n.op_type == "MultiHeadAttention")
    mha.input.extend(["", "", "past_key"])
    with pytest.raises(UnsupportedOpError, match="MultiHeadAttention .*past key/value"):
        rewrite_unsupported(model, "m.onnx")


@pytest.mark.parametrize("opset", [13, 17])
def test_contrib_ops_tvm_imports_are_rewritten_too_so_shape_inference_reaches_past_them(opset):
    """TVM imports Gelu, BiasGelu, FastGelu and SkipLayerNormalization (the last only with a beta
    and a bias, which CLIP's lacks), but ONNX's shape inference stops at them, and the graph
    simplifier with it: what follows them keeps its run-time shape arithmetic."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.normal(size=D).astype("float32"), n) for n in ("gamma", "b1", "b2")]
    nodes = [
        helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma"], ["h", "", "", "sum"], domain=MS,
                         epsilon=1e-5),
        helper.make_node("BiasGelu", ["h", "b1"], ["g1"], domain=MS),
        helper.make_node("FastGelu", ["g1", "b2"], ["g2"], domain=MS),
        helper.make_node("Gelu", ["g2"], ["g3"], domain=MS),
        helper.make_node("Add", ["g3", "sum"], ["r"]),
        # a reshape to a shape computed at run time: folded only when inference reaches it
        helper.make_node("Shape", ["r"], ["r_shape"]),
        helper.make_node("Reshape", ["r", "r_shape"], ["y"]),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, S, D]) for n in ("x", "skip", "y")]
    model = helper.make_model(helper.make_graph(nodes, "acts", io[:2], io[2:], inits),
                              opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    rewritten, ops = rewrite_unsupported(model)
    assert ops == ["BiasGelu", "FastGelu", "Gelu", "SkipLayerNormalization"]
    inferred = onnx.shape_inference.infer_shapes(rewritten)
    assert any(v.name == "r_shape" for v in inferred.graph.value_info)
    np.testing.assert_allclose(_ort(rewritten, _feed()), _ort(model, _feed()), rtol=1e-4, atol=1e-5)
