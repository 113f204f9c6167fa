"""Foundation: ONNX loading, kernels, the zoo, and the untuned compile+check, as a user runs them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest

from ttrank import frontend, graphopt, kernels, precision, runtime, zoo
from ttrank.cli import main
from ttrank.errors import DynamicShapeError, ModelLoadError, UnsupportedOpError
from ttrank.target import isa_intrinsics_module, make_target


def test_zoo_builds_every_network_deterministically():
    for name in ("tiny_cnn", "tiny_bert", "tiny_mobilebert"):
        a, b = zoo.build(name), zoo.build(name)
        assert a.SerializeToString() == b.SerializeToString()
        onnx.checker.check_model(a)
    assert set(zoo.PAPER_NETWORKS) <= set(zoo.ZOO)


def test_zoo_paper_networks_have_real_parameter_counts():
    # parameter counts of the reference architectures (torchvision / HF), within 2%
    expected = {"resnet18": 11.69e6, "mobilenetv2": 3.50e6, "mnasnet1_0": 4.38e6,
                "efficientnetb0": 5.29e6, "googlenet": 6.62e6}
    for name, n in expected.items():
        m = zoo.build(name)
        count = sum(int(np.prod(t.dims)) for t in m.graph.initializer if len(t.dims) >= 1)
        assert abs(count - n) / n < 0.02, (name, count)


def test_load_and_kernels_of_tiny_cnn(tiny_cnn):
    model = frontend.load(tiny_cnn)
    ks = kernels.extract(model.mod)
    classes = {k.workload_class for k in ks}
    assert "conv2d_nchw+add+relu" in classes
    assert "conv2d_nchw+add+add+relu" in classes  # residual epilogue kept distinct
    dw = [k for k in ks if k.anchor_op == "group_conv2d_nchw"]
    assert dw and dw[0].attrs["depthwise"] and dw[0].attrs["stride"] == [2, 2]
    # FLOPs of the convs: 2 * N*K*OH*OW*C*KH*KW (+ epilogue)
    stem = next(k for k in ks if k.attrs.get("in_channels") == 3)
    assert stem.flops >= 2 * 16 * 32 * 32 * 3 * 9


def test_workload_class_ignores_model_counters():
    assert kernels.class_of_task_name("fused_conv2d3_add3_relu2") == \
        kernels.class_of_task_name("fused_conv2d7_add5_relu3") == "conv2d_add_relu"


def test_kernels_json_cli(tiny_bert, capsys):
    assert main(["kernels", str(tiny_bert), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    for key in ("name", "workload_class", "anchor_op", "shape", "flops", "weight"):
        assert all(key in r for r in rows)
    anchors = {r["anchor_op"] for r in rows}
    assert {"matmul", "softmax_maxelem"} <= anchors or "matmul" in anchors
    assert any(r["weight"] > 1 for r in rows)  # repeated layers share a kernel


def test_compile_matches_onnxruntime(tiny_bert, tmp_path):
    model = frontend.load(tiny_bert)
    from ttrank.target import make_target

    ex = runtime.compile_model(model, make_target())
    out = runtime.export(ex, tmp_path / "m.so")
    res = runtime.check_against_onnxruntime(runtime.CompiledModel.load(out, model), model)
    assert res.ok and res.max_abs_error < 1e-4


def _swish_erf_model(path):
    """Conv -> swish (x * sigmoid(x)) -> erf: the epilogues of EfficientNet and BERT."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(16, 8, 1, 1)).astype("float32"), "w")
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Sigmoid", ["c"], ["s"]),
         helper.make_node("Mul", ["c", "s"], ["m"]), helper.make_node("Erf", ["m"], ["y"])],
        "swish_erf", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 16, 16])], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_fast_math_is_the_default_replaces_transcendentals_and_still_matches(tmp_path):
    import re

    from tvm import relax

    from ttrank.target import make_target

    path = _swish_erf_model(tmp_path / "swish.onnx")

    def calls(mod):
        return set(re.findall(r"T\.(exp|sigmoid|erf)\(", relax.transform.LegalizeOps()(mod).script()))

    exact, fast = frontend.load(path, fast_math=False), frontend.load(path)
    assert calls(exact.mod) == {"sigmoid", "erf"} and not exact.fast_math
    assert calls(fast.mod) == set() and fast.fast_math
    assert calls(frontend.with_fast_math(exact.mod)) == set()
    assert calls(exact.mod) == {"sigmoid", "erf"}  # the caller's module is left as it was
    out = runtime.export(runtime.compile_model(fast, make_target()), tmp_path / "fast.so")
    res = runtime.check_against_onnxruntime(runtime.CompiledModel.load(out, fast), fast)
    assert res.ok and res.max_abs_error < 1e-4


def test_exact_math_is_one_flag_away(tmp_path, capsys):
    path = _swish_erf_model(tmp_path / "swish.onnx")
    assert main(["kernels", str(path), "--json"]) == 0
    fast = capsys.readouterr().out
    assert main(["kernels", str(path), "--json", "--exact-math"]) == 0
    exact = capsys.readouterr().out
    assert "sigmoid" in exact and "sigmoid" not in fast  # the swish kernel without libm's call
    assert main(["kernels", str(path), "--fast-math"]) == 0  # earlier commands still run


def test_compile_cli_writes_library(tiny_cnn, tmp_path, capsys):
    assert main(["compile", str(tiny_cnn), "-o", str(tmp_path / "cnn.so"), "--time"]) == 0
    assert (tmp_path / "cnn.so").stat().st_size > 0
    out = capsys.readouterr().out
    assert "OK" in out
    # TVM and onnxruntime are timed in alternation, so one slow stretch cannot favour either
    tvm_ms, ort_ms = (float(x) for x in re.findall(r"([0-9.]+) ms", out.split("latency")[1]))
    assert tvm_ms > 0 and ort_ms > 0


# --- bad input: one clear message, non-zero exit, no traceback ---------------------------------

def _run_err(args, capsys) -> tuple[int, str]:
    rc = main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_not_onnx_file(tmp_path, capsys):
    p = tmp_path / "notes.onnx"
    p.write_text("this is not a model")
    rc, err = _run_err(["kernels", str(p)], capsys)
    assert rc == 2 and "not a valid ONNX file" in err


def test_truncated_file(tiny_cnn, tmp_path, capsys):
    p = tmp_path / "cut.onnx"
    p.write_bytes(tiny_cnn.read_bytes()[:500])
    rc, err = _run_err(["kernels", str(p)], capsys)
    assert rc == 2 and "not a valid ONNX file" in err


def test_missing_file(tmp_path, capsys):
    rc, err = _run_err(["compile", str(tmp_path / "nope.onnx"), "-o", str(tmp_path / "x.so")], capsys)
    assert rc == 2 and "no such file" in err


def test_dynamic_dims_need_input_shape(tmp_path, capsys):
    p = zoo.export("tiny_cnn", tmp_path / "dyn.onnx", dynamic=True)
    rc, err = _run_err(["kernels", str(p)], capsys)
    assert rc == 2 and "input" in err and "--input-shape input:" in err
    with pytest.raises(DynamicShapeError):
        frontend.load(p)
    model = frontend.load(p, {"input": [1, 3, 32, 32]})
    assert model.inputs[0].shape == [1, 3, 32, 32]


def test_a_dynamic_batch_dim_alone_compiles_for_batch_1(tiny_cnn, tmp_path, capsys):
    m = onnx.load(str(tiny_cnn))
    for value in (m.graph.input[0], m.graph.output[0]):  # as dynamic_axes={..: {0: "N"}} exports
        value.type.tensor_type.shape.dim[0].dim_param = "N"
    onnx.save(m, str(tmp_path / "dynbatch.onnx"))
    rc, err = _run_err(["kernels", str(tmp_path / "dynbatch.onnx")], capsys)
    assert rc == 0 and "dynamic batch dim: compiled for batch 1 (--input-shape input:8,3," in err
    (spec,) = frontend.load(tmp_path / "dynbatch.onnx").inputs
    assert spec.shape[0] == 1 and spec.batch_defaulted
    (spec,) = frontend.load(tmp_path / "dynbatch.onnx", {"input": [2, *spec.shape[1:]]}).inputs
    assert spec.shape[0] == 2 and not spec.batch_defaulted


def test_bad_input_shape_flag(tiny_cnn, capsys):
    rc, err = _run_err(["kernels", str(tiny_cnn), "--input-shape", "nosuch:1,2"], capsys)
    assert rc == 2 and "model's inputs are: input" in err
    rc, err = _run_err(["kernels", str(tiny_cnn), "--input-shape", "input:1,3,x"], capsys)
    assert rc == 2 and "integers" in err


def test_unsupported_op_is_named(unsupported_op_model, capsys):
    rc, err = _run_err(["kernels", str(unsupported_op_model)], capsys)
    assert rc == 2 and "Det" in err
    with pytest.raises(UnsupportedOpError):
        frontend.load(unsupported_op_model)


def test_a_quantized_graph_is_refused_in_one_line_but_int8_weights_load(tmp_path, capsys):
    # onnxruntime's quantize_static, QDQ form: activations quantized around a float conv
    g = zoo.GraphBuilder("qdq", seed=0)
    scale, zero = g.const(np.float32(0.05)), g.const(np.uint8(128))
    x = g.node("QuantizeLinear", [g.input("x", [1, 3, 8, 8]), scale, zero])
    x = g.conv(g.node("DequantizeLinear", [x, scale, zero]), 3, 4, 3)
    g.output(x, [1, 4, 6, 6])
    onnx.save(g.model(), str(tmp_path / "qdq.onnx"))
    rc, err = _run_err(["kernels", str(tmp_path / "qdq.onnx")], capsys)
    assert rc == 2 and "quantized graph (QuantizeLinear)" in err and len(err.strip().splitlines()) == 1
    # weights stored as int8 and dequantized into a float conv: a float model
    g = zoo.GraphBuilder("int8_weights", seed=0)
    w = g.const(np.arange(4 * 3 * 3 * 3, dtype=np.int8).reshape(4, 3, 3, 3))
    w = g.node("DequantizeLinear", [w, g.const(np.float32(0.01)), g.const(np.int8(0))])
    g.output(g.node("Conv", [g.input("x", [1, 3, 8, 8]), w]), [1, 4, 6, 6])
    onnx.save(g.model(), str(tmp_path / "w8.onnx"))
    model = frontend.load(tmp_path / "w8.onnx")
    ex = runtime.compile_model(model, make_target())
    assert runtime.check_against_onnxruntime(runtime.CompiledModel.from_executable(ex, model), model).ok


def _half_precision_net(keep_io: bool) -> onnx.ModelProto:
    """Two 3x3 convs of 64 channels and a linear layer in float16, as ``model.half()`` exports
    it; ``keep_io``: float32 inputs and outputs cast at the edges, as onnxconverter-common's
    ``keep_io_types`` writes it."""
    g = zoo.GraphBuilder("half", seed=0)
    x = g.input("x", [1, 16, 16, 16], onnx.TensorProto.FLOAT if keep_io else onnx.TensorProto.FLOAT16)
    if keep_io:
        x = g.node("Cast", [x], to=onnx.TensorProto.FLOAT16)
    x = g.node("Relu", [g.conv(x, 16, 64, 3, pad=1)])
    x = g.node("Relu", [g.conv(x, 64, 64, 3, pad=1)])  # sums of 576 products
    y = g.node("Gemm", [g.reshape(x, [1, 64 * 16 * 16]), g.weight((64 * 16 * 16, 10), 0.01)])
    if keep_io:
        y = g.node("Cast", [y], to=onnx.TensorProto.FLOAT)
    g.output(y, [1, 10], onnx.TensorProto.FLOAT if keep_io else onnx.TensorProto.FLOAT16)
    model = g.model()
    for i, t in enumerate(model.graph.initializer):
        if t.data_type == onnx.TensorProto.FLOAT:
            model.graph.initializer[i].CopyFrom(
                onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t).astype(np.float16), t.name))
    return model


@pytest.mark.parametrize("keep_io", [False, True], ids=["float16_io", "float32_io"])
def test_a_half_precision_export_computes_in_float32_and_keeps_its_interface(tmp_path, keep_io):
    onnx.checker.check_model(_half_precision_net(keep_io), full_check=True)
    onnx.save(_half_precision_net(keep_io), str(tmp_path / "half.onnx"))
    model = frontend.load(tmp_path / "half.onnx")
    # the convs are float32 kernels: the donors' schedules are float32 ones
    assert {k.dtype for k in kernels.extract(model.mod) if k.anchor_op == "conv2d_nchw"} == {"float32"}
    compiled = runtime.CompiledModel.from_executable(runtime.compile_model(model, make_target()), model)
    feed = model.random_inputs()
    out = compiled.run(feed)[0]
    assert out.dtype == (np.float32 if keep_io else np.float16)
    # accumulated in float16, the second conv's sums were 0.02 off onnxruntime's (float32) ones
    res = runtime.check_against_onnxruntime(compiled, model)
    assert res.ok and res.max_rel_error < 2e-3, res


def test_a_half_precision_body_reads_the_widened_input(tmp_path):
    # an If whose branches read the float16 graph input: they read its float32 twin after the rewrite
    h = onnx.helper
    y = h.make_tensor_value_info("y", onnx.TensorProto.FLOAT16, None)
    then = h.make_graph([h.make_node("Identity", ["x"], ["y"])], "then", [], [y])
    other = h.make_graph([h.make_node("Neg", ["x"], ["y"])], "else", [], [y])
    g = h.make_graph([h.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
                      h.make_node("Greater", ["m", "zero"], ["c"]),
                      h.make_node("If", ["c"], ["out"], then_branch=then, else_branch=other)], "g",
                     [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT16, [2, 3])],
                     [h.make_tensor_value_info("out", onnx.TensorProto.FLOAT16, [2, 3])],
                     [onnx.numpy_helper.from_array(np.array(0.0, np.float16), "zero")])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    widened, changed = precision.widen_half(model)
    onnx.checker.check_model(widened, full_check=True)
    assert changed and widened.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    for seed in (0, 1):
        x = {"x": np.random.default_rng(seed).standard_normal((2, 3)).astype(np.float16)}
        want, got = (runtime.ort_session(m).run(None, x)[0] for m in (model, widened))
        assert got.dtype == np.float16 and np.array_equal(got, want)


def _detector_with_nms() -> onnx.ModelProto:
    """A small detector with its post-processing in the graph, as torchvision's and YOLO's
    exports have it: box and score heads, NonMaxSuppression, the kept boxes gathered, and an If
    on the data; plus the feature map as a second output."""
    g = zoo.GraphBuilder("det", seed=0)
    f = g.node("Relu", [g.conv(g.input("image", [1, 3, 32, 32]), 3, 16, 3)])
    f = g.node("Relu", [g.conv(f, 16, 8, 3, stride=2)])  # [1, 8, 16, 16]
    boxes = g.node("Transpose", [g.reshape(g.conv(f, 8, 4, 1), [1, 4, 256])], perm=[0, 2, 1])
    scores = g.reshape(g.node("Sigmoid", [g.conv(f, 8, 1, 1)]), [1, 1, 256])
    keep = g.node("NonMaxSuppression", [boxes, scores, g.const(np.array([20], np.int64)),
                                        g.const(np.array([0.5], np.float32)), g.const(np.array([0.5], np.float32))])
    idx = g.node("Gather", [keep, g.const(np.array(2, np.int64))], axis=1)
    kept = g.node("Gather", [g.reshape(boxes, [256, 4]), idx], axis=0)
    flat = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    doubled = onnx.helper.make_graph([onnx.helper.make_node("Add", [kept, kept], ["y"])], "then", [], [flat])
    same = onnx.helper.make_graph([onnx.helper.make_node("Identity", [kept], ["y"])], "else", [], [flat])
    sure = g.node("Greater", [g.node("ReduceMax", [scores], keepdims=0), g.const(np.array(0.9, np.float32))])
    g.output(g.node("If", [sure], then_branch=doubled, else_branch=same), None)
    g.output(f, [1, 8, 16, 16])
    return g.model()


def test_a_detector_compiles_up_to_its_data_dependent_post_processing(tmp_path, capsys):
    onnx.save(_detector_with_nms(), str(tmp_path / "det.onnx"))
    model = frontend.load(tmp_path / "det.onnx")
    # the backbone and the heads' convs are compiled; onnxruntime runs the rest: NMS and If,
    # and the light ops that only feed them (reshapes, sigmoid, the If's condition)
    assert model.tail.ops == ["If", "NonMaxSuppression"] and model.tail.nodes == 11
    assert len(model.tail.cut) == 3  # the two heads' convs, and the feature map (an output)
    assert {k.anchor_op for k in kernels.extract(model.mod)} >= {"conv2d_nchw"}
    compiled = runtime.CompiledModel.from_executable(runtime.compile_model(model, make_target()), model)
    boxes, features = compiled.run(model.random_inputs())
    assert boxes.ndim == 2 and boxes.shape[1] == 4 and 0 < len(boxes) <= 20 and features.shape == (1, 8, 16, 16)
    assert runtime.check_against_onnxruntime(compiled, model).ok
    # the CLI writes the tail beside the library, and says so
    assert main(["compile", str(tmp_path / "det.onnx"), "-o", str(tmp_path / "det.so")]) == 0
    assert "runs in onnxruntime" in capsys.readouterr().out
    tail = onnx.load(str(tmp_path / "det.tail.onnx"))
    assert {"NonMaxSuppression", "If"} <= {n.op_type for n in tail.graph.node}
    # a model compiled whole into the same library takes the old tail file away with it
    plain = zoo.export("tiny_cnn", tmp_path / "plain.onnx")
    assert main(["compile", str(plain), "-o", str(tmp_path / "det.so")]) == 0
    assert not (tmp_path / "det.tail.onnx").exists()


def test_a_data_dependent_op_on_constants_cuts_nothing(tmp_path):
    # YOLO exports at opset 10 build their grid with NonZero on a ConstantOfShape: it folds
    g = zoo.GraphBuilder("grid", seed=0)
    ones = g.node("ConstantOfShape", [g.const(np.array([4, 4], np.int64))],
                  value=onnx.numpy_helper.from_array(np.ones(1, np.float32)))
    grid = g.node("Cast", [g.node("Transpose", [g.node("NonZero", [ones])], perm=[1, 0])], to=onnx.TensorProto.FLOAT)
    x = g.reshape(g.conv(g.input("x", [1, 3, 4, 4]), 3, 2, 1), [2, 16])  # [2, 16]
    g.output(g.node("MatMul", [x, grid]), [2, 2])
    onnx.save(g.model(), str(tmp_path / "grid.onnx"))
    model = frontend.load(tmp_path / "grid.onnx")
    assert model.tail is None
    compiled = runtime.CompiledModel.from_executable(runtime.compile_model(model, make_target()), model)
    assert runtime.check_against_onnxruntime(compiled, model).ok


def test_exporter_style_dynamic_reshape_imports_after_simplification(paddle_style, tmp_path):
    with pytest.raises(ModelLoadError):
        frontend.load(paddle_style, {"x": [1, 3, 16, 16]}, simplify_graph="never")
    model = frontend.load(paddle_style, {"x": [1, 3, 16, 16]})
    assert model.simplified
    from ttrank.target import make_target

    compiled = runtime.CompiledModel.from_executable(runtime.compile_model(model, make_target()), model)
    assert runtime.check_against_onnxruntime(compiled, model).ok


def test_a_channel_split_computed_from_shapes_is_folded_before_its_kernels_are_built(channel_split):
    # imported as exported, the split's slices have no static shape: no kernel can be built
    as_exported = frontend.load(channel_split, simplify_graph="never")
    assert frontend.unknown_shapes(as_exported.mod)
    model = frontend.load(channel_split)
    assert model.simplified and "static shape" in model.simplified_because
    assert not frontend.unknown_shapes(model.mod)
    from ttrank.target import make_target

    assert {k.anchor_op for k in kernels.extract(model.mod)} >= {"conv2d_nchw"}
    compiled = runtime.CompiledModel.from_executable(runtime.compile_model(model, make_target()), model)
    assert runtime.check_against_onnxruntime(compiled, model).ok


def test_resnet18_kernels_add_up_to_the_known_flops(tmp_path):
    model = frontend.load(zoo.export("resnet18", tmp_path / "r18.onnx"))
    ks = kernels.extract(model.mod)
    total = sum(k.flops * k.weight for k in ks)
    assert 3.55e9 < total < 3.7e9  # 1.8 G multiply-adds
    convs = [k for k in ks if k.anchor_op == "conv2d_nchw"]
    assert sum(k.weight for k in convs) == 20  # 17 3x3/7x7 convs + 3 downsampling 1x1
    stem = next(k for k in convs if k.attrs["kernel"] == [7, 7])
    assert stem.attrs["stride"] == [2, 2] and stem.extents == [1, 64, 112, 112, 3, 7, 7]


@pytest.mark.slow
def test_resnet18_compile_matches_onnxruntime(tmp_path):
    from ttrank.target import make_target

    model = frontend.load(zoo.export("resnet18", tmp_path / "r18.onnx"))
    compiled = runtime.CompiledModel.from_executable(runtime.compile_model(model, make_target()), model)
    res = runtime.check_against_onnxruntime(compiled, model)
    assert res.ok and res.max_rel_error < 1e-4


@pytest.mark.slow
def test_bert_base_kernels(tmp_path):
    model = frontend.load(zoo.export("bert", tmp_path / "bert.onnx"))
    ks = kernels.extract(model.mod)
    total = sum(k.flops * k.weight for k in ks)
    # 12 layers x 256 tokens x (4*768*768 + 2*768*3072) MACs + attention + pooler
    assert 45e9 < total < 47.5e9
    classes = {k.workload_class for k in ks}
    assert "matmul+add+multiply+fast_erf+multiply+add+multiply" in classes  # erf-GELU epilogue, fast math
    assert any(k.anchor_op == "softmax_maxelem" for k in ks)
    qkv = next(k for k in ks if k.workload_class == "matmul+add" and k.attrs.get("k") == 768
               and k.attrs.get("n") == 768)
    assert qkv.weight >= 36  # Q, K, V of 12 layers share one kernel


def test_tvm_runtime_uses_every_core_unless_told_otherwise():
    # TVM alone would use half the CPUs on x86 (it assumes hyper-threads)
    import subprocess
    import sys

    from ttrank.target import host_cores

    code = ("import ttrank, tvm; from ttrank.target import provenance; "
            "print(tvm.get_global_func('runtime.NumThreads')(), provenance()['threads'])")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TVM_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(host_cores())] * 2
    out = subprocess.run([sys.executable, "-c", code], env={**env, "TVM_NUM_THREADS": "1"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1"]


def test_threads_flag_reaches_the_measuring_workers(monkeypatch, capsys):
    import os

    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    assert main(["--threads", "2", "zoo", "list"]) == 0
    assert os.environ["TVM_NUM_THREADS"] == "2"  # inherited by the runner and builder workers
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    with pytest.raises(SystemExit):
        main(["--threads", "0", "zoo", "list"])
    assert "--threads must be at least 1" in capsys.readouterr().err


def test_a_busy_machine_is_noticed_and_recorded(monkeypatch):
    import os

    from ttrank import target as tg

    # the cores' work right now decides; the load average is recorded with every row
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0, 1.0, 1.0))
    monkeypatch.setattr(tg, "cpu_busy_now", lambda: 2.0 * tg.host_cores())
    assert "busy" in tg.machine_busy() and tg.provenance()["load_1m"] == 4.0
    # a job that ended a minute ago still holds the load average, not the cores
    monkeypatch.setattr(tg, "cpu_busy_now", lambda: 0.05)
    assert tg.machine_busy() is None
    # where the cores' work cannot be read, the load average is all there is
    monkeypatch.setattr(tg, "cpu_busy_now", lambda: None)
    assert "busy" in tg.machine_busy()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 1.0, 1.0))
    assert tg.machine_busy() is None


def test_zoo_family_networks_have_real_parameter_counts():
    # the reference architectures' parameter counts (torchvision / timm / ultralytics), within 2%
    expected = {"resnext50": 25.03e6, "mobilenetv3": 5.48e6, "vit_tiny": 5.72e6, "yolo": 3.16e6}
    for name, n in expected.items():
        m = zoo.build(name)
        onnx.checker.check_model(m)
        count = sum(int(np.prod(t.dims)) for t in m.graph.initializer if len(t.dims) >= 1)
        assert abs(count - n) / n < 0.02, (name, count)
    assert set(zoo.FAMILY_NETWORKS) <= set(zoo.ZOO)


def _upsampling_decoder(path, kernel: int, stride: int, pad: int):
    """conv -> transposed conv -> batch norm -> ReLU -> conv (no bias) -> batch norm, as
    segmentation and text-detection heads export them (batch norms kept, Paddle-style)."""
    g = zoo.GraphBuilder("decoder", seed=0)
    x = g.relu(g.conv(g.input("input", [1, 3, 16, 16]), 3, 8, 3))
    x = g.relu(g.batchnorm(g.conv_transpose(x, 8, 8, kernel, stride, pad), 8))
    x = g.batchnorm(g.conv(x, 8, 4, 3, bias=False), 4)
    out = (16 - 1) * stride - 2 * pad + kernel
    g.output(x, [1, 4, out, out])
    onnx.save(g.model(), str(path))
    return path


@pytest.mark.parametrize("kernel,stride,pad", [(2, 2, 0), (3, 2, 1)])
def test_batch_norms_fold_into_transposed_convs_and_outputs_still_match(tmp_path, kernel, stride, pad):
    from ttrank.target import make_target

    model = frontend.load(_upsampling_decoder(tmp_path / "d.onnx", kernel, stride, pad))
    classes = [k.workload_class for k in kernels.extract(model.mod)]
    assert not any("sqrt" in c for c in classes), classes  # no standalone batch-norm kernel
    if kernel == stride:  # exactly one tap per output pixel: a 1x1 conv and a shuffle
        assert not any(c.startswith("conv2d_transpose") for c in classes), classes
    else:
        assert any(c.startswith("conv2d_transpose_nchw") for c in classes), classes
    ex = runtime.compile_model(model, make_target())
    out = runtime.export(ex, tmp_path / "m.so")
    res = runtime.check_against_onnxruntime(runtime.CompiledModel.load(out, model), model)
    assert res.ok and res.max_abs_error < 1e-4


def _atrous_pyramid(path):
    """DeepLab's ASPP on a 10x10 map: 3x3 convs at rates 4, 12 and 2 (grouped), side by side."""
    g = zoo.GraphBuilder("aspp", seed=0)
    x = g.relu(g.conv(g.input("input", [1, 3, 20, 20]), 3, 16, 3, 2))
    branches = [g.relu(g.conv(x, 16, 8, 3, dilation=4)), g.relu(g.conv(x, 16, 8, 3, dilation=12)),
                g.relu(g.conv(x, 16, 8, 3, groups=8, dilation=2))]
    g.output(g.concat(branches), [1, 24, 10, 10])
    onnx.save(g.model(), str(path))
    return path


def test_an_atrous_conv_computes_only_the_taps_that_read_its_map(tmp_path):
    from ttrank.graphopt import tap_zones
    from ttrank.target import make_target

    # rate 12 on 10 rows with padding 12: every output reads only the centre tap
    assert tap_zones(10, 10, 3, 1, 12, 12) == [(0, 10, 1, 2)]
    # rate 4: the first 4 outputs read taps 1-2, the middle 2 all three, the last 4 taps 0-1
    assert tap_zones(10, 10, 3, 1, 4, 4) == [(0, 4, 1, 3), (4, 6, 0, 3), (6, 10, 0, 2)]
    model = frontend.load(_atrous_pyramid(tmp_path / "aspp.onnx"))
    convs = [k for k in kernels.extract(model.mod) if "conv2d" in k.anchor_op]
    work = sum(k.flops * k.weight for k in convs)
    plain = 2 * 9 * (10 * 10 * 3 * 16 + 10 * 10 * (16 * 8 * 2 + 2 * 8))  # stem, two ASPP convs, grouped
    assert work < 0.6 * plain, (work, plain)
    # 1 conv for rate 12 (1x1), 9 zones for rate 4; rate 2 reads its map enough to stay whole
    assert sum(k.weight for k in convs) == 1 + 1 + 9 + 1, [(k.name, k.weight) for k in convs]
    ex = runtime.compile_model(model, make_target())
    res = runtime.check_against_onnxruntime(
        runtime.CompiledModel.load(runtime.export(ex, tmp_path / "m.so"), model), model)
    assert res.ok and res.max_abs_error < 1e-4


def test_a_conv_whose_output_rows_tile_badly_computes_one_more_and_slices_it_off(tmp_path):
    from ttrank.graphopt import padded_extent
    from ttrank.target import make_target

    assert [padded_extent(n) for n in (14, 16, 17, 35, 71)] == [14, 16, 18, 35, 72]
    g = zoo.GraphBuilder("inception_stem", seed=0)
    x = g.relu(g.conv(g.input("input", [1, 3, 37, 37]), 3, 16, 3, 2, 0))  # 18x18
    x = g.relu(g.conv(x, 16, 32, 2, 1, 0))  # 17x17: no divisor between 4 and 16
    g.output(x, [1, 32, 17, 17])
    onnx.save(g.model(), str(tmp_path / "stem.onnx"))
    model = frontend.load(tmp_path / "stem.onnx")
    convs = {k.name: k.extents for k in kernels.extract(model.mod) if "conv2d" in k.anchor_op}
    assert sorted(e[2:4] for e in convs.values()) == [[18, 18], [18, 18]], convs
    ex = runtime.compile_model(model, make_target())
    res = runtime.check_against_onnxruntime(
        runtime.CompiledModel.load(runtime.export(ex, tmp_path / "m.so"), model), model)
    assert res.ok and res.max_abs_error < 1e-4


def test_a_video_nets_3d_convs_compile_as_2d_convs_that_donors_cover(tmp_path):
    from ttrank.target import make_target

    g = zoo.GraphBuilder("video", seed=0)
    x = g.relu(g.conv3d(g.input("clip", [1, 3, 6, 20, 20]), 3, 8, (3, 5, 5), (1, 2, 2)))  # 6x10x10
    y = g.relu(g.conv3d(x, 8, 8, (1, 3, 3)))  # R(2+1)D's spatial half
    y = g.conv3d(y, 8, 16, (3, 1, 1), (2, 1, 1))  # its temporal half, strided in time: 3x10x10
    short = g.conv3d(x, 8, 16, (1, 1, 1), (2, 1, 1))
    x = g.relu(g.node("Add", [y, short]))
    x = g.relu(g.conv3d(x, 16, 16, (3, 3, 3), (2, 2, 2)))  # 2x5x5
    # a conv to 5 channels without bias, then 5 values that vary along W (not a per-channel bias)
    x = g.node("Add", [g.node("Conv", [x, g.weight((5, 16, 1, 1, 1), 0.3)], kernel_shape=[1, 1, 1]),
                       g.const(np.arange(5, dtype=np.float32))])
    x = g.conv3d(x, 5, 5, (3, 3, 3), groups=5)  # grouped: stays a 3-D conv
    g.output(x, [1, 5, 2, 5, 5])
    onnx.save(g.model(), str(tmp_path / "video.onnx"))
    model = frontend.load(tmp_path / "video.onnx")
    ops = sorted(k.anchor_op for k in kernels.extract(model.mod) if "conv" in k.anchor_op)
    assert ops == ["conv2d_nchw"] * 6 + ["group_conv3d_ncdhw"], ops
    ex = runtime.compile_model(model, make_target())
    res = runtime.check_against_onnxruntime(runtime.CompiledModel.from_executable(ex, model), model)
    assert res.ok and res.max_abs_error < 1e-4


def test_an_audio_nets_1d_convs_compile_as_2d_convs_that_donors_cover(tmp_path):
    # wav2vec2's feature extractor and Whisper's stem: strided and padded 1-D convs
    g = zoo.GraphBuilder("audio", seed=0)
    x = g.relu(g.conv1d(g.input("wave", [1, 8, 50]), 8, 16, 5, 2))  # bias and ReLU: the epilogue
    x = g.node("Conv", [x, g.weight((16, 16, 3), 0.2)], kernel_shape=[3], strides=[2])  # no bias, no padding
    x = g.relu(g.node("Add", [g.conv1d(x, 16, 16, 3, dilation=2), x]))  # a residual block
    x = g.conv1d(x, 16, 16, 3, groups=4)
    g.output(g.node("Erf", [x]), [1, 16, 12])
    onnx.save(g.model(), str(tmp_path / "audio.onnx"))
    model = frontend.load(tmp_path / "audio.onnx")
    assert not graphopt.uses_op(model.mod, "relax.nn.conv1d")
    # the residual sum and its ReLU stay in the conv's epilogue, as they were in the conv1d's
    assert "conv2d_nchw+add+add+relu" in {k.workload_class for k in kernels.extract(model.mod)}
    ex = runtime.compile_model(model, make_target())
    res = runtime.check_against_onnxruntime(runtime.CompiledModel.from_executable(ex, model), model)
    assert res.ok and res.max_abs_error < 1e-4


def test_a_segmentation_heads_fuse_conv_runs_before_its_upsampling(tmp_path):
    # SegFormer's head: each scale upsampled to the largest (that one resized to its own
    # size), concatenated, fused by a 1x1 conv, ReLU
    g = zoo.GraphBuilder("seg_head", seed=0)
    scales = [g.input(f"s{i}", [1, 8, 16 >> i, 16 >> i]) for i in range(3)]
    up = [g.node("Resize", [x, "", "", g.const(np.array([1, 8, 16, 16], np.int64))], mode="linear")
          for x in scales]
    g.output(g.relu(g.conv(g.node("Concat", up, axis=1), 24, 6, 1)), [1, 6, 16, 16])
    onnx.save(g.model(), str(tmp_path / "head.onnx"))
    model = frontend.load(tmp_path / "head.onnx")
    assert not graphopt.uses_op(model.mod, "relax.concat")
    convs = sorted(k.extents[2:4] for k in kernels.extract(model.mod) if "conv" in k.anchor_op)
    assert convs == [[4, 4], [8, 8], [16, 16]], convs  # each at its own scale
    ex = runtime.compile_model(model, make_target())
    res = runtime.check_against_onnxruntime(runtime.CompiledModel.from_executable(ex, model), model)
    assert res.ok and res.max_abs_error < 1e-4


def _old_exporters_upsampling(opset: int) -> onnx.ModelProto:
    """A conv net as exporters of the ONNX Model Zoo's era wrote it: an opset-9 Upsample, an
    opset-10 Resize(X, scales), or an opset-11 Resize whose roi and scales are empty constants
    beside its sizes; Slice with attribute bounds (opset 9), Flatten and Gemm."""
    g = zoo.GraphBuilder(f"old{opset}", seed=0)
    x = g.relu(g.conv(g.input("data", [1, 3, 16, 16]), 3, 8, 3, 2))
    scales = g.const(np.array([1, 1, 2, 2], np.float32))
    if opset == 9:
        x = g.node("Upsample", [x, scales], mode="linear")
        x = g.node("Slice", [x], starts=[1, 1], ends=[15, 15], axes=[2, 3])
    elif opset == 10:
        x = g.node("Resize", [x, scales], mode="linear")
    else:
        empty = g.const(np.zeros(0, np.float32))
        x = g.node("Resize", [x, empty, empty, g.const(np.array([1, 8, 16, 16], np.int64))], mode="linear")
    x = g.node("Flatten", [g.node("GlobalAveragePool", [g.relu(g.conv(x, 8, 8, 3))])])
    g.output(g.node("Gemm", [x, g.weight((5, 8), 0.3), g.weight((5,), 0.1)], transB=1), [1, 5])
    m = g.model()
    m.opset_import[0].version = opset
    return m


@pytest.mark.parametrize("opset", [9, 10, 11])
def test_old_opset_exports_compile_as_the_spec_means_them(tmp_path, opset):
    onnx.checker.check_model(_old_exporters_upsampling(opset), full_check=True)
    onnx.save(_old_exporters_upsampling(opset), str(tmp_path / "old.onnx"))
    model = frontend.load(tmp_path / "old.onnx")
    assert graphopt.uses_op(model.mod, "relax.image.resize2d")
    ex = runtime.compile_model(model, make_target())
    # onnxruntime runs the file as given: an opset-10 Resize read as (X, roi) would not match
    res = runtime.check_against_onnxruntime(runtime.CompiledModel.from_executable(ex, model), model)
    assert res.ok and res.max_abs_error < 1e-4


def test_a_sequence_first_attention_runs_its_projections_as_rows_and_its_scores_on_whole_vectors(tmp_path):
    # torchvision's attention, as torch.onnx writes it: tokens first ([L, B, E]), the
    # projections by [E, 3E] weights, and Q K^T over 50 tokens (ViT-B/32)
    g = zoo.GraphBuilder("seq_first", seed=0)
    x = g.input("tokens", [50, 1, 32])
    qkv = g.linear(x, 32, 96)  # [50, 1, 96]
    q, k = (g.reshape(g.node("Slice", [qkv, g.const(np.array([a], np.int64)), g.const(np.array([a + 32], np.int64)),
                                       g.const(np.array([2], np.int64))]), [1, 50, 32]) for a in (0, 32))
    scores = g.node("Softmax", [g.node("MatMul", [q, g.node("Transpose", [k], perm=[0, 2, 1])])], axis=-1)
    out = g.node("Gemm", [g.reshape(g.node("MatMul", [scores, q]), [50, 32]), g.weight((32, 32), 0.1)])
    g.output(out, [50, 32])
    onnx.save(g.model(), str(tmp_path / "attn.onnx"))
    model = frontend.load(tmp_path / "attn.onnx")
    matmuls = sorted((k.workload_class, k.extents) for k in kernels.extract(model.mod) if k.anchor_op == "matmul")
    assert matmuls == [("matmul", [1, 50, 32, 32]),  # the 2-D Gemm, as rows
                       ("matmul", [1, 50, 32, 50]),  # scores x values
                       ("matmul+add", [1, 50, 96, 32]),  # not 50 products of one row
                       # the scores' 50 columns padded to 64 and sliced back
                       ("matmul+strided_slice_with_axes", [1, 50, 64, 32])], matmuls
    ex = runtime.compile_model(model, make_target())
    res = runtime.check_against_onnxruntime(runtime.CompiledModel.from_executable(ex, model), model)
    assert res.ok and res.max_abs_error < 1e-4


def test_gpt2s_tanh_gelu_cubes_by_products_not_by_powf(tmp_path):
    # GELU as GPT-2 writes it: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), after a linear
    g = zoo.GraphBuilder("gelu_new", seed=0)
    x = g.linear(g.input("x", [1, 16, 32]), 32, 64)
    cube = g.node("Pow", [x, g.const(np.array(3.0, np.float32))])
    inner = g.node("Mul", [g.node("Add", [x, g.node("Mul", [cube, g.const(np.array(0.044715, np.float32))])]),
                           g.const(np.array(0.7978845608, np.float32))])
    half = g.node("Mul", [x, g.const(np.array(0.5, np.float32))])
    y = g.node("Mul", [half, g.node("Add", [g.node("Tanh", [inner]), g.const(np.array(1.0, np.float32))])])
    g.output(g.node("Sqrt", [g.node("Pow", [g.node("Abs", [y]), g.const(np.array(2.0, np.float32))])]), [1, 16, 64])
    onnx.save(g.model(), str(tmp_path / "gelu.onnx"))
    model = frontend.load(tmp_path / "gelu.onnx")
    assert not graphopt.uses_op(model.mod, "relax.power")
    ex = runtime.compile_model(model, make_target())
    res = runtime.check_against_onnxruntime(runtime.CompiledModel.from_executable(ex, model), model)
    assert res.ok and res.max_abs_error < 1e-4


def _vocab_head(path, classes: int):
    """A recogniser's or language model's last layer: a linear map onto ``classes`` outputs."""
    g = zoo.GraphBuilder("head", seed=0)
    x = g.input("features", [1, 40, 96])
    g.output(g.linear(x, 96, classes), [1, 40, classes])
    onnx.save(g.model(), str(path))
    return path


@pytest.mark.parametrize("classes,padded", [(6625, 6656), (1001, 1008), (1000, 1000)])
def test_a_vocabulary_that_fills_no_whole_vector_is_padded_and_outputs_still_match(tmp_path, classes,
                                                                                    padded):
    # MetaSchedule tiles by exact divisors: 6625 or GPT-2's 50257 columns leave no vector-wide
    # inner tile, so the weight gets zero columns and the output is sliced back
    model = frontend.load(_vocab_head(tmp_path / "h.onnx", classes))
    (head,) = [k for k in kernels.extract(model.mod) if k.anchor_op == "matmul"]
    assert head.extents[-2] == padded, head.extents  # the output columns' loop
    assert ("strided_slice" in head.workload_class) == (padded != classes)
    ex = runtime.compile_model(model, make_target())
    res = runtime.check_against_onnxruntime(runtime.CompiledModel.from_executable(ex, model), model)
    assert res.ok and res.max_abs_error < 1e-4


def test_tuning_registers_only_the_cpus_own_tensor_intrinsics():
    # MetaSchedule's TuneContext imports every backend's intrinsics (30 s and more); a CPU
    # target needs only its ISA's, and a later full import must still be possible
    code = (
        "import sys\n"
        "from tvm.s_tir import TensorIntrin, meta_schedule as ms\n"
        "from ttrank.target import cpu_tensor_intrinsics, isa_intrinsics_module, make_target\n"
        "t = make_target()\n"
        "with cpu_tensor_intrinsics(t):\n"
        "    ms.TuneContext(target=t)\n"
        "x86 = isa_intrinsics_module(t) == 'x86'\n"
        "print('tvm.s_tir.tensor_intrin.cuda' in sys.modules, 'tvm.s_tir.tensor_intrin' in sys.modules,\n"
        "      not x86 or TensorIntrin.get('dot_16x4_vnni') is not None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True"]
    aarch64 = make_target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"})
    assert isa_intrinsics_module(aarch64) == "arm_cpu"
    assert isa_intrinsics_module(None) is None


class _Timed:
    """A contender whose successive timings are given (ms); the last one repeats."""

    def __init__(self, times: list[float]):
        self.times, self.calls = list(times), 0

    def timer(self, feed, min_repeat_ms: int = 0):
        def one_round() -> float:
            self.calls += 1
            return self.times[min(self.calls, len(self.times)) - 1]
        return one_round


class _NoInputs:
    def random_inputs(self) -> dict:
        return {}


def test_alternate_timing_goes_on_while_a_noisy_stretch_passes():
    steady, recovering = _Timed([5.0]), _Timed([10.0, 9.0, 8.0, 5.0])
    best = runtime.alternate_ms(_NoInputs(), {"a": steady, "b": recovering}, rounds=3, onnxruntime=False)
    assert best == {"a": 5.0, "b": 5.0}
    # the last gain came in the fourth round; three rounds without one then end it
    assert steady.calls == recovering.calls == 7
    quiet = _Timed([5.0])
    runtime.alternate_ms(_NoInputs(), {"q": quiet}, rounds=3, onnxruntime=False)
    assert quiet.calls == 3
    falling = _Timed([100.0 - i for i in range(50)])
    runtime.alternate_ms(_NoInputs(), {"f": falling}, rounds=3, onnxruntime=False)
    assert falling.calls == 9  # at most 3x the rounds asked


def test_every_name_the_package_uses_is_defined():
    """pyflakes over the package and train.py: a name dropped from an import fails here in
    seconds, not half an hour into a training run that reaches it."""
    from pathlib import Path

    from pyflakes import messages
    from pyflakes.api import checkPath
    from pyflakes.reporter import Reporter

    class Undefined(Reporter):
        def __init__(self):
            self.found: list[str] = []

        def flake(self, message):
            if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
                self.found.append(str(message))

        def syntaxError(self, filename, msg, lineno, offset, text):
            self.found.append(f"{filename}:{lineno}: {msg}")

        def unexpectedError(self, filename, msg):
            self.found.append(f"{filename}: {msg}")

    root = Path(__file__).resolve().parents[1]
    report = Undefined()
    for path in [*sorted((root / "ttrank").glob("*.py")), root / "train.py"]:
        checkPath(str(path), report)
    assert report.found == []
