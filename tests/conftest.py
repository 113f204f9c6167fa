"""Shared fixtures: tiny zoo models written to a temp folder, and odd ONNX files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

# One runtime thread: the tiny kernels here run in microseconds, and a parallel one whose second
# thread waits for a core that another job holds is timed in milliseconds (the tests compare
# latencies and must not depend on what else the machine runs). Set before ttrank sets its default.
os.environ.setdefault("TVM_NUM_THREADS", "1")
os.environ.setdefault("TTRANK_CACHE", str(Path(__file__).parent.parent / ".pytest-cache-ttrank"))
# the tests check what the code does with its measurements, not how quiet the machine was: on a
# busy CI machine every row would count as disturbed (measurements.disturbed) and the tables empty
os.environ.setdefault("TTRANK_DISTURBED_CORES", "inf")

from ttrank import collect, donors, frontend, measure, zoo  # noqa: E402
from ttrank.features import FEATURE_NAMES  # noqa: E402
from ttrank.ranker import Ranker  # noqa: E402


DONOR_KERNELS = ["fused_conv2d1_add1_relu1", "fused_conv2d4_add3", "fused_matmul_add8"]


@pytest.fixture(scope="session")
def target():
    from ttrank.target import make_target

    return make_target()


@pytest.fixture(scope="session")
def donor_dir(tmp_path_factory) -> Path:
    """A real MetaSchedule database: three tiny_resnet kernels, 6 trials each."""
    from ttrank.cli import main

    out = tmp_path_factory.mktemp("donors") / "tiny_resnet"
    rc = main(["tune", "zoo:tiny_resnet", "--out", str(out), "--trials-per-task", "6",
               "--only", *DONOR_KERNELS, "--no-progress"])
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_cnn(model_dir) -> Path:
    return zoo.export("tiny_cnn", model_dir / "tiny_cnn.onnx")


@pytest.fixture(scope="session")
def tiny_bert(model_dir) -> Path:
    return zoo.export("tiny_bert", model_dir / "tiny_bert.onnx")


def paddle_style_model(path: Path) -> Path:
    """A CNN with dynamic batch/height/width whose Reshape target is computed from Shape,
    as Paddle2ONNX and torch.onnx exports produce: TVM's importer needs constant folding."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(0, 0.2, (8, 3, 3, 3)).astype(np.float32), "w")
    fcw = numpy_helper.from_array(rng.normal(0, 0.2, (8, 4)).astype(np.float32), "fcw")
    idx0 = numpy_helper.from_array(np.array([0], np.int64), "idx0")
    idx1 = numpy_helper.from_array(np.array([1], np.int64), "idx1")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["g"]),
        helper.make_node("Shape", ["g"], ["s"]),
        helper.make_node("Gather", ["s", "idx0"], ["n"], axis=0),
        helper.make_node("Gather", ["s", "idx1"], ["ch"], axis=0),
        helper.make_node("Concat", ["n", "ch"], ["newshape"], axis=0),
        helper.make_node("Reshape", ["g", "newshape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "fcw"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "paddle_style",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [w, fcw, idx0, idx1])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def channel_split_model(path: Path) -> Path:
    """ShuffleNet's channel split as torch.onnx's legacy exporter writes ``x.chunk(2, dim=1)``:
    Slice bounds computed from Shape -> Gather -> Div, which TVM imports as dynamic slices."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(0, 0.2, (8, 3, 3, 3)).astype(np.float32), "w")
    w2 = numpy_helper.from_array(rng.normal(0, 0.2, (4, 4, 1, 1)).astype(np.float32), "w2")
    consts = {"one": [1], "two": [2], "zero": [0], "big": [2 ** 62]}
    inits = [w, w2, *(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items())]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Shape", ["c"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["ch"], axis=0),
        helper.make_node("Div", ["ch", "two"], ["half"]),
        helper.make_node("Slice", ["c", "zero", "half", "one"], ["left"]),
        helper.make_node("Slice", ["c", "half", "big", "one"], ["right"]),
        helper.make_node("Conv", ["right", "w2"], ["rc"]),
        helper.make_node("Relu", ["rc"], ["rr"]),
        helper.make_node("Concat", ["left", "rr"], ["y"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "channel_split", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


@pytest.fixture(scope="session")
def channel_split(model_dir) -> Path:
    return channel_split_model(model_dir / "channel_split.onnx")


@pytest.fixture(scope="session")
def paddle_style(model_dir) -> Path:
    return paddle_style_model(model_dir / "paddle_style.onnx")


@pytest.fixture(scope="session")
def lookup_kernel():
    """An embedding lookup's kernel: 128 int64 indices into a 1000-row table."""
    import tvm
    from tvm import te

    table = te.placeholder((1000, 64), "float32", "table")
    ids = te.placeholder((128,), "int64", "ids")
    rows = te.compute((128, 64), lambda i, j: table[ids[i], j], name="take")
    return tvm.IRModule({"main": te.create_prim_func([table, ids, rows])})


@pytest.fixture(scope="session")
def unsupported_op_model(model_dir) -> Path:
    node = helper.make_node("Det", ["x"], ["y"])
    graph = helper.make_graph([node], "det",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = model_dir / "det.onnx"
    onnx.save(m, str(path))
    return path


def _collect_tiny_cnn(donor_dir, tiny_cnn, target, out, max_per_kernel: int = 12,
                      paper: bool = True, rounds: int = 3) -> collect.CollectStats:
    """``rounds``: passes over each batch (1 when only what gets measured matters, not how fast)."""
    store = donors.DonorStore.load([donor_dir])
    m = measure.Measurer(target, measure.RunnerSpec(rounds=rounds))
    try:
        # tiny_resnet is also the "paper's" hand-picked donor: exact-class matches, tiles as-is
        return collect.collect("tiny_cnn", frontend.load(tiny_cnn), store, out, target, m,
                               max_per_kernel=max_per_kernel, paper_donor="tiny_resnet" if paper else None)
    finally:
        m.close()


@pytest.fixture(scope="session")
def measurements(donor_dir, tiny_cnn, target, tmp_path_factory) -> Path:
    """Real cross-measurements: tiny_resnet's schedules on tiny_cnn's kernels."""
    out = tmp_path_factory.mktemp("measurements")
    stats = _collect_tiny_cnn(donor_dir, tiny_cnn, target, out)
    assert stats.measured > 0 and stats.valid > 0
    return out


@pytest.fixture(scope="session")
def trained(measurements, donor_dir, tmp_path_factory) -> Path:
    store = donors.DonorStore.load([donor_dir])
    ds = collect.build_dataset([measurements], store)
    assert ds.X.shape[1] == len(FEATURE_NAMES) and len(ds.groups) >= 2
    path = tmp_path_factory.mktemp("models") / "ranker.json"
    Ranker(objective="rank:pairwise", n_estimators=40).fit(ds.X, ds.y, ds.groups).save(path, note="test")
    return path


def upsampling_head_model(path: Path) -> Path:
    """A conv, a 3x3 stride-2 transposed conv (no conv2d_transpose donor exists anywhere) and a
    softmax over a 2-D [rows, classes] view, as text recognisers end: the op variants of #18."""
    g = zoo.GraphBuilder("upsampling_head", seed=0)
    x = g.input("input", [1, 3, 16, 16])
    x = g.relu(g.conv(x, 3, 16, 3))
    x = g.relu(g.conv_transpose(x, 16, 8, 3, 2, 1))  # [1, 8, 31, 31]
    x = g.reshape(x, [8 * 31, 31])
    g.output(g.node("Softmax", [x], axis=-1), [8 * 31, 31])
    onnx.save(g.model(), str(path))
    return path


@pytest.fixture(scope="session")
def upsampling_head(model_dir) -> Path:
    return upsampling_head_model(model_dir / "upsampling_head.onnx")


@pytest.fixture(scope="session")
def softmax_head(model_dir) -> Path:
    """A text recogniser's last op: a softmax over [40 steps, 6625 characters] (no donor has one)."""
    g = zoo.GraphBuilder("softmax_head", seed=0)
    x = g.input("logits", [40, 6625])
    g.output(g.node("Softmax", [x], axis=-1), [40, 6625])
    path = model_dir / "softmax_head.onnx"
    onnx.save(g.model(), str(path))
    return path
