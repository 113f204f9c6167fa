"""A model in the packed NCHW[x]c layout, end to end: tuned into donors, transferred, compiled."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from tvm import relax

from ttrank import coverage, donors, frontend, kernels, layouts, runtime, zoo
from ttrank.cli import main
from ttrank.errors import ModelLoadError
from ttrank.graphopt import transform_constant
from ttrank.target import make_target
from ttrank.workdir import read_manifest


@pytest.fixture(scope="module")
def packed_donors(tiny_cnn, tmp_path_factory) -> Path:
    """Donors tuned in the packed layout: one of tiny_cnn's dense packed convs (its schedules are
    every dense packed conv's candidates) and its depthwise one, a few trials each."""
    out = tmp_path_factory.mktemp("packed") / "tiny_cnn@nchwc"  # a donor set of network tiny_cnn
    assert main(["tune", str(tiny_cnn), "--layout", "nchwc", "--out", str(out), "--trials-per-task", "6",
                 "--only", "fused_conv2d_NCHWc1_add_relu", "fused_depthwise_conv2d_NCHWc", "--no-progress"]) == 0
    return out


def test_packed_layout_tunes_transfers_and_compiles(trained, tiny_cnn, packed_donors, tmp_path, capsys):
    assert read_manifest(packed_donors)["layout"] == "nchwc"
    store = donors.DonorStore.load([packed_donors])
    assert store.workloads and all("NCHWc" in w.kernel.anchor_op for w in store.workloads)

    # the folder holds a packed search: an NCHW run into it is refused, in one line
    capsys.readouterr()
    assert main(["tune", str(tiny_cnn), "--out", str(packed_donors), "--trials-per-task", "6",
                 "--no-progress"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "holds a nchwc tuning run" in errors[0]

    # recommend on the packed model: its packed convs take the packed donors' schedules, and the
    # compiled model (NCHW interface) matches onnxruntime
    report = tmp_path / "report.json"
    assert main(["recommend", str(tiny_cnn), "--layout", "nchwc", "-o", str(tmp_path / "cnn.so"),
                 "--ranker", str(trained), "--donors", str(packed_donors), "--json", str(report),
                 "--data-dir", str(tmp_path / "data"), "--top-k", "2", "--fixed-k", "--tune-missing", "0",
                 "--no-progress"]) == 0
    r = json.loads(report.read_text())
    assert r["provenance"]["layout"] == "nchwc"
    assert r["max_abs_error_vs_onnxruntime"] < 1e-3
    packed = [k for k in r["kernels"] if "NCHWc" in k["workload_class"]]
    assert packed and all(k["candidates"] > 0 for k in packed)
    assert any(k["status"] == "tuned" for k in packed)
    # a dense packed conv (3x3, ...) of a shape no donor was tuned on, given more than one candidate, also
    # gets template schedules measured beside the donors' (ttrank.templates); a conv of the
    # shape the donors were tuned on gets none
    def templates_measured(k: dict) -> int:
        return sum(m["donor"].startswith("template/") for m in k["measured"])

    shapes = {tuple(w.kernel.extents) for w in store.workloads}  # the donors were tuned on these
    dense = [k for k in packed if k["workload_class"].startswith("conv2d_NCHWc")]
    assert not any(templates_measured(k) for k in dense if tuple(k["extents"]) in shapes)
    others = [k for k in dense if tuple(k["extents"]) not in shapes and k["top_k"] > 1
              and k["extents"][6] * k["extents"][7] > 1]  # a window: 1x1 convs keep their donors
    assert others and all(templates_measured(k) for k in others)

    # the same model as exported has no packed kernel: NCHW and packed schedules never mix
    plain = kernels.extract(zoo.load(str(tiny_cnn)).mod, make_target())
    assert not any("NCHWc" in k.anchor_op for k in plain)


def test_auto_layout_packs_only_what_the_store_covers(donor_dir, tiny_cnn, tiny_bert, packed_donors, tmp_path,
                                                     target, monkeypatch):
    as_imported = zoo.load(str(tiny_cnn))

    # NCHW donors only: the model stays as exported
    model, why = coverage.choose_layout(as_imported, donors.DonorStore.load([donor_dir]), target)
    assert model.layout == "nchw" and why == "no packed-conv donors in the store"
    # packed donors for its convs (a few trials of the model's own packed convs)
    store = donors.DonorStore.load([donor_dir, packed_donors])
    model, why = coverage.choose_layout(as_imported, store, target)
    assert model.layout == "nchwc" and why.startswith("packed donors cover all")
    # packed from the one import, and its kernels extracted once (recommend reuses them)
    assert model.onnx_model is as_imported.onnx_model and model.kernel_cache
    # a model without convs stays as it is, before any packing or extraction
    bert = zoo.load(str(tiny_bert))
    assert coverage.choose_layout(bert, store, target) == (bert, "no conv to pack") and not bert.kernel_cache
    # a conv the packing cannot reach (4 channels a group) stays NCHW inside a packed model while
    # it holds little of the conv FLOPs; a model whose unreachable convs hold more stays NCHW
    grouped = zoo.load(str(_grouped_model(tmp_path / "grouped.onnx")))
    model, why = coverage.choose_layout(grouped, store, target)
    assert model.layout == "nchwc", why
    model, why = coverage.choose_layout(grouped, store, target, max_unpacked=0.01)
    assert model.layout == "nchw" and "1 of its 4 convs" in why and "have no packed form" in why
    # leaving the network out leaves its packed set out too
    model, _ = coverage.choose_layout(as_imported, store, target, exclude_networks={"tiny_cnn"})
    assert model.layout == "nchw"
    # packed donors for the dense convs only: those are packed, the depthwise conv stays NCHW
    # (its NCHW donors cover it), and the compiled model still matches onnxruntime
    no_depthwise = donors.DonorStore([w for w in store.workloads
                                      if layouts.PACKED_DEPTHWISE not in w.kernel.anchor_op])
    model, why = coverage.choose_layout(as_imported, no_depthwise, target)
    assert model.layout == "nchwc-dense" and "1 depthwise convs, with no packed donor, stay NCHW" in why
    ks = kernels.model_kernels(model, target)
    assert any(k.anchor_op.endswith(layouts.PACKED_CONV) for k in ks)
    assert not any(layouts.PACKED_DEPTHWISE in k.anchor_op for k in ks)
    assert any(k.anchor_op == "group_conv2d_nchw" for k in ks)
    assert all(no_depthwise.compatible(k) for k in ks if layouts.PACKED_CONV in k.anchor_op)
    compiled = runtime.CompiledModel.from_executable(runtime.compile_model(model, target), model)
    assert runtime.check_against_onnxruntime(compiled, model).max_abs_error < 1e-4

    # a graph the packing pass cannot rewrite: one clear error when asked for, NCHW with auto
    def cannot(mod, target=None):
        raise RuntimeError("unsupported conv")

    monkeypatch.setitem(layouts.LAYOUTS, "nchwc", cannot)
    with pytest.raises(ModelLoadError, match="cannot put its convolutions in the nchwc layout"):
        zoo.load(str(tiny_cnn), layout="nchwc")
    model, why = coverage.choose_layout(as_imported, store, target)
    assert model.layout == "nchw" and why.startswith("its convs cannot be packed")


def test_weight_and_bias_transforms_are_folded_at_load_as_compiling_would(tiny_cnn, target):
    """Packed weights and biases are constants as soon as the model is loaded: compiling
    leaves nothing for FoldConstant to build with LLVM, and the numbers are TVM's own."""
    packed = frontend.load(tiny_cnn, layout="nchwc", target=target)
    with target, tvm.transform.PassContext(opt_level=3):
        legal = relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(packed.mod))
        folded = relax.transform.FoldConstant()(legal)
    # every reshape and layout transform of the legalized model is still there: none moved
    # only constants (before, each bias was reshaped and packed by calls that FoldConstant
    # built with LLVM and ran)
    def moves(mod) -> int:
        return len(re.findall(r"R\.call_tir\((layout_transform|reshape)", str(mod["main"])))

    assert moves(folded) == moves(legal) > 0

    # numpy's transform is IndexMap's, on a weight with both channel counts blocked
    w = np.random.default_rng(0).standard_normal((32, 24, 3, 3)).astype("float32")
    imap = tvm.tirx.IndexMap.from_func(lambda o, i, h, w_: (o // 16, i // 8, h, w_, i % 8, o % 16),
                                       index_dtype="int64")
    assert np.array_equal(transform_constant(w, imap), imap.map_tensor(tvm.runtime.tensor(w)).numpy())
    # a map that pads is left to TVM
    pad = tvm.tirx.IndexMap.from_func(lambda o, i, h, w_: (o // 5, i, h, w_, o % 5), index_dtype="int64")
    assert transform_constant(w, pad) is None


def _grouped_model(path: Path) -> Path:
    """Two dense convs and two grouped ones: 16 channels a group (whole blocks of 8 and 16),
    and 4 a group (no packed form: it stays NCHW, with 5% of the conv FLOPs)."""
    g = zoo.GraphBuilder("grouped", seed=0)
    x = g.relu(g.conv(g.input("input", [1, 16, 14, 14]), 16, 64, 1))
    x = g.relu(g.conv(x, 64, 64, 3, groups=4))
    x = g.relu(g.conv(x, 64, 64, 3, stride=2, groups=16))
    g.output(g.conv(x, 64, 32, 1), [1, 32, 7, 7])
    onnx.save(g.model(), str(path))
    return path


@pytest.mark.parametrize("lanes", [8, 16])
def test_grouped_convs_are_packed_when_their_groups_hold_whole_blocks(tmp_path, target, lanes):
    """ResNeXt's 3x3 convs (32 groups of 16 channels and more): ``ConvertLayout`` packs them,
    and nothing in TVM legalizes a packed grouped conv. They become packed convs (a dense one's
    loops, so dense packed donors are candidates), and the compiled model matches onnxruntime."""
    model = frontend.load(_grouped_model(tmp_path / "grouped.onnx"))
    stats: dict = {}
    packed = dataclasses.replace(model, mod=layouts.pack_conv2d_nchwc(model.mod, target, lanes=lanes, stats=stats),
                                 layout="nchwc", kernel_cache={})
    assert stats["grouped"] == 1 and layouts.count_unpacked_convs(packed.mod) == 1
    assert sum(k.anchor_op.endswith(layouts.PACKED_CONV) for k in kernels.extract(packed.mod, target)) == 3
    ex = runtime.compile_model(packed, target)
    res = runtime.check_against_onnxruntime(runtime.CompiledModel.from_executable(ex, packed), packed)
    assert res.ok and res.max_abs_error < 1e-4


def _shuffle_branch(path: Path) -> Path:
    """ShuffleNetV2's branch on 116 channels (4 x 29: no block over 4): a 1x1 conv, ReLU, a 3x3
    depthwise conv, a 1x1 conv and ReLU, then a residual add that needs the true channels."""
    g = zoo.GraphBuilder("shuffle_branch", seed=0)
    x = g.input("input", [1, 116, 14, 14])
    y = g.relu(g.conv(x, 116, 116, 1))
    y = g.relu(g.conv(g.conv(y, 116, 116, 3, groups=116), 116, 116, 1))
    g.output(g.node("Add", [x, y]), [1, 116, 14, 14])
    onnx.save(g.model(), str(path))
    return path


def _xception_flow(path: Path) -> Path:
    """Xception's middle flow on 120 channels (blocks of 15 do not divide 16 lanes): a 1x1 conv
    and ReLU, a slice of its rows and columns (the padded rows a conv computes,
    :func:`ttrank.graphopt.pad_conv_outputs`), a max pool, a depthwise and a 1x1 conv, a
    hard-swish and a divide, a 1x1 conv and the residual add."""
    g = zoo.GraphBuilder("xception_flow", seed=0)
    x = g.input("input", [1, 120, 9, 9])

    def rows_and_columns(t: str) -> str:
        return g.node("Slice", [t, g.const(np.array([0, 0], np.int64)), g.const(np.array([8, 8], np.int64)),
                                g.const(np.array([2, 3], np.int64))])

    y = g.maxpool(rows_and_columns(g.relu(g.conv(x, 120, 120, 1))), 3, 1, 1)
    # MobileNetV3's hard-swish, and a divide by per-channel constants
    y = g.hardswish(g.conv(g.conv(y, 120, 120, 3, groups=120), 120, 120, 1))
    y = g.node("Div", [y, g.const(np.linspace(0.5, 2.0, 120, dtype=np.float32).reshape(1, 120, 1, 1))])
    y = g.conv(y, 120, 120, 1)
    g.output(g.add(rows_and_columns(x), y), [1, 120, 8, 8])
    onnx.save(g.model(), str(path))
    return path


def test_padded_channels_stay_padded_through_slices_pools_and_elementwise_ops(tmp_path, target):
    """The zero channels flow on through what keeps each channel to itself (slices of rows and
    columns, pools, element-wise ops that cannot make a NaN of a zero), so the data stays in
    whole blocks of 16 from conv to conv: no layout transform between them."""
    model = frontend.load(_xception_flow(tmp_path / "flow.onnx"))
    packed = dataclasses.replace(model, mod=layouts.pack_conv2d_nchwc(model.mod, target, lanes=16),
                                 layout="nchwc", kernel_cache={})
    ks = kernels.extract(packed.mod, target)
    convs = [k for k in ks if "NCHWc" in k.anchor_op]
    assert [k.extents[1] * k.extents[4] for k in convs] == [128, 128, 128, 128], [k.extents for k in convs]
    # the input's and the output's transforms only
    assert sum("layout_transform" in k.workload_class for k in ks) <= 2, [k.name for k in ks]
    ex = runtime.compile_model(packed, target)
    res = runtime.check_against_onnxruntime(runtime.CompiledModel.from_executable(ex, packed), packed)
    assert res.ok and res.max_abs_error < 1e-4


def test_convs_whose_channels_block_badly_compute_whole_blocks_of_zeros(tmp_path, target):
    # blocks of 4 and 2 channels, or of 14 and 15 that do not divide 16 lanes, if that adds at most 1/8
    assert [layouts.padded_channels(c, 16) for c in (116, 58, 728, 120, 232, 24, 40, 128)] == \
        [128, 64, 736, 128, 232, 24, 40, 128]
    assert [layouts.padded_channels(c, 8) for c in (116, 58, 728, 120)] == [116, 64, 728, 120]
    model = frontend.load(_shuffle_branch(tmp_path / "branch.onnx"))
    packed = dataclasses.replace(model, mod=layouts.pack_conv2d_nchwc(model.mod, target, lanes=16),
                                 layout="nchwc", kernel_cache={})
    convs = [k for k in kernels.extract(packed.mod, target) if "NCHWc" in k.anchor_op]
    # three convs, each over 8 blocks of 16 channels: 128, 12 of them zero weights
    assert [k.extents[1] * k.extents[4] for k in convs] == [128, 128, 128], [k.extents for k in convs]
    ex = runtime.compile_model(packed, target)
    res = runtime.check_against_onnxruntime(runtime.CompiledModel.from_executable(ex, packed), packed)
    assert res.ok and res.max_abs_error < 1e-4
