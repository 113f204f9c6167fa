"""The packed NCHW[x]c conv lever (ttrank.layouts) and the kernel-gap benchmark's plumbing
(ttrank.kernelgap)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ttrank import frontend, kernels, layouts, runtime
from ttrank import kernelgap as kg
from ttrank.target import make_target
from ttrank.zoo import GraphBuilder


@pytest.fixture(scope="module")
def packed_net(tmp_path_factory):
    """The tiny net as imported, and packed (lanes 16 whatever the host's vector width)."""
    lm = _tiny_conv_net(tmp_path_factory.mktemp("pack"))
    stats: dict = {}
    packed = layouts.pack_conv2d_nchwc(lm.mod, target=make_target(), lanes=16, stats=stats)
    return lm, packed, stats


def _tiny_conv_net(tmp_path: Path):
    """A conv net with every case the pass handles: 16-divisible convs (propagated packing,
    bias and ReLU in the packed layout), a 1x1, a depthwise conv, and 3- and 8-channel convs
    (packed one by one with their own block sizes); between convs ReLU6 (ONNX Clip), max-pool,
    a CSP-style channel split and concat, SiLU (fast exp), squeeze-excitation (global mean and a
    per-channel product) and an upsampling resize, all of which should stay packed."""
    g = GraphBuilder("tiny_pack", seed=3)
    x = g.input("x", [1, 16, 12, 12])
    y = g.relu(g.conv(x, 16, 32, 3, 1))
    y = g.conv(y, 32, 32, 1, 1, 0)
    y = g.relu6(g.conv(y, 32, 32, 3, 1, groups=32))
    y = g.maxpool(y, 2, 2)
    halves = [g.node("Slice", [y, g.const(np.array([a], np.int64)), g.const(np.array([a + 16], np.int64)),
                               g.const(np.array([1], np.int64))]) for a in (0, 16)]
    y = g.concat([halves[1], g.silu(g.conv(halves[0], 16, 16, 3, 1))])
    se = g.node("Sigmoid", [g.conv(g.relu(g.conv(g.gap(y), 32, 8, 1, 1, 0)), 8, 32, 1, 1, 0)])
    y = g.resize(g.node("Mul", [y, se]), 2.0)
    s = g.conv(x, 16, 3, 1, 1, 0)
    s = g.relu(g.conv(s, 3, 8, 3, 2))
    g.output(y)
    g.output(s)
    path = tmp_path / "tiny_pack.onnx"
    path.write_bytes(g.model().SerializeToString())
    return frontend.load(str(path))


def test_nchwc_pass_keeps_outputs_and_yields_packed_conv_tasks(packed_net):
    target = make_target()
    lm, packed, stats = packed_net
    assert stats["propagated"] >= 3 and stats["depthwise"] == 1 and stats["wrapped"] >= 2, stats
    # the data stays packed from the first conv to the last op: the activations are transformed
    # only at the model's input and outputs (two outputs: the resize's and the 8-channel conv's)
    transforms = [b.value.args[1].fields[0] for b in packed["main"].body.blocks[0].bindings
                  if _calls(b.value, "layout_transform")]
    activations = [t for t in transforms if len(t.ty.shape) == 4 and int(t.ty.shape[2]) > 1] + \
        [t for t in transforms if len(t.ty.shape) == 5 and int(t.ty.shape[2]) > 1]
    assert len(activations) <= 4, [str(t.ty) for t in activations]

    ks = kernels.extract(packed, target)
    names = [k.name for k in ks]
    assert any(n.startswith("fused_conv2d_NCHWc") for n in names), names  # conv + bias + relu
    assert any("depthwise_conv2d_NCHWc" in n for n in names), names  # with its ReLU6
    assert not any("conv2d_nchw" in k.anchor_op for k in ks)

    # the module keeps its NCHW interface; outputs equal onnxruntime's
    model = frontend.LoadedModel(lm.path, lm.onnx_model, lm.inputs, packed)
    cm = runtime.CompiledModel.from_executable(runtime.compile_model(model, target), model)
    feed = model.random_inputs(1)
    ref = runtime.onnxruntime_reference(model, feed)
    got = cm.run(feed)
    for g_, r in zip(got, ref):
        assert g_.shape == r.shape
        np.testing.assert_allclose(g_, r, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(r))))


def _calls(expr, name: str) -> bool:
    """Whether ``expr`` is a call_tir of a PrimFunc named ``name`` (or ``name`` + a number)."""
    return hasattr(expr, "args") and len(expr.args) >= 2 and \
        getattr(expr.args[0], "name_hint", "").rstrip("0123456789") == name


def test_packed_weights_fold_to_constants(packed_net):
    """After fusion no kernel transforms a weight: the packed weights are folded constants."""
    from tvm import ir

    fused = kernels.fuse(packed_net[1])
    consts = (ir.Constant, ir.GenericConst)
    packed_weights, packed_convs = 0, 0
    for b in fused["main"].body.blocks[0].bindings:
        call = b.value
        if not (hasattr(call, "args") and len(call.args) >= 2 and hasattr(call.args[0], "name_hint")):
            continue
        callee, args = call.args[0].name_hint, list(call.args[1].fields)
        if "layout_transform" in callee:  # one whose inputs are all constants was not folded
            assert not all(isinstance(a, consts) for a in args), f"{callee} transforms a constant"
        if "conv2d_NCHWc" in callee:
            packed_convs += 1
            packed_weights += any(isinstance(a, consts) and len(a.ty.shape) >= 5 for a in args)
    assert packed_convs == 8 and packed_weights == packed_convs  # each reads a packed constant weight


def test_a_swish_fuses_into_the_packed_conv_it_follows(tmp_path):
    """EfficientNet's MBConv: 1x1 expand conv + SiLU, depthwise conv + SiLU, 1x1 project conv,
    residual add. Packed, each SiLU is an epilogue of its conv; no sigmoid or product is left
    a kernel of its own (each would read and write the whole activation once more)."""
    g = GraphBuilder("mbconv", seed=0)
    x = g.input("x", [1, 16, 14, 14])
    y = g.silu(g.conv(x, 16, 32, 1, 1, 0))
    y = g.silu(g.conv(y, 32, 32, 3, 1, groups=32))
    g.output(g.add(x, g.conv(y, 32, 16, 1, 1, 0)))
    path = tmp_path / "mbconv.onnx"
    path.write_bytes(g.model().SerializeToString())
    packed = layouts.pack_conv2d_nchwc(frontend.load(str(path)).mod, target=make_target(), lanes=8)

    names = [k.name for k in kernels.extract(packed, make_target())]
    assert [n for n in names if "conv2d" not in n and "layout_transform" not in n] == [], names
    assert sum("conv2d_NCHWc" in n and "fast_exp" in n for n in names) == 2, names


def test_block_size_and_lanes():
    assert layouts.block_size(128, 16) == 16
    assert layouts.block_size(3, 16) == 3
    assert layouts.block_size(24, 16) == 12
    assert layouts.block_size(144, 16) == 16
    assert layouts.block_size(64, 16, cap=8) == 8
    # the packing block is the CPU's float lanes: AVX-512 16, AVX2 8 (whatever TVM's own
    # vector-width query says: 512 for every x86 CPU)
    lanes = {cpu: layouts.simd_lanes(make_target({"kind": "llvm", "mcpu": cpu}))
             for cpu in ("znver5", "emeraldrapids", "znver3", "haswell")}
    assert lanes == {"znver5": 16, "emeraldrapids": 16, "znver3": 8, "haswell": 8}


def test_kernel_gap_one_op_models_are_the_zoo_kernels():
    """The driver's one-op models rebuild the zoo's kernels exactly (same TIR hash)."""
    target = make_target()
    spec = kg.KERNELS["conv1x1"]
    lm = kg.load_onnx(kg.one_op_model(spec["op"]), "conv1x1")
    anchor, _ = kg.anchor_of(lm.mod, target)
    assert anchor.workload_class == spec["workload_class"] and anchor.extents == spec["extents"]
    packed_anchor, side = kg.anchor_of(kg.lever_module(lm, "nchwc", target)[0], target)
    assert "conv2d_NCHWc" in packed_anchor.name and side


@pytest.mark.parametrize("kind", ["conv", "dense"])
def test_onnxruntime_node_matching(kind):
    if kind == "conv":
        op = kg.KERNELS["conv3x3"]["op"]
        out = [[1, 128, 28, 28]]
        nodes = [{"op": "Conv", "inputs": [[1, 128, 28, 28], [128, 128, 3, 3], [128]], "outputs": out},
                 {"op": "Conv", "inputs": [[1, 128, 28, 28], [128, 128, 3, 3], [128], [1, 128, 28, 28]],
                  "outputs": out},
                 {"op": "Conv", "inputs": [[1, 128, 28, 28], [128, 128, 3, 3], [128]],
                  "outputs": [[1, 128, 14, 14]]},
                 {"op": "Conv", "inputs": [[1, 64, 56, 56], [128, 64, 3, 3], [128]], "outputs": out}]
        # the residual-sum node and the stride-2 node are other kernels
        assert kg.match_nodes(nodes, op) == nodes[:1]
    else:
        op = kg.KERNELS["dense"]["op"]
        nodes = [{"op": "Gemm", "inputs": [[256, 768], [768]], "outputs": [[256, 768]]},
                 {"op": "Gemm", "inputs": [[256, 768], [3072]], "outputs": [[256, 3072]]},
                 {"op": "MatMul", "inputs": [[1, 12, 256, 64], [1, 12, 64, 256]],
                  "outputs": [[1, 12, 256, 256]]}]
        assert kg.match_nodes(nodes, op) == nodes[:1]


def test_kernel_gap_summary_puts_every_cpu_in_one_table(tmp_path):
    """bench/results/kernel_gap.md: per kernel and lever, each CPU's time over onnxruntime's
    after the first batch and at the deepest point, and the lever's gain over plain NCHW."""
    def cell(curve):
        return {"curve": [{"trials": t, "best_ms": ms, "remeasured_ms": ms} for t, ms in curve]}

    def cpu(plain, packed):
        return {"kernels": {"conv3x3": {"ort": {"ort_node_ms": 2.0}}},
                "cells": {"conv3x3/depth": cell(plain), "conv3x3/nchwc": cell(packed)}, "networks": {}}

    (tmp_path / "kernel_gap_znver3.json").write_text(json.dumps(cpu([(64, 4.0), (128, 3.0)], [(64, 3.0), (128, 1.5)])))
    (tmp_path / "kernel_gap_znver5.json").write_text(json.dumps(cpu([(64, 2.0)], [(64, 1.0)])))
    text = kg.write_summary(tmp_path).read_text()
    assert "znver3: /ort 64 -> deepest" in text and "znver5: /ort 64 -> deepest" in text
    # znver3: packed 3.0 -> 1.5 ms against 2.0, twice as fast as NCHW at 128 trials; znver5: 0.5 at 64
    assert "| conv3x3 | nchwc | 1.50 -> 0.75 (128) | 2.00 | 0.50 -> 0.50 (64) | 2.00 |" in text
    assert "| conv3x3 | depth | 2.00 -> 1.50 (128) |  | 1.00 -> 1.00 (64) |  |" in text
    assert kg.write_summary(tmp_path / "nothing_here") is None
