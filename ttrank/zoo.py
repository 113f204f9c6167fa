"""Deterministic ONNX builders for the networks of the transfer-tuning paper.

Weights are seeded random (latency does not depend on their values), so no weight file is ever
committed: a network is rebuilt on demand, identically on every machine. Batch norms are folded
into the preceding convolution, as exporters do for inference graphs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import TTRankError

OPSET = 17


class GraphBuilder:
    """A small helper that appends ONNX nodes and seeded random initializers."""

    def __init__(self, name: str, seed: int = 0):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.rng = np.random.default_rng(seed)
        self._n = 0

    def fresh(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, value: np.ndarray, hint: str = "c") -> str:
        name = self.fresh(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, shape: tuple[int, ...], std: float, hint: str = "w") -> str:
        return self.const(self.rng.normal(0.0, std, size=shape).astype(np.float32), hint)

    def node(self, op: str, inputs: list[str], hint: str | None = None, **attrs) -> str:
        out = self.fresh(hint or op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def input(self, name: str, shape: list, elem=TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, value: str, shape: list | None = None, elem=TensorProto.FLOAT) -> None:
        self.outputs.append(helper.make_tensor_value_info(value, elem, shape))

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="ttrank.zoo")
        m.ir_version = 8
        return m

    # --- CNN layers -------------------------------------------------------------------------
    def conv(self, x: str, cin: int, cout: int, k: int | tuple[int, int], stride: int = 1,
             pad: int | tuple[int, int] | None = None, groups: int = 1, bias: bool = True) -> str:
        kh, kw = (k, k) if isinstance(k, int) else k
        if pad is None:
            pad = (kh // 2, kw // 2)
        ph, pw = (pad, pad) if isinstance(pad, int) else pad
        fan_in = cin // groups * kh * kw
        w = self.weight((cout, cin // groups, kh, kw), math.sqrt(2.0 / fan_in))
        ins = [x, w]
        if bias:
            ins.append(self.const(self.rng.normal(0, 0.01, cout).astype(np.float32), "b"))
        return self.node("Conv", ins, "conv", kernel_shape=[kh, kw], strides=[stride, stride],
                         pads=[ph, pw, ph, pw], group=groups)

    def relu(self, x: str) -> str:
        return self.node("Relu", [x])

    def relu6(self, x: str) -> str:
        lo = self.const(np.array(0.0, np.float32))
        hi = self.const(np.array(6.0, np.float32))
        return self.node("Clip", [x, lo, hi], "relu6")

    def silu(self, x: str) -> str:
        return self.node("Mul", [x, self.node("Sigmoid", [x])], "silu")

    def add(self, a: str, b: str) -> str:
        return self.node("Add", [a, b])

    def maxpool(self, x: str, k: int, s: int, p: int = 0, ceil: int = 0) -> str:
        return self.node("MaxPool", [x], "maxpool", kernel_shape=[k, k], strides=[s, s],
                         pads=[p, p, p, p], ceil_mode=ceil)

    def avgpool(self, x: str, k: int, s: int, p: int = 0) -> str:
        return self.node("AveragePool", [x], "avgpool", kernel_shape=[k, k], strides=[s, s],
                         pads=[p, p, p, p])

    def gap(self, x: str) -> str:
        return self.node("GlobalAveragePool", [x], "gap")

    def flatten(self, x: str) -> str:
        return self.node("Flatten", [x], axis=1)

    def fc(self, x: str, cin: int, cout: int) -> str:
        w = self.weight((cout, cin), math.sqrt(1.0 / cin))
        b = self.const(self.rng.normal(0, 0.01, cout).astype(np.float32), "b")
        return self.node("Gemm", [x, w, b], "fc", transB=1)

    # --- transformer layers -----------------------------------------------------------------
    def linear(self, x: str, cin: int, cout: int, std: float = 0.02) -> str:
        w = self.weight((cin, cout), std)
        b = self.const(np.zeros(cout, np.float32), "b")
        return self.node("Add", [self.node("MatMul", [x, w]), b], "linear")

    def layer_norm(self, x: str, dim: int) -> str:
        g = self.const(np.ones(dim, np.float32), "ln_g")
        b = self.const(np.zeros(dim, np.float32), "ln_b")
        return self.node("LayerNormalization", [x, g, b], "ln", axis=-1, epsilon=1e-12)

    def no_norm(self, x: str, dim: int) -> str:
        """MobileBERT's NoNorm: an element-wise affine map instead of a layer norm."""
        g = self.const(np.ones(dim, np.float32), "nn_g")
        b = self.const(np.zeros(dim, np.float32), "nn_b")
        return self.node("Add", [self.node("Mul", [x, g]), b], "nonorm")

    def gelu(self, x: str) -> str:
        # erf form, as BERT exports produce it
        half = self.const(np.array(0.5, np.float32))
        one = self.const(np.array(1.0, np.float32))
        rsqrt2 = self.const(np.array(1.0 / math.sqrt(2.0), np.float32))
        e = self.node("Erf", [self.node("Mul", [x, rsqrt2])])
        return self.node("Mul", [self.node("Mul", [x, half]), self.node("Add", [e, one])], "gelu")

    def reshape(self, x: str, shape: list[int]) -> str:
        return self.node("Reshape", [x, self.const(np.array(shape, np.int64), "shape")])

    def attention(self, q_in: str, k_in: str, v_in: str, d_qk_in: int, d_v_in: int, d: int,
                  heads: int, seq: int, mask: str) -> str:
        """Multi-head self-attention; returns the context [1, seq, d] before the output dense."""
        hd = d // heads
        q = self.linear(q_in, d_qk_in, d)
        k = self.linear(k_in, d_qk_in, d)
        v = self.linear(v_in, d_v_in, d)

        def heads_first(t: str) -> str:
            return self.node("Transpose", [self.reshape(t, [1, seq, heads, hd])], perm=[0, 2, 1, 3])

        qh, kh, vh = heads_first(q), heads_first(k), heads_first(v)
        kt = self.node("Transpose", [kh], perm=[0, 1, 3, 2])
        scores = self.node("MatMul", [qh, kt], "scores")
        scale = self.const(np.array(math.sqrt(hd), np.float32))
        scores = self.node("Add", [self.node("Div", [scores, scale]), mask])
        probs = self.node("Softmax", [scores], axis=-1)
        ctx = self.node("MatMul", [probs, vh], "ctx")
        ctx = self.node("Transpose", [ctx], perm=[0, 2, 1, 3])
        return self.reshape(ctx, [1, seq, d])


# --------------------------------------------------------------------------------------------
# CNNs


def _image_input(g: GraphBuilder, size: int, dynamic: bool) -> str:
    shape = ["batch", 3, "height", "width"] if dynamic else [1, 3, size, size]
    return g.input("input", shape)


def _classifier_output(g: GraphBuilder, x: str, classes: int, dynamic: bool) -> None:
    g.output(x, ["batch", classes] if dynamic else [1, classes])


def resnet(depth: int, size: int = 224, dynamic: bool = False, width: int = 64,
           classes: int = 1000, seed: int = 0) -> onnx.ModelProto:
    """ResNet-18/34 (basic blocks) and ResNet-50 (bottlenecks), torchvision layout (stride on 3x3)."""
    blocks = {18: ("basic", [2, 2, 2, 2]), 34: ("basic", [3, 4, 6, 3]),
              50: ("bottleneck", [3, 4, 6, 3]), 10: ("basic", [1, 1, 1, 1])}[depth]
    kind, counts = blocks
    g = GraphBuilder(f"resnet{depth}", seed)
    x = g.relu(g.conv(_image_input(g, size, dynamic), 3, width, 7, 2, 3))
    x = g.maxpool(x, 3, 2, 1)
    cin = width
    expansion = 4 if kind == "bottleneck" else 1
    for stage, n in enumerate(counts):
        planes = width * 2**stage
        for i in range(n):
            stride = 2 if (i == 0 and stage > 0) else 1
            cout = planes * expansion
            if kind == "basic":
                y = g.relu(g.conv(x, cin, planes, 3, stride))
                y = g.conv(y, planes, planes, 3)
            else:
                y = g.relu(g.conv(x, cin, planes, 1, 1, 0))
                y = g.relu(g.conv(y, planes, planes, 3, stride))
                y = g.conv(y, planes, cout, 1, 1, 0)
            short = g.conv(x, cin, cout, 1, stride, 0) if (stride != 1 or cin != cout) else x
            x = g.relu(g.add(y, short))
            cin = cout
    x = g.fc(g.flatten(g.gap(x)), cin, classes)
    _classifier_output(g, x, classes, dynamic)
    return g.model()


def alexnet(size: int = 224, dynamic: bool = False, seed: int = 0) -> onnx.ModelProto:
    """torchvision AlexNet: 5 convs, 3 max pools, 6x6 adaptive pool, 3 fully connected layers."""
    g = GraphBuilder("alexnet", seed)
    x = g.relu(g.conv(_image_input(g, size, dynamic), 3, 64, 11, 4, 2))
    x = g.maxpool(x, 3, 2)
    x = g.maxpool(g.relu(g.conv(x, 64, 192, 5, 1, 2)), 3, 2)
    x = g.relu(g.conv(x, 192, 384, 3))
    x = g.relu(g.conv(x, 384, 256, 3))
    x = g.maxpool(g.relu(g.conv(x, 256, 256, 3)), 3, 2)
    # at 224 the feature map is already 6x6, so the adaptive pool is the identity
    x = g.flatten(x)
    x = g.relu(g.fc(x, 256 * 6 * 6, 4096))
    x = g.relu(g.fc(x, 4096, 4096))
    _classifier_output(g, g.fc(x, 4096, 1000), 1000, dynamic)
    return g.model()


def vgg16(size: int = 224, dynamic: bool = False, seed: int = 0) -> onnx.ModelProto:
    """VGG-16 (configuration D), without batch norm, as torchvision's vgg16."""
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    g = GraphBuilder("vgg16", seed)
    x = _image_input(g, size, dynamic)
    cin = 3
    for v in cfg:
        if v == "M":
            x = g.maxpool(x, 2, 2)
        else:
            x = g.relu(g.conv(x, cin, v, 3))
            cin = v
    x = g.flatten(x)
    x = g.relu(g.fc(x, 512 * 7 * 7, 4096))
    x = g.relu(g.fc(x, 4096, 4096))
    _classifier_output(g, g.fc(x, 4096, 1000), 1000, dynamic)
    return g.model()


def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def mobilenet_v2(size: int = 224, dynamic: bool = False, width_mult: float = 1.0,
                 seed: int = 0) -> onnx.ModelProto:
    """MobileNetV2 with inverted residuals and ReLU6, torchvision settings."""
    settings = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                (6, 160, 3, 2), (6, 320, 1, 1)]
    g = GraphBuilder("mobilenetv2", seed)
    cin = _make_divisible(32 * width_mult)
    x = g.relu6(g.conv(_image_input(g, size, dynamic), 3, cin, 3, 2))
    for t, c, n, s in settings:
        cout = _make_divisible(c * width_mult)
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = cin * t
            y = x
            if t != 1:
                y = g.relu6(g.conv(y, cin, hidden, 1, 1, 0))
            y = g.relu6(g.conv(y, hidden, hidden, 3, stride, groups=hidden))
            y = g.conv(y, hidden, cout, 1, 1, 0)
            x = g.add(x, y) if (stride == 1 and cin == cout) else y
            cin = cout
    last = _make_divisible(1280 * max(1.0, width_mult))
    x = g.relu6(g.conv(x, cin, last, 1, 1, 0))
    _classifier_output(g, g.fc(g.flatten(g.gap(x)), last, 1000), 1000, dynamic)
    return g.model()


def efficientnet(variant: str = "b0", size: int = 224, dynamic: bool = False,
                 seed: int = 0) -> onnx.ModelProto:
    """EfficientNet-B0/B4: MBConv with squeeze-excitation and SiLU, compound-scaled."""
    width, depth = {"b0": (1.0, 1.0), "b4": (1.4, 1.8)}[variant]
    # expand ratio, kernel, stride, in, out, repeats (B0 baseline)
    base = [(1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2),
            (6, 3, 2, 40, 80, 3), (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4),
            (6, 3, 1, 192, 320, 1)]
    g = GraphBuilder(f"efficientnet{variant}", seed)
    cin = _make_divisible(32 * width)
    x = g.silu(g.conv(_image_input(g, size, dynamic), 3, cin, 3, 2))
    for e, k, s, _, c, n in base:
        cout = _make_divisible(c * width)
        for i in range(int(math.ceil(n * depth))):
            stride = s if i == 0 else 1
            hidden = _make_divisible(cin * e)
            y = x
            if e != 1:
                y = g.silu(g.conv(y, cin, hidden, 1, 1, 0))
            y = g.silu(g.conv(y, hidden, hidden, k, stride, groups=hidden))
            squeeze = max(1, cin // 4)
            se = g.silu(g.conv(g.gap(y), hidden, squeeze, 1, 1, 0))
            se = g.node("Sigmoid", [g.conv(se, squeeze, hidden, 1, 1, 0)])
            y = g.node("Mul", [y, se], "se_scale")
            y = g.conv(y, hidden, cout, 1, 1, 0)
            x = g.add(x, y) if (stride == 1 and cin == cout) else y
            cin = cout
    last = _make_divisible(1280 * width)
    x = g.silu(g.conv(x, cin, last, 1, 1, 0))
    _classifier_output(g, g.fc(g.flatten(g.gap(x)), last, 1000), 1000, dynamic)
    return g.model()


def googlenet(size: int = 224, dynamic: bool = False, seed: int = 0) -> onnx.ModelProto:
    """GoogLeNet (Inception v1) as torchvision builds it (3x3 in the '5x5' branch), no aux heads."""
    g = GraphBuilder("googlenet", seed)

    def cbr(x: str, cin: int, cout: int, k: int, s: int = 1, p: int | None = None) -> str:
        return g.relu(g.conv(x, cin, cout, k, s, p))

    def inception(x: str, cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, cp: int) -> str:
        b1 = cbr(x, cin, c1, 1, 1, 0)
        b2 = cbr(cbr(x, cin, c3r, 1, 1, 0), c3r, c3, 3)
        b3 = cbr(cbr(x, cin, c5r, 1, 1, 0), c5r, c5, 3)
        b4 = cbr(g.maxpool(x, 3, 1, 1, ceil=1), cin, cp, 1, 1, 0)
        return g.node("Concat", [b1, b2, b3, b4], "concat", axis=1)

    x = cbr(_image_input(g, size, dynamic), 3, 64, 7, 2, 3)
    x = g.maxpool(x, 3, 2, 0, ceil=1)
    x = cbr(x, 64, 64, 1, 1, 0)
    x = cbr(x, 64, 192, 3)
    x = g.maxpool(x, 3, 2, 0, ceil=1)
    x = inception(x, 192, 64, 96, 128, 16, 32, 32)
    x = inception(x, 256, 128, 128, 192, 32, 96, 64)
    x = g.maxpool(x, 3, 2, 0, ceil=1)
    x = inception(x, 480, 192, 96, 208, 16, 48, 64)
    x = inception(x, 512, 160, 112, 224, 24, 64, 64)
    x = inception(x, 512, 128, 128, 256, 24, 64, 64)
    x = inception(x, 512, 112, 144, 288, 32, 64, 64)
    x = inception(x, 528, 256, 160, 320, 32, 128, 128)
    x = g.maxpool(x, 2, 2, 0, ceil=1)
    x = inception(x, 832, 256, 160, 320, 32, 128, 128)
    x = inception(x, 832, 384, 192, 384, 48, 128, 128)
    _classifier_output(g, g.fc(g.flatten(g.gap(x)), 1024, 1000), 1000, dynamic)
    return g.model()


def mnasnet(alpha: float = 1.0, size: int = 224, dynamic: bool = False,
            seed: int = 0) -> onnx.ModelProto:
    """MnasNet-1.0 (torchvision mnasnet1_0): inverted residual stacks with 3x3 and 5x5 depthwise."""
    def depth(c: int) -> int:
        return _make_divisible(c * alpha, 8)

    # expansion, kernel, stride, out, repeats
    stacks = [(3, 3, 2, 24, 3), (3, 5, 2, 40, 3), (6, 5, 2, 80, 3), (6, 3, 1, 96, 2),
              (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]
    g = GraphBuilder("mnasnet1_0", seed)
    x = g.relu(g.conv(_image_input(g, size, dynamic), 3, 32, 3, 2))
    x = g.relu(g.conv(x, 32, 32, 3, 1, groups=32))
    x = g.conv(x, 32, depth(16), 1, 1, 0)
    cin = depth(16)
    for e, k, s, c, n in stacks:
        cout = depth(c)
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = cin * e
            y = g.relu(g.conv(x, cin, hidden, 1, 1, 0))
            y = g.relu(g.conv(y, hidden, hidden, k, stride, groups=hidden))
            y = g.conv(y, hidden, cout, 1, 1, 0)
            x = g.add(x, y) if (stride == 1 and cin == cout) else y
            cin = cout
    x = g.relu(g.conv(x, cin, 1280, 1, 1, 0))
    _classifier_output(g, g.fc(g.flatten(g.gap(x)), 1280, 1000), 1000, dynamic)
    return g.model()


def tiny_cnn(size: int = 32, dynamic: bool = False, seed: int = 0) -> onnx.ModelProto:
    """A small ResNet-like CNN (one basic block per stage, depthwise branch) for tests."""
    g = GraphBuilder("tiny_cnn", seed)
    x = g.relu(g.conv(_image_input(g, size, dynamic), 3, 16, 3, 1))
    y = g.conv(g.relu(g.conv(x, 16, 16, 3)), 16, 16, 3)
    x = g.relu(g.add(x, y))
    x = g.relu6(g.conv(x, 16, 16, 3, 2, groups=16))
    x = g.relu(g.conv(x, 16, 32, 1, 1, 0))
    x = g.maxpool(x, 2, 2)
    x = g.fc(g.flatten(g.gap(x)), 32, 10)
    _classifier_output(g, x, 10, dynamic)
    return g.model()


# --------------------------------------------------------------------------------------------
# Transformers


def _token_inputs(g: GraphBuilder, seq: int, dynamic: bool) -> tuple[str, str]:
    shape = ["batch", "sequence"] if dynamic else [1, seq]
    ids = g.input("input_ids", shape, TensorProto.INT64)
    mask = g.input("attention_mask", shape, TensorProto.INT64)
    return ids, mask


def _additive_mask(g: GraphBuilder, mask: str) -> str:
    """[1, seq] 0/1 mask -> [1, 1, 1, seq] additive mask, as HF exports build it."""
    m = g.node("Unsqueeze", [mask, g.const(np.array([1, 2], np.int64))])
    m = g.node("Cast", [m], to=TensorProto.FLOAT)
    one = g.const(np.array(1.0, np.float32))
    neg = g.const(np.array(-10000.0, np.float32))
    return g.node("Mul", [g.node("Sub", [one, m]), neg], "mask")


def bert(layers: int = 12, hidden: int = 768, heads: int = 12, ffn: int = 3072, seq: int = 256,
         vocab: int = 30522, dynamic: bool = False, seed: int = 0,
         name: str = "bert") -> onnx.ModelProto:
    """BERT encoder (post-LN, erf-GELU) with pooler, as HF BertModel exports it."""
    g = GraphBuilder(name, seed)
    ids, mask = _token_inputs(g, seq, dynamic)
    word = g.weight((vocab, hidden), 0.02, "word_emb")
    pos = g.const(g.rng.normal(0, 0.02, (1, seq, hidden)).astype(np.float32), "pos_emb")
    tok = g.const(g.rng.normal(0, 0.02, (hidden,)).astype(np.float32), "type_emb")
    x = g.node("Gather", [word, ids], "embed", axis=0)
    x = g.layer_norm(g.add(g.add(x, pos), tok), hidden)
    amask = _additive_mask(g, mask)
    for _ in range(layers):
        ctx = g.attention(x, x, x, hidden, hidden, hidden, heads, seq, amask)
        x = g.layer_norm(g.add(g.linear(ctx, hidden, hidden), x), hidden)
        h = g.gelu(g.linear(x, hidden, ffn))
        x = g.layer_norm(g.add(g.linear(h, ffn, hidden), x), hidden)
    g.output(x, ["batch", "sequence", hidden] if dynamic else [1, seq, hidden])
    first = g.node("Gather", [x, g.const(np.array(0, np.int64))], "cls", axis=1)
    pooled = g.node("Tanh", [g.linear(first, hidden, hidden)], "pooled")
    g.output(pooled, ["batch", hidden] if dynamic else [1, hidden])
    return g.model()


def mobilebert(layers: int = 24, hidden: int = 512, bottleneck: int = 128, heads: int = 4,
               ffn: int = 512, num_ffn: int = 4, embed: int = 128, seq: int = 256,
               vocab: int = 30522, dynamic: bool = False, seed: int = 0,
               name: str = "mobilebert") -> onnx.ModelProto:
    """MobileBERT (google/mobilebert-uncased): trigram embedding, bottlenecks with a shared
    Q/K bottleneck, NoNorm, ReLU, four stacked feed-forward networks per layer."""
    g = GraphBuilder(name, seed)
    ids, mask = _token_inputs(g, seq, dynamic)
    word = g.weight((vocab, embed), 0.02, "word_emb")
    e = g.node("Gather", [word, ids], "embed", axis=0)  # [1, seq, 128]
    # trigram input: concat(next token, token, previous token) along features, zero padded
    zero = g.const(np.zeros((1, 1, embed), np.float32))
    nxt = g.node("Concat", [g.node("Slice", [e, g.const(np.array([1], np.int64)),
                                             g.const(np.array([seq], np.int64)),
                                             g.const(np.array([1], np.int64))]), zero], axis=1)
    prv = g.node("Concat", [zero, g.node("Slice", [e, g.const(np.array([0], np.int64)),
                                                   g.const(np.array([seq - 1], np.int64)),
                                                   g.const(np.array([1], np.int64))])], axis=1)
    tri = g.node("Concat", [nxt, e, prv], "trigram", axis=2)
    x = g.linear(tri, 3 * embed, hidden)
    pos = g.const(g.rng.normal(0, 0.02, (1, seq, hidden)).astype(np.float32), "pos_emb")
    x = g.no_norm(g.add(x, pos), hidden)
    amask = _additive_mask(g, mask)
    for _ in range(layers):
        layer_in = x
        # bottleneck of the input feeds the attention output residual; the shared bottleneck feeds Q/K
        b_in = g.no_norm(g.linear(x, hidden, bottleneck), bottleneck)
        b_att = g.no_norm(g.linear(x, hidden, bottleneck), bottleneck)
        ctx = g.attention(b_att, b_att, x, bottleneck, hidden, bottleneck, heads, seq, amask)
        a = g.no_norm(g.add(g.linear(ctx, bottleneck, bottleneck), b_in), bottleneck)
        for _ in range(num_ffn - 1):
            h = g.relu(g.linear(a, bottleneck, ffn))
            a = g.no_norm(g.add(g.linear(h, ffn, bottleneck), a), bottleneck)
        h = g.relu(g.linear(a, bottleneck, ffn))
        o = g.no_norm(g.add(g.linear(h, ffn, bottleneck), a), bottleneck)
        x = g.no_norm(g.add(g.linear(o, bottleneck, hidden), layer_in), hidden)
    g.output(x, ["batch", "sequence", hidden] if dynamic else [1, seq, hidden])
    return g.model()


# --------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class ZooEntry:
    name: str
    family: str  # "cnn" or "transformer"
    build: Callable[..., onnx.ModelProto]
    description: str
    tiny: bool = False

    def input_shapes(self) -> dict[str, list[int]]:
        m = self.build()
        return {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}


ZOO: dict[str, ZooEntry] = {e.name: e for e in [
    ZooEntry("resnet18", "cnn", lambda **kw: resnet(18, **kw), "ResNet-18, 1x3x224x224"),
    ZooEntry("resnet50", "cnn", lambda **kw: resnet(50, **kw), "ResNet-50, 1x3x224x224"),
    ZooEntry("alexnet", "cnn", alexnet, "AlexNet, 1x3x224x224"),
    ZooEntry("vgg16", "cnn", vgg16, "VGG-16, 1x3x224x224"),
    ZooEntry("mobilenetv2", "cnn", mobilenet_v2, "MobileNetV2 1.0, 1x3x224x224"),
    ZooEntry("efficientnetb0", "cnn", lambda **kw: efficientnet("b0", **kw),
             "EfficientNet-B0, 1x3x224x224"),
    ZooEntry("efficientnetb4", "cnn", lambda **kw: efficientnet("b4", **kw),
             "EfficientNet-B4, 1x3x224x224"),
    ZooEntry("googlenet", "cnn", googlenet, "GoogLeNet (Inception v1), 1x3x224x224"),
    ZooEntry("mnasnet1_0", "cnn", mnasnet, "MnasNet-1.0, 1x3x224x224"),
    ZooEntry("bert", "transformer", bert, "BERT-base uncased, 12 layers, sequence 256"),
    ZooEntry("mobilebert", "transformer", mobilebert, "MobileBERT, 24 layers, sequence 256"),
    ZooEntry("tiny_cnn", "cnn", tiny_cnn, "test CNN, 1x3x32x32", tiny=True),
    ZooEntry("tiny_resnet", "cnn", lambda **kw: resnet(10, size=32, width=8, classes=10, **kw),
             "ResNet-10 at width 8, 1x3x32x32", tiny=True),
    ZooEntry("tiny_mobilenet", "cnn", lambda **kw: mobilenet_v2(size=32, width_mult=0.25, **kw),
             "MobileNetV2 0.25, 1x3x32x32", tiny=True),
    ZooEntry("tiny_bert", "transformer",
             lambda **kw: bert(layers=2, hidden=64, heads=2, ffn=128, seq=16, vocab=100,
                               name="tiny_bert", **kw), "BERT, 2 layers, hidden 64, sequence 16",
             tiny=True),
    ZooEntry("tiny_mobilebert", "transformer",
             lambda **kw: mobilebert(layers=2, hidden=64, bottleneck=32, heads=2, ffn=64,
                                     embed=32, seq=16, vocab=100, name="tiny_mobilebert", **kw),
             "MobileBERT, 2 layers, hidden 64, sequence 16", tiny=True),
]}

PAPER_NETWORKS = ["resnet18", "resnet50", "alexnet", "vgg16", "mobilenetv2", "efficientnetb0",
                  "efficientnetb4", "googlenet", "mnasnet1_0", "bert", "mobilebert"]


def get(name: str) -> ZooEntry:
    try:
        return ZOO[name]
    except KeyError:
        raise TTRankError(f"unknown zoo network {name!r}; known: {', '.join(ZOO)}") from None


def build(name: str, dynamic: bool = False) -> onnx.ModelProto:
    """Build a zoo network. ``dynamic=True`` marks batch/spatial/sequence dims symbolic."""
    return get(name).build(dynamic=dynamic)


def export(name: str, path: str | Path, dynamic: bool = False) -> Path:
    """Write a zoo network to an ONNX file atomically."""
    from .util import atomic_write_bytes

    path = Path(path)
    atomic_write_bytes(path, build(name, dynamic).SerializeToString())
    return path


def cached(name: str) -> Path:
    """The zoo network's ONNX file in the user cache, exported on first use."""
    from .util import cache_dir

    get(name)
    path = cache_dir() / "zoo" / f"{name}.onnx"
    if not path.exists():
        export(name, path)
    return path
