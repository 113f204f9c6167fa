"""Third-party exports for bench/exports.py from PaddlePaddle through paddle2onnx (opset 11, as
PaddleOCR's and PaddleClas' deployment guides export them).

    python -m venv /tmp/pd && /tmp/pd/bin/pip install paddlepaddle paddle2onnx packaging
    /tmp/pd/bin/python bench/export_paddle.py OUT_DIR [name ...]
    python bench/exports.py OUT_DIR

Random init (pretrained=False), a dynamic batch axis. Failures go to OUT_DIR/export_failures.json.
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_common import export_all  # framework-free: every venv imports it

import paddle  # noqa: E402 - after the thread count is set
from paddle import nn  # noqa: E402
from paddle.vision import models as pm  # noqa: E402


def cbr(cin, cout, stride, act):
    return nn.Sequential(nn.Conv2D(cin, cout, 3, stride, 1), nn.BatchNorm2D(cout), act())


class DBTextDet(nn.Layer):
    """A PaddleOCR-style DB text detector: strided conv stages, an FPN with nearest upsampling
    to each stage's size, and a head of two Conv2DTranspose up to the input size, sigmoid."""

    def __init__(self, ch=(16, 24, 48, 96), fpn=64):
        super().__init__()
        self.stem = cbr(3, 16, 2, nn.Hardswish)
        self.stages = nn.LayerList([cbr(a, b, 2, nn.ReLU) for a, b in zip((16, *ch[:-1]), ch)])
        self.lateral = nn.LayerList([nn.Conv2D(c, fpn, 1) for c in ch])
        self.head = nn.Sequential(cbr(fpn, 16, 1, nn.ReLU), nn.Conv2DTranspose(16, 16, 2, 2), nn.BatchNorm2D(16),
                                  nn.ReLU(), nn.Conv2DTranspose(16, 1, 2, 2), nn.Sigmoid())

    def forward(self, x):
        feats = []
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        y = self.lateral[-1](feats[-1])
        for i in range(len(feats) - 2, -1, -1):
            # paddle2onnx 2.1 cannot write an integer scale_factor: sizes, as PaddleOCR's FPN does
            y = nn.functional.interpolate(y, size=feats[i].shape[2:], mode="nearest") + self.lateral[i](feats[i])
        return self.head(y)


S224 = [1, 3, 224, 224]
MODELS = {
    "pd_resnet50": (lambda: pm.resnet50(pretrained=False), S224),
    "pd_mobilenet_v3_large": (lambda: pm.mobilenet_v3_large(pretrained=False), S224),
    "pd_shufflenet_v2": (lambda: pm.shufflenet_v2_x1_0(pretrained=False), S224),
    "pd_db_textdet": (DBTextDet, [1, 3, 640, 640]),
}


def writer(name):
    fn, shape = MODELS[name]

    def write(path):
        paddle.seed(0)
        m = fn()
        m.eval()
        spec = [paddle.static.InputSpec(shape=[None, *shape[1:]], dtype="float32", name="x")]
        paddle.onnx.export(m, path[: -len(".onnx")], input_spec=spec, opset_version=11)
    return write


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    os.makedirs(sys.argv[1], exist_ok=True)
    export_all(sys.argv[1], [(n, writer(n)) for n in sys.argv[2:] or MODELS])
