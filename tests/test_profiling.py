"""In-model profiles: ttrank's kernels and onnxruntime's nodes, each timed inside its own model
run and summed by op class (`ttrank compile --profile`)."""

import json

import pytest

from ttrank.cli import main
from ttrank.kernels import Kernel
from ttrank.profiling import (RUNTIME_CLASS, Profile, conv_flops, conv_geometry, conv_label, conv_table, ort_class,
                              tvm_class)


def _kernel(name: str, weight_shape: list[int], depthwise: bool = False) -> Kernel:
    return Kernel(name=name, workload_class="", anchor_op="", iter_kinds="", extents=[], epilogue=[],
                  attrs={"depthwise": depthwise}, input_shapes=[[1, 8, 14, 14, 8], weight_shape],
                  output_shape=[], dtype="float32", flops=0.0)


def test_ttrank_kernels_are_classed_by_op_and_kernel_size():
    packed_3x3 = _kernel("fused_conv2d_NCHWc16_add9_relu7", [32, 8, 3, 3, 8, 8])
    assert tvm_class(packed_3x3.name, packed_3x3) == "conv 3x3"
    assert tvm_class("fused_conv2d_NCHWc16_add9_relu7") == "conv"  # without its kernel: the name
    dw = _kernel("fused_depthwise_conv2d_NCHWc3_add4_relu", [8, 1, 5, 5, 1, 8])
    assert tvm_class(dw.name, dw) == "depthwise 5x5"
    assert tvm_class("fused_conv2d_transpose_add") == "conv transpose"
    assert tvm_class("fused_matmul_add16") == "matmul"
    assert tvm_class("max_pool2d") == tvm_class("mean3") == "pool/reduce"
    assert tvm_class("fused_layout_transform3_reshape") == "layout"
    assert tvm_class("vm.builtin.alloc_tensor") == RUNTIME_CLASS
    assert tvm_class("fused_add_multiply_tir_sigmoid") == "other"


def test_onnxruntime_nodes_are_classed_alike():
    assert ort_class({"op": "FusedConv", "inputs": [[1, 64, 56, 56], [64, 64, 3, 3]]}) == "conv 3x3"
    assert ort_class({"op": "Conv", "inputs": [[1, 32, 56, 56], [32, 1, 3, 3]]}) == "depthwise 3x3"
    # onnxruntime's own packed layout: channels in blocks of 8, the weights as in the file
    assert ort_class({"op": "NchwcConv", "inputs": [[1, 4, 56, 56, 8], [32, 1, 5, 5]]}) == "depthwise 5x5"
    assert ort_class({"op": "Conv", "inputs": [[1, 3, 224, 224], [16, 1, 3, 3]]}) == "conv 3x3"  # not depthwise
    assert ort_class({"op": "FusedGemm", "inputs": [[1, 9216], [4096, 9216]]}) == "matmul"
    assert ort_class({"op": "GlobalAveragePool", "inputs": [[1, 64, 7, 7]]}) == "pool/reduce"
    assert ort_class({"op": "ReorderInput", "inputs": [[1, 64, 7, 7]]}) == "layout"
    assert ort_class({"op": "Sigmoid", "inputs": [[1, 64, 7, 7]]}) == "other"


def test_a_conv_has_one_geometry_in_both_engines_layouts():
    # ttrank's packed kernel and onnxruntime's NCHWc node for ResNet-50's stride-2 3x3 conv
    tvm = conv_geometry([1, 32, 14, 14, 8], [64, 32, 3, 3, 8, 8], [1, 64, 7, 7, 8])
    ort = conv_geometry([1, 32, 14, 14, 8], [512, 256, 3, 3], [1, 64, 7, 7, 8])
    assert tvm == ort and conv_label(tvm) == "256x14x14 -> 512x7x7 3x3"
    assert conv_flops(tvm) == 2 * 512 * 256 * 9 * 7 * 7
    # depthwise: one in-channel per group, in either layout
    dw = conv_geometry([1, 4, 56, 56, 8], [4, 1, 3, 3, 1, 8], [1, 4, 56, 56, 8])
    assert dw == conv_geometry([1, 32, 56, 56], [32, 1, 3, 3], [1, 32, 56, 56])
    assert dw["groups"] == 32 and conv_label(dw).endswith("depthwise")
    assert conv_geometry([1, 9216], [4096, 9216], [1, 4096]) is None  # a matmul


def test_convs_are_paired_by_geometry_and_the_largest_gap_comes_first():
    g1 = conv_geometry([1, 256, 56, 56], [64, 256, 1, 1], [1, 64, 56, 56])
    g2 = conv_geometry([1, 64, 56, 56], [64, 64, 3, 3], [1, 64, 56, 56])
    g3 = conv_geometry([1, 3, 224, 224], [64, 3, 7, 7], [1, 64, 112, 112])
    tt = Profile("ttrank", 10.0, [
        {"name": "fused_conv2d_add_relu", "op_class": "conv 1x1", "calls": 1, "ms": 1.5, "conv": g1},
        {"name": "fused_conv2d_add_add_relu", "op_class": "conv 1x1", "calls": 1, "ms": 1.7, "conv": g1},
        {"name": "fused_conv2d1_add1_relu1", "op_class": "conv 3x3", "calls": 3, "ms": 3.0, "conv": g2},
        {"name": "fused_conv2d2_add2", "op_class": "conv 7x7", "calls": 1, "ms": 2.0, "conv": g3}])
    ort = Profile("onnxruntime", 8.0, [
        {"name": "conv_1", "op_class": "conv 1x1", "calls": 1, "ms": 0.8, "conv": g1},
        {"name": "conv_2", "op_class": "conv 1x1", "calls": 1, "ms": 0.8, "conv": g1},
        {"name": "conv_3", "op_class": "conv 3x3", "calls": 1, "ms": 2.9, "conv": g2},
        {"name": "relu_4", "op_class": "other", "calls": 1, "ms": 0.1, "conv": None}])
    rows = conv_table({"ttrank": tt, "onnxruntime": ort})
    # the 7x7 conv has no partner; the 1x1 convs' two kernels and two nodes are summed
    assert [r["conv"] for r in rows] == ["256x56x56 -> 64x56x56 1x1", "64x56x56 -> 64x56x56 3x3"]
    one = rows[0]
    assert one["ttrank_calls"] == one["onnxruntime_nodes"] == 2 and one["ratio"] == pytest.approx(3.2 / 1.6)
    assert sorted(one["kernels"]) == ["fused_conv2d_add_add_relu", "fused_conv2d_add_relu"]
    assert one["onnxruntime_gflops"] == pytest.approx(2 * conv_flops(g1) / 1.6e-3 / 1e9)


def test_compile_profile_shows_where_the_time_goes(donor_dir, tmp_path, capsys):
    js = tmp_path / "profile.json"
    assert main(["compile", "zoo:tiny_resnet", "--database", str(donor_dir), "-o", str(tmp_path / "r.so"),
                 "--profile", "--profile-json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "by op class" in out and "heaviest kernels" in out
    prof = json.loads(js.read_text())
    classes = {r["op_class"]: r for r in prof["classes"]}
    # the ResNet's 3x3 convs and its classifier, on both sides
    for c in ("conv 3x3", "matmul"):
        assert classes[c]["ttrank_ms"] > 0 and classes[c]["onnxruntime_ms"] > 0, c
    assert classes["conv 3x3"]["ratio"] == pytest.approx(
        classes["conv 3x3"]["ttrank_ms"] / classes["conv 3x3"]["onnxruntime_ms"])
    # the kernels were timed inside the runs: together, no longer than a run
    assert 0 < prof["ttrank"]["kernels_ms"] <= prof["ttrank"]["run_ms"]
    # and the same model without the hook, to see what profiling costs
    assert prof["ttrank"]["plain_run_ms"] > 0 and "profiling cost" in out
    assert classes["whole run"]["ttrank_ms"] == pytest.approx(prof["ttrank"]["run_ms"], abs=1e-3)
    assert prof["provenance"]["mcpu"]
    # each tuned conv beside onnxruntime's node for the same conv
    assert "convs beside onnxruntime's same convs" in out
    convs = prof["convs"]
    assert convs and all(r["ttrank_ms"] > 0 and r["onnxruntime_ms"] > 0 and r["kernels"] for r in convs)
    assert sum(r["ttrank_calls"] for r in convs) <= sum(
        c["ttrank_calls"] for c in prof["classes"] if c["op_class"].startswith("conv "))


def test_an_untuned_compile_compares_its_convs_as_one_class(tiny_cnn, tmp_path, capsys):
    """Untuned, TVM runs other (unfused) kernels than the extracted ones, so their sizes are
    unknown: all convs, depthwise too, are then one class on both sides."""
    js = tmp_path / "profile.json"
    assert main(["compile", str(tiny_cnn), "-o", str(tmp_path / "cnn.so"), "--profile-json", str(js)]) == 0
    classes = {r["op_class"]: r for r in json.loads(js.read_text())["classes"]}
    assert classes["conv"]["ttrank_ms"] > 0 and classes["conv"]["onnxruntime_nodes"] == 5
    assert not [c for c in classes if c.startswith(("conv ", "depthwise"))]


def test_profile_needs_the_check_it_runs_beside(tiny_cnn, tmp_path, capsys):
    assert main(["compile", str(tiny_cnn), "-o", str(tmp_path / "cnn.so"), "--profile", "--no-check"]) != 0
    assert "drop --no-check" in capsys.readouterr().err
    assert not (tmp_path / "cnn.so").exists()
