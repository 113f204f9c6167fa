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

from . import frontend
from .errors import TTRankError
from .util import atomic_write_bytes, cache_dir

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
             pad: int | tuple[int, int] | None = None, groups: int = 1, bias: bool = True,
             dilation: int = 1) -> str:
        kh, kw = (k, k) if isinstance(k, int) else k
        if pad is None:
            pad = (dilation * (kh // 2), dilation * (kw // 2))
        ph, pw = (pad, pad) if isinstance(pad, int) else pad
        fan_in = cin // groups * kh * kw
        w = self.weight((cout, cin // groups, kh, kw), math.sqrt(2.0 / fan_in))
        ins = [x, w]
        if bias:
            ins.append(self.const(self.rng.normal(0, 0.01, cout).astype(np.float32), "b"))
        # the attribute only when it is not the default, so older networks stay byte-identical
        extra = {"dilations": [dilation, dilation]} if dilation != 1 else {}
        return self.node("Conv", ins, "conv", kernel_shape=[kh, kw], strides=[stride, stride],
                         pads=[ph, pw, ph, pw], group=groups, **extra)

    def conv1d(self, x: str, cin: int, cout: int, k: int, stride: int = 1,
               pad: int | None = None, groups: int = 1, dilation: int = 1) -> str:
        """A 1-D convolution on [N, C, L], as audio and sequence models export it."""
        pad = dilation * (k // 2) if pad is None else pad
        w = self.weight((cout, cin // groups, k), math.sqrt(2.0 / (cin // groups * k)))
        b = self.const(self.rng.normal(0, 0.01, cout).astype(np.float32), "b")
        return self.node("Conv", [x, w, b], "conv1d", kernel_shape=[k], strides=[stride],
                         pads=[pad, pad], group=groups, dilations=[dilation])

    def conv3d(self, x: str, cin: int, cout: int, k: tuple[int, int, int],
               stride: tuple[int, int, int] = (1, 1, 1), groups: int = 1) -> str:
        """A 3-D convolution on [N, C, D, H, W] (video and volumetric nets), padded to keep
        the size at stride 1."""
        w = self.weight((cout, cin // groups, *k), math.sqrt(2.0 / (cin // groups * math.prod(k))))
        b = self.const(self.rng.normal(0, 0.01, cout).astype(np.float32), "b")
        pads = [d // 2 for d in k]
        return self.node("Conv", [x, w, b], "conv3d", kernel_shape=list(k), strides=list(stride),
                         pads=pads + pads, group=groups)

    def conv_transpose(self, x: str, cin: int, cout: int, k: int, stride: int,
                       pad: int = 0, bias: bool = True) -> str:
        """A transposed (fractionally strided) convolution, as upsampling heads export it."""
        w = self.weight((cin, cout, k, k), math.sqrt(2.0 / (cin * k * k)))
        ins = [x, w]
        if bias:
            ins.append(self.const(self.rng.normal(0, 0.01, cout).astype(np.float32), "b"))
        return self.node("ConvTranspose", ins, "convT", kernel_shape=[k, k],
                         strides=[stride, stride], pads=[pad, pad, pad, pad])

    def batchnorm(self, x: str, c: int) -> str:
        """An explicit BatchNormalization node: exporters keep them where they cannot fold
        (after a transposed conv, in Paddle exports), unlike the folded ones of the builders."""
        scale = self.const(self.rng.uniform(0.5, 1.5, c).astype(np.float32), "bn_s")
        bias = self.const(self.rng.normal(0, 0.1, c).astype(np.float32), "bn_b")
        mean = self.const(self.rng.normal(0, 0.1, c).astype(np.float32), "bn_m")
        var = self.const(self.rng.uniform(0.5, 1.5, c).astype(np.float32), "bn_v")
        return self.node("BatchNormalization", [x, scale, bias, mean, var], "bn", epsilon=1e-5)

    def resize(self, x: str, scale: float, mode: str = "nearest") -> str:
        """Upsampling by a constant factor (Resize with scales), as FPNs and decoders export it."""
        scales = self.const(np.array([1.0, 1.0, scale, scale], np.float32), "scales")
        attrs = {"mode": mode}
        if mode == "linear":
            attrs["coordinate_transformation_mode"] = "half_pixel"
        return self.node("Resize", [x, "", scales], "resize", **attrs)

    def hardswish(self, x: str) -> str:
        return self.node("HardSwish", [x])

    def hardsigmoid(self, x: str) -> str:
        return self.node("HardSigmoid", [x], alpha=1.0 / 6, beta=0.5)

    def concat(self, xs: list[str], axis: int = 1) -> str:
        return self.node("Concat", xs, "concat", axis=axis)

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

    def layer_norm(self, x: str, dim: int, eps: float = 1e-12) -> str:
        g = self.const(np.ones(dim, np.float32), "ln_g")
        b = self.const(np.zeros(dim, np.float32), "ln_b")
        return self.node("LayerNormalization", [x, g, b], "ln", axis=-1, epsilon=eps)

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

    def gelu_tanh(self, x: str) -> str:
        """GPT-2's tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
        c = self.const(np.array(0.044715, np.float32))
        k = self.const(np.array(math.sqrt(2.0 / math.pi), np.float32))
        half = self.const(np.array(0.5, np.float32))
        one = self.const(np.array(1.0, np.float32))
        cube = self.node("Mul", [self.node("Mul", [x, x]), x])
        inner = self.node("Mul", [self.node("Add", [x, self.node("Mul", [cube, c])]), k])
        t = self.node("Tanh", [inner])
        return self.node("Mul", [self.node("Mul", [x, half]), self.node("Add", [t, one])],
                         "gelu_tanh")

    def reshape(self, x: str, shape: list[int]) -> str:
        return self.node("Reshape", [x, self.const(np.array(shape, np.int64), "shape")])

    def attention(self, q_in: str, k_in: str, v_in: str, d_qk_in: int, d_v_in: int, d: int,
                  heads: int, seq: int, mask: str | None) -> str:
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
        scores = self.node("Div", [scores, scale])
        if mask is not None:  # encoders of images (ViT) have none
            scores = self.node("Add", [scores, mask])
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
# Donor pool v2: the families users deploy, with the operators the paper's 11 lack


def _cbs(g: GraphBuilder, x: str, cin: int, cout: int, k: int, s: int = 1) -> str:
    """Conv (batch norm folded) + SiLU: the YOLO/CSP building block."""
    return g.silu(g.conv(x, cin, cout, k, s))


def yolo(size: int = 416, dynamic: bool = False, width: float = 0.25, depth: float = 0.34,
         classes: int = 80, seed: int = 0) -> onnx.ModelProto:
    """A YOLOv8-style detector (n scale): CSP backbone with C2f blocks, SPPF, an FPN/PAN neck with
    nearest upsampling and concats, and decoupled box/class heads at strides 8, 16 and 32."""
    g = GraphBuilder("yolo", seed)

    def ch(c: int) -> int:
        return _make_divisible(c * width, 8)

    def c2f(x: str, cin: int, cout: int, n: int, shortcut: bool) -> str:
        hidden = cout // 2
        y = _cbs(g, x, cin, 2 * hidden, 1)
        parts = [g.node("Slice", [y, g.const(np.array([0], np.int64)),
                                  g.const(np.array([hidden], np.int64)),
                                  g.const(np.array([1], np.int64))]),
                 g.node("Slice", [y, g.const(np.array([hidden], np.int64)),
                                  g.const(np.array([2 * hidden], np.int64)),
                                  g.const(np.array([1], np.int64))])]
        for _ in range(n):
            b = _cbs(g, _cbs(g, parts[-1], hidden, hidden, 3), hidden, hidden, 3)
            parts.append(g.add(parts[-1], b) if shortcut else b)
        return _cbs(g, g.concat(parts), (2 + n) * hidden, cout, 1)

    def reps(n: int) -> int:
        return max(1, round(n * depth))

    x = _cbs(g, _image_input(g, size, dynamic), 3, ch(64), 3, 2)
    x = _cbs(g, x, ch(64), ch(128), 3, 2)
    x = c2f(x, ch(128), ch(128), reps(3), True)
    x = _cbs(g, x, ch(128), ch(256), 3, 2)
    p3 = c2f(x, ch(256), ch(256), reps(6), True)
    x = _cbs(g, p3, ch(256), ch(512), 3, 2)
    p4 = c2f(x, ch(512), ch(512), reps(6), True)
    x = _cbs(g, p4, ch(512), ch(1024), 3, 2)
    x = c2f(x, ch(1024), ch(1024), reps(3), True)
    # SPPF: three chained 5x5 max pools, concatenated
    y = _cbs(g, x, ch(1024), ch(512), 1)
    m1 = g.maxpool(y, 5, 1, 2)
    m2 = g.maxpool(m1, 5, 1, 2)
    m3 = g.maxpool(m2, 5, 1, 2)
    p5 = _cbs(g, g.concat([y, m1, m2, m3]), 4 * ch(512), ch(1024), 1)
    # top-down
    n4 = c2f(g.concat([g.resize(p5, 2.0), p4]), ch(1024) + ch(512), ch(512), reps(3), False)
    n3 = c2f(g.concat([g.resize(n4, 2.0), p3]), ch(512) + ch(256), ch(256), reps(3), False)
    # bottom-up
    d4 = c2f(g.concat([_cbs(g, n3, ch(256), ch(256), 3, 2), n4]), ch(256) + ch(512), ch(512),
             reps(3), False)
    d5 = c2f(g.concat([_cbs(g, d4, ch(512), ch(512), 3, 2), p5]), ch(512) + ch(1024), ch(1024),
             reps(3), False)
    outs = []
    box_c, cls_c = max(16, ch(256) // 4, 64), max(ch(256), min(classes, 100))
    for feat, c in ((n3, ch(256)), (d4, ch(512)), (d5, ch(1024))):
        box = g.conv(_cbs(g, _cbs(g, feat, c, box_c, 3), box_c, box_c, 3), box_c, 64, 1, 1, 0)
        cls = g.conv(_cbs(g, _cbs(g, feat, c, cls_c, 3), cls_c, cls_c, 3), cls_c, classes, 1, 1, 0)
        head = g.concat([box, cls])
        outs.append(g.reshape(head, [1, 64 + classes, -1]))
    det = g.node("Sigmoid", [g.concat(outs, axis=2)], "det")
    n_anchors = sum((size // s) ** 2 for s in (8, 16, 32))
    g.output(det, ["batch", 64 + classes, "anchors"] if dynamic else [1, 64 + classes, n_anchors])
    return g.model()


def dbnet(size: int = 640, dynamic: bool = False, seed: int = 0) -> onnx.ModelProto:
    """A DB-style text detector (DBNet, ResNet-18 backbone): FPN with nearest upsampling and
    concat, then the probability head: conv + batch norm + ReLU, two transposed convs (each
    followed by an un-folded batch norm, as Paddle2ONNX exports it) back to full resolution."""
    g = GraphBuilder("dbnet", seed)
    x = g.relu(g.conv(_image_input(g, size, dynamic), 3, 64, 7, 2, 3))
    x = g.maxpool(x, 3, 2, 1)
    feats, cin = [], 64
    for stage, planes in enumerate([64, 128, 256, 512]):
        for i in range(2):
            stride = 2 if (i == 0 and stage > 0) else 1
            y = g.conv(g.relu(g.conv(x, cin, planes, 3, stride)), planes, planes, 3)
            short = g.conv(x, cin, planes, 1, stride, 0) if (stride != 1 or cin != planes) else x
            x = g.relu(g.add(y, short))
            cin = planes
        feats.append((x, planes))
    inner = 256
    lat = [g.conv(f, c, inner, 1, 1, 0, bias=False) for f, c in feats]
    for i in (2, 1, 0):  # top-down: upsample the coarser map and add
        lat[i] = g.add(lat[i], g.resize(lat[i + 1], 2.0))
    outs = []
    for i, t in enumerate(lat):
        o = g.conv(t, inner, inner // 4, 3, bias=False)
        outs.append(g.resize(o, float(2 ** i)) if i else o)
    fuse = g.concat(outs)  # [1, 256, size/4, size/4]
    h = g.relu(g.batchnorm(g.conv(fuse, inner, inner // 4, 3, bias=False), inner // 4))
    h = g.relu(g.batchnorm(g.conv_transpose(h, inner // 4, inner // 4, 2, 2), inner // 4))
    prob = g.node("Sigmoid", [g.conv_transpose(h, inner // 4, 1, 2, 2)], "prob")
    g.output(prob, ["batch", 1, "height", "width"] if dynamic else [1, 1, size, size])
    return g.model()


def unet(size: int = 256, dynamic: bool = False, base: int = 32, classes: int = 2,
         seed: int = 0) -> onnx.ModelProto:
    """A U-Net for segmentation: double conv + batch norm + ReLU blocks, max-pool encoder, a
    decoder of 2x2 stride-2 transposed convs whose outputs are concatenated with the skips."""
    g = GraphBuilder("unet", seed)

    def block(x: str, cin: int, cout: int) -> str:
        x = g.relu(g.batchnorm(g.conv(x, cin, cout, 3, bias=False), cout))
        return g.relu(g.batchnorm(g.conv(x, cout, cout, 3, bias=False), cout))

    x = _image_input(g, size, dynamic)
    skips, cin = [], 3
    for i in range(4):
        x = block(x, cin, base * 2**i)
        cin = base * 2**i
        skips.append(x)
        x = g.maxpool(x, 2, 2)
    x = block(x, cin, base * 16)
    cin = base * 16
    for i in (3, 2, 1, 0):
        c = base * 2**i
        up = g.conv_transpose(x, cin, c, 2, 2)
        x = block(g.concat([skips[i], up]), 2 * c, c)
        cin = c
    x = g.conv(x, cin, classes, 1, 1, 0)
    g.output(x, ["batch", classes, "height", "width"] if dynamic else [1, classes, size, size])
    return g.model()


def mobilenet_v3(size: int = 224, dynamic: bool = False, seed: int = 0) -> onnx.ModelProto:
    """MobileNetV3-Large (torchvision): hardswish, squeeze-excitation with hardsigmoid."""
    # kernel, expanded, out, SE, activation, stride
    cfg = [(3, 16, 16, False, "RE", 1), (3, 64, 24, False, "RE", 2), (3, 72, 24, False, "RE", 1),
           (5, 72, 40, True, "RE", 2), (5, 120, 40, True, "RE", 1), (5, 120, 40, True, "RE", 1),
           (3, 240, 80, False, "HS", 2), (3, 200, 80, False, "HS", 1),
           (3, 184, 80, False, "HS", 1), (3, 184, 80, False, "HS", 1),
           (3, 480, 112, True, "HS", 1), (3, 672, 112, True, "HS", 1),
           (5, 672, 160, True, "HS", 2), (5, 960, 160, True, "HS", 1),
           (5, 960, 160, True, "HS", 1)]
    g = GraphBuilder("mobilenetv3", seed)
    x = g.hardswish(g.conv(_image_input(g, size, dynamic), 3, 16, 3, 2))
    cin = 16
    for k, exp, cout, se, act, s in cfg:
        def a(t: str) -> str:
            return g.hardswish(t) if act == "HS" else g.relu(t)

        y = a(g.conv(x, cin, exp, 1, 1, 0)) if exp != cin else x
        y = a(g.conv(y, exp, exp, k, s, groups=exp))
        if se:
            sq = _make_divisible(exp // 4)
            w = g.relu(g.conv(g.gap(y), exp, sq, 1, 1, 0))
            y = g.node("Mul", [y, g.hardsigmoid(g.conv(w, sq, exp, 1, 1, 0))], "se_scale")
        y = g.conv(y, exp, cout, 1, 1, 0)
        x = g.add(x, y) if (s == 1 and cin == cout) else y
        cin = cout
    x = g.hardswish(g.conv(x, cin, 960, 1, 1, 0))
    x = g.hardswish(g.fc(g.flatten(g.gap(x)), 960, 1280))
    _classifier_output(g, g.fc(x, 1280, 1000), 1000, dynamic)
    return g.model()


def resnext(size: int = 224, dynamic: bool = False, groups: int = 32, width_per_group: int = 4,
            seed: int = 0) -> onnx.ModelProto:
    """ResNeXt-50 (32x4d, torchvision): bottlenecks whose 3x3 conv is a grouped conv."""
    g = GraphBuilder("resnext50", seed)
    x = g.relu(g.conv(_image_input(g, size, dynamic), 3, 64, 7, 2, 3))
    x = g.maxpool(x, 3, 2, 1)
    cin = 64
    for stage, n in enumerate([3, 4, 6, 3]):
        planes = 64 * 2**stage
        width = planes * width_per_group * groups // 64
        for i in range(n):
            stride = 2 if (i == 0 and stage > 0) else 1
            cout = planes * 4
            y = g.relu(g.conv(x, cin, width, 1, 1, 0))
            y = g.relu(g.conv(y, width, width, 3, stride, groups=groups))
            y = g.conv(y, width, cout, 1, 1, 0)
            short = g.conv(x, cin, cout, 1, stride, 0) if (stride != 1 or cin != cout) else x
            x = g.relu(g.add(y, short))
            cin = cout
    _classifier_output(g, g.fc(g.flatten(g.gap(x)), cin, 1000), 1000, dynamic)
    return g.model()


def deeplab(size: int = 384, dynamic: bool = False, classes: int = 21,
            seed: int = 0) -> onnx.ModelProto:
    """DeepLabV3 (ResNet-18 backbone at output stride 16): the last stage's convs dilated, ASPP
    with dilation rates 6, 12 and 18 and a pooled branch, bilinear upsampling to the input."""
    g = GraphBuilder("deeplabv3", seed)
    x = g.relu(g.conv(_image_input(g, size, dynamic), 3, 64, 7, 2, 3))
    x = g.maxpool(x, 3, 2, 1)
    cin = 64
    for stage, planes in enumerate([64, 128, 256, 512]):
        for i in range(2):
            stride = 2 if (i == 0 and 0 < stage < 3) else 1
            dil = 2 if stage == 3 else 1
            y = g.relu(g.conv(x, cin, planes, 3, stride, dilation=dil))
            y = g.conv(y, planes, planes, 3, dilation=dil)
            short = g.conv(x, cin, planes, 1, stride, 0) if (stride != 1 or cin != planes) else x
            x = g.relu(g.add(y, short))
            cin = planes
    branches = [g.relu(g.conv(x, cin, 256, 1, 1, 0))]
    branches += [g.relu(g.conv(x, cin, 256, 3, dilation=r)) for r in (6, 12, 18)]
    pooled = g.relu(g.conv(g.gap(x), cin, 256, 1, 1, 0))
    branches.append(g.resize(pooled, float(size // 16)))
    y = g.relu(g.conv(g.concat(branches), 5 * 256, 256, 1, 1, 0))
    y = g.relu(g.conv(y, 256, 256, 3))
    y = g.conv(y, 256, classes, 1, 1, 0)
    y = g.resize(y, 16.0, mode="linear")
    g.output(y, ["batch", classes, "height", "width"] if dynamic else [1, classes, size, size])
    return g.model()


def audio_cnn(frames: int = 512, mels: int = 64, classes: int = 35, dynamic: bool = False,
              seed: int = 0) -> onnx.ModelProto:
    """A 1-D convolutional keyword/audio classifier on log-mel frames [1, mels, frames]: a
    strided stem, residual blocks of conv1d (kernel 9 and 3, some dilated), global average pool."""
    g = GraphBuilder("audio_cnn", seed)
    x = g.input("mel", ["batch", mels, "frames"] if dynamic else [1, mels, frames])
    x = g.relu(g.conv1d(x, mels, 128, 9, 2))
    cin = 128
    for cout, n, stride in ((128, 2, 1), (256, 2, 2), (512, 2, 2)):
        for i in range(n):
            s = stride if i == 0 else 1
            y = g.relu(g.conv1d(x, cin, cout, 9, s))
            y = g.conv1d(y, cout, cout, 3, dilation=2 if i else 1)
            short = g.conv1d(x, cin, cout, 1, s, 0) if (s != 1 or cin != cout) else x
            x = g.relu(g.add(y, short))
            cin = cout
    x = g.node("ReduceMean", [x], "pool", axes=[2], keepdims=0)  # opset 17: axes an attribute
    _classifier_output(g, g.fc(x, cin, classes), classes, dynamic)
    return g.model()


def vit(size: int = 224, patch: int = 16, hidden: int = 192, layers: int = 12, heads: int = 3,
        mlp: int = 768, dynamic: bool = False, seed: int = 0,
        name: str = "vit_tiny") -> onnx.ModelProto:
    """ViT/DeiT-tiny: patch-embedding conv, class token, pre-LN encoder (eps 1e-6, erf-GELU),
    softmax attention over 197 tokens, classifier on the class token."""
    g = GraphBuilder(name, seed)
    x = g.conv(_image_input(g, size, dynamic), 3, hidden, patch, patch, 0)
    seq = (size // patch) ** 2 + 1
    x = g.node("Transpose", [g.reshape(x, [1, hidden, seq - 1])], perm=[0, 2, 1])
    cls = g.const(g.rng.normal(0, 0.02, (1, 1, hidden)).astype(np.float32), "cls_token")
    x = g.concat([cls, x], axis=1)
    x = g.add(x, g.const(g.rng.normal(0, 0.02, (1, seq, hidden)).astype(np.float32), "pos_emb"))
    for _ in range(layers):
        h = g.layer_norm(x, hidden, eps=1e-6)
        ctx = g.attention(h, h, h, hidden, hidden, hidden, heads, seq, None)
        x = g.add(x, g.linear(ctx, hidden, hidden))
        h = g.gelu(g.linear(g.layer_norm(x, hidden, eps=1e-6), hidden, mlp))
        x = g.add(x, g.linear(h, mlp, hidden))
    x = g.layer_norm(x, hidden, eps=1e-6)
    first = g.node("Gather", [x, g.const(np.array(0, np.int64))], "cls", axis=1)
    _classifier_output(g, g.fc(first, hidden, 1000), 1000, dynamic)
    return g.model()


def gpt2(layers: int = 12, hidden: int = 768, heads: int = 12, seq: int = 128,
         vocab: int = 50257, dynamic: bool = False, seed: int = 0,
         name: str = "gpt2") -> onnx.ModelProto:
    """GPT-2 (small) decoder as HF exports it: pre-LN, causal attention mask, tanh-GELU, final
    layer norm and the tied language-model head over the whole vocabulary."""
    g = GraphBuilder(name, seed)
    ids = g.input("input_ids", ["batch", "sequence"] if dynamic else [1, seq], TensorProto.INT64)
    wte = g.weight((vocab, hidden), 0.02, "wte")
    x = g.node("Gather", [wte, ids], "embed", axis=0)
    x = g.add(x, g.const(g.rng.normal(0, 0.01, (1, seq, hidden)).astype(np.float32), "wpe"))
    causal = np.triu(np.full((seq, seq), -10000.0, np.float32), 1).reshape(1, 1, seq, seq)
    mask = g.const(causal, "causal_mask")
    for _ in range(layers):
        h = g.layer_norm(x, hidden, eps=1e-5)
        ctx = g.attention(h, h, h, hidden, hidden, hidden, heads, seq, mask)
        x = g.add(x, g.linear(ctx, hidden, hidden))
        h = g.gelu_tanh(g.linear(g.layer_norm(x, hidden, eps=1e-5), hidden, 4 * hidden))
        x = g.add(x, g.linear(h, 4 * hidden, hidden))
    x = g.layer_norm(x, hidden, eps=1e-5)
    # the head is tied to the embedding, as exports keep it: one initializer, transposed
    logits = g.node("MatMul", [x, g.node("Transpose", [wte], "lm_head", perm=[1, 0])], "logits")
    g.output(logits, ["batch", "sequence", vocab] if dynamic else [1, seq, vocab])
    return g.model()


# --------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class ZooEntry:
    name: str
    family: str  # "cnn", "transformer", "detector", "segmentation" or "audio"
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
    ZooEntry("yolo", "detector", yolo, "YOLOv8n-style detector (C2f, SPPF, PAN), 1x3x416x416"),
    ZooEntry("dbnet", "detector", dbnet,
             "DB-style text detector (ResNet-18 FPN, transposed-conv head), 1x3x640x640"),
    ZooEntry("unet", "segmentation", unet, "U-Net (transposed convs, batch norm), 1x3x256x256"),
    ZooEntry("deeplabv3", "segmentation", deeplab,
             "DeepLabV3 (ResNet-18, dilated convs, ASPP, bilinear), 1x3x384x384"),
    ZooEntry("mobilenetv3", "cnn", mobilenet_v3, "MobileNetV3-Large (hardswish, SE), 1x3x224x224"),
    ZooEntry("resnext50", "cnn", resnext, "ResNeXt-50 32x4d (grouped convs), 1x3x224x224"),
    ZooEntry("audio_cnn", "audio", audio_cnn, "1-D conv audio classifier, log-mel 1x64x512"),
    ZooEntry("vit_tiny", "transformer", vit, "ViT/DeiT-tiny, 1x3x224x224, 197 tokens"),
    ZooEntry("gpt2", "transformer", gpt2, "GPT-2 small decoder, causal, sequence 128"),
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

# donor pool v2: operators and shapes the paper's 11 lack (transposed convs, resize, unfolded
# batch norm, SiLU/hardswish, grouped and dilated convs, conv1d, image and causal attention)
FAMILY_NETWORKS = ["unet", "yolo", "mobilenetv3", "vit_tiny", "dbnet", "resnext50", "deeplabv3",
                   "audio_cnn", "gpt2"]

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
    path = Path(path)
    atomic_write_bytes(path, build(name, dynamic).SerializeToString())
    return path


def cached(name: str) -> Path:
    """The zoo network's ONNX file in the user cache, exported on first use."""
    get(name)
    path = cache_dir() / "zoo" / f"{name}.onnx"
    if not path.exists():
        export(name, path)
    return path


def name_of(spec) -> str:
    """The name a model goes by (its measurement table, leave-one-out): NAME for ``zoo:NAME``,
    else the file's stem, as :attr:`LoadedModel.name` will read it."""
    spec = str(spec)
    return spec[4:] if spec.startswith("zoo:") else Path(spec).stem


def load(path, input_shapes=None, fast_math: bool = True, layout: str = "nchw", target=None):
    """Load an ONNX model, or ``"zoo:NAME"`` for a zoo network (``input_shapes``:
    {name: [dims]} for dynamic inputs; ``fast_math``: :func:`ttrank.frontend.with_fast_math`,
    the default; False for libm's exact transcendentals; ``layout``, ``target``: as in
    :func:`ttrank.frontend.load`)."""
    if isinstance(path, str) and path.startswith("zoo:"):
        path = cached(path[4:])
    return frontend.load(path, input_shapes, fast_math=fast_math, layout=layout, target=target)
