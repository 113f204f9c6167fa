"""Third-party exports for bench/exports.py: torchvision's models (random init, weights=None,
so nothing is downloaded) through torch.onnx, as their users export them.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch==2.14.1 torchvision==0.29.1 onnx onnxscript
    OMP_NUM_THREADS=1 /tmp/tv/bin/python bench/export_torchvision.py OUT_DIR [name ...]
    python bench/exports.py OUT_DIR

ttrank does not depend on torch, hence the venv of its own. Writes OUT_DIR/<name>.onnx (the
legacy TorchScript exporter, opset 17), <name>_dynamo.onnx for a few models (the torch.export
based exporter, opset 20), and resnet34_dynbatch.onnx (legacy, a dynamic batch axis), plus a
hand-written DBNet-like text detector (ConvTranspose and bilinear upsampling). The detectors
with NMS in the graph (SSDlite, Faster R-CNN, a YOLOv5s with its post-processing) have their
BatchNorm statistics set by a few batches (:func:`calibrated`): at random init their scores were
all equal. Failures go to OUT_DIR/export_failures.json. On 2026-12-06 every one exported and
ran in onnxruntime.
"""
import os
import sys
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
import torch.nn as nn
import torchvision
import torchvision.models as tvm
import torchvision.models.detection as tvdet
import torchvision.models.segmentation as tvseg
import torchvision.models.video as tvvid

torch.set_num_threads(1)
# eval-mode attention takes a fused fast path that the TorchScript exporter cannot write
torch.backends.mha.set_fastpath_enabled(False)
try:
    torch.set_num_interop_threads(1)
except RuntimeError:
    pass
warnings.filterwarnings("ignore")

from export_common import export_all  # after the thread counts are set

OUT = "."


class SegOut(nn.Module):
    """Return only the 'out' tensor of a torchvision segmentation model."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x)["out"]


def cbr(cin, cout, stride=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


class ResStage(nn.Module):
    """conv3x3+BN+ReLU (optionally strided) followed by a residual conv3x3+BN+ReLU pair."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.down = cbr(cin, cout, stride)
        self.c1 = cbr(cout, cout)
        self.c2 = nn.Sequential(nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.down(x)
        return self.act(x + self.c2(self.c1(x)))


class TextDet(nn.Module):
    """Small DBNet-like text detector: 4-stage ResNet-ish backbone, FPN, sigmoid prob map."""

    def __init__(self, ch=(32, 64, 128, 256), fpn=64):
        super().__init__()
        self.stem = cbr(3, ch[0], 2)  # 1/2
        self.s1 = ResStage(ch[0], ch[0], 1)  # 1/2
        self.s2 = ResStage(ch[0], ch[1], 2)  # 1/4
        self.s3 = ResStage(ch[1], ch[2], 2)  # 1/8
        self.s4 = ResStage(ch[2], ch[3], 2)  # 1/16
        self.lat = nn.ModuleList([nn.Conv2d(c, fpn, 1) for c in ch])
        self.up4 = nn.ConvTranspose2d(fpn, fpn, kernel_size=2, stride=2)
        self.up3 = nn.ConvTranspose2d(fpn, fpn, kernel_size=2, stride=2)
        self.up2 = nn.Upsample(scale_factor=2, mode="bilinear")
        self.head = nn.Sequential(
            cbr(fpn, fpn // 2),
            nn.Conv2d(fpn // 2, 1, 1),
            nn.Sigmoid(),
        )

    def forward(self, x):
        c1 = self.s1(self.stem(x))
        c2 = self.s2(c1)
        c3 = self.s3(c2)
        c4 = self.s4(c3)
        p4 = self.lat[3](c4)
        p3 = self.lat[2](c3) + self.up4(p4)
        p2 = self.lat[1](c2) + self.up3(p3)
        p1 = self.lat[0](c1) + self.up2(p2)
        return self.head(p1)


def cbs(cin, cout, k=1, s=1, p=None):
    """YOLOv5's Conv: conv + BN + SiLU."""
    p = k // 2 if p is None else p
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, p, bias=False), nn.BatchNorm2d(cout), nn.SiLU())


class C3(nn.Module):
    """YOLOv5's C3 block: two 1x1 branches, n bottlenecks on one, concat, 1x1."""

    def __init__(self, cin, cout, n=1, shortcut=True):
        super().__init__()
        h = cout // 2
        self.a, self.b, self.out = cbs(cin, h), cbs(cin, h), cbs(2 * h, cout)
        self.m = nn.ModuleList(nn.Sequential(cbs(h, h), cbs(h, h, 3)) for _ in range(n))
        self.shortcut = shortcut

    def forward(self, x):
        y = self.a(x)
        for m in self.m:
            y = y + m(y) if self.shortcut else m(y)
        return self.out(torch.cat([y, self.b(x)], 1))


class SPPF(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.a, self.out = cbs(cin, cin // 2), cbs(cin * 2, cout)
        self.pool = nn.MaxPool2d(5, 1, 2)

    def forward(self, x):
        x = self.a(x)
        y1 = self.pool(x)
        y2 = self.pool(y1)
        return self.out(torch.cat([x, y1, y2, self.pool(y2)], 1))


class YoloV5s(nn.Module):
    """YOLOv5s-like detector at 640x640 (width 0.5, depth 0.33): C3 backbone, SPPF, PAN neck,
    and the raw head as exported for deployment: sigmoid, grid decode, one (1, N, 85) tensor."""

    def __init__(self, nc=80, w=(32, 64, 128, 256, 512)):
        super().__init__()
        self.b = nn.ModuleList([cbs(3, w[0], 6, 2, 2), cbs(w[0], w[1], 3, 2), C3(w[1], w[1], 1),
                                cbs(w[1], w[2], 3, 2), C3(w[2], w[2], 2), cbs(w[2], w[3], 3, 2),
                                C3(w[3], w[3], 3), cbs(w[3], w[4], 3, 2), C3(w[4], w[4], 1), SPPF(w[4], w[4])])
        self.l10, self.c13 = cbs(w[4], w[3]), C3(w[4], w[3], 1, False)
        self.l14, self.c17 = cbs(w[3], w[2]), C3(w[3], w[2], 1, False)
        self.d18, self.c20 = cbs(w[2], w[2], 3, 2), C3(w[3], w[3], 1, False)
        self.d21, self.c23 = cbs(w[3], w[3], 3, 2), C3(w[4], w[4], 1, False)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.no = nc + 5
        self.heads = nn.ModuleList(nn.Conv2d(c, 3 * self.no, 1) for c in (w[2], w[3], w[4]))

    def forward(self, x):
        feats = []
        for i, m in enumerate(self.b):
            x = m(x)
            if i in (4, 6):
                feats.append(x)
        p4, p3 = feats[1], feats[0]
        t10 = self.l10(x)
        t13 = self.c13(torch.cat([self.up(t10), p4], 1))
        t14 = self.l14(t13)
        o17 = self.c17(torch.cat([self.up(t14), p3], 1))
        o20 = self.c20(torch.cat([self.d18(o17), t14], 1))
        o23 = self.c23(torch.cat([self.d21(o20), t10], 1))
        out = []
        for head, f, stride in zip(self.heads, (o17, o20, o23), (8, 16, 32)):
            y = head(f)
            n, _, h, w_ = y.shape
            y = y.view(n, 3, self.no, h, w_).permute(0, 1, 3, 4, 2).sigmoid()
            gy, gx = torch.meshgrid(torch.arange(h, dtype=y.dtype), torch.arange(w_, dtype=y.dtype), indexing="ij")
            grid = torch.stack((gx, gy), 2).view(1, 1, h, w_, 2)
            xy = (y[..., :2] * 2 - 0.5 + grid) * stride
            wh = (y[..., 2:4] * 2) ** 2 * stride * 4
            out.append(torch.cat((xy, wh, y[..., 4:]), -1).view(n, -1, self.no))
        return torch.cat(out, 1)


class YoloNMS(nn.Module):
    """The YOLOv5s above exported with its post-processing, as `export(nms=True)`-style
    deployments have it: confidence threshold, best class, class-aware NMS, at most 300 boxes
    (NonZero, NonMaxSuppression and data-dependent shapes in the graph). Calibrated."""

    def __init__(self):
        super().__init__()
        self.m = calibrated(YoloV5s(), torch.zeros(1, 3, 640, 640))

    def forward(self, x):
        p = self.m(x)[0]  # (N, 85): cx, cy, w, h, objectness, 80 class scores
        conf, cls = (p[:, 5:] * p[:, 4:5]).max(1)
        keep = conf > 0.25
        p, conf, cls = p[keep], conf[keep], cls[keep]
        xy, wh = p[:, :2], p[:, 2:4] / 2
        boxes = torch.cat((xy - wh, xy + wh), 1)
        i = torchvision.ops.batched_nms(boxes, conf, cls, 0.45)[:300]
        return boxes[i], conf[i], cls[i]


class CRNN(nn.Module):
    """CRNN text recognizer: a VGG-ish conv stack over a 32x128 grey crop, then a two-layer
    bidirectional LSTM over the 32 columns, and per-column class logits."""

    def __init__(self, classes=37, hidden=128):
        super().__init__()
        self.cnn = nn.Sequential(cbr(1, 64), nn.MaxPool2d(2), cbr(64, 128), nn.MaxPool2d(2), cbr(128, 256),
                                 cbr(256, 256), nn.MaxPool2d((2, 1)), cbr(256, 256), nn.MaxPool2d((4, 1)))
        self.rnn = nn.LSTM(256, hidden, num_layers=2, bidirectional=True)
        self.fc = nn.Linear(2 * hidden, classes)

    def forward(self, x):
        f = self.cnn(x).squeeze(2).permute(2, 0, 1)  # (T, N, C)
        y, _ = self.rnn(f)
        return self.fc(y)


class TextEncoder(nn.Module):
    """A BERT-mini-like sentence classifier: token embedding, learned positions, 4 post-norm
    encoder layers (d 256, 4 heads, GELU), first-token pooling. Its input is int64 token ids."""

    def __init__(self, vocab=30522, seq=128, d=256, layers=4, classes=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(1, seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, activation="gelu", batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.cls = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, ids):
        return self.cls(self.norm(self.enc(self.tok(ids) + self.pos))[:, 0])


def calibrated(m, x, part=None):
    """``m`` with activations of order one. Random init leaves BatchNorm's running statistics
    at 0/1, and deep nets' activations vanish: every score of a random SSDlite was 1/91, every
    float16 EfficientNet-B0 logit 0, which checks nothing. A few batches through ``part``
    (default ``m``; a detector's backbone, as the whole one wants targets in train mode) in
    train mode set the statistics; zero-initialised heads (ViT's) get random weights."""
    for mod in m.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            mod.momentum = None  # a plain average over the batches below
        if isinstance(mod, nn.Linear) and not mod.weight.any():
            nn.init.normal_(mod.weight, std=0.02)
    part = part or m
    if any(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in part.modules()):
        part.train()
        with torch.no_grad():
            for _ in range(3):
                part(torch.randn(4, *x.shape[1:]))
    return m.eval()


class Detections(nn.Module):
    """A torchvision detector's first image's boxes, scores and labels (NMS included), its
    backbone calibrated (:func:`calibrated`)."""

    def __init__(self, m):
        super().__init__()
        self.m = calibrated(m, torch.zeros(1, 3, 320, 320), m.backbone)

    def forward(self, x):
        d = self.m(list(x))[0]
        return d["boxes"], d["scores"], d["labels"]


S224 = (1, 3, 224, 224)
# name -> (builder, input shape)
MODELS = {
    "resnet34": (lambda: tvm.resnet34(weights=None), S224),
    "shufflenet_v2_x1_0": (lambda: tvm.shufflenet_v2_x1_0(weights=None), S224),
    "squeezenet1_1": (lambda: tvm.squeezenet1_1(weights=None), S224),
    "densenet121": (lambda: tvm.densenet121(weights=None), S224),
    "regnet_y_400mf": (lambda: tvm.regnet_y_400mf(weights=None), S224),
    "convnext_tiny": (lambda: tvm.convnext_tiny(weights=None), S224),
    "efficientnet_v2_s": (lambda: tvm.efficientnet_v2_s(weights=None), S224),
    "mobilenet_v3_small": (lambda: tvm.mobilenet_v3_small(weights=None), S224),
    "swin_t": (lambda: tvm.swin_t(weights=None), S224),
    "deeplabv3_mobilenet_v3_large": (
        lambda: SegOut(tvseg.deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None)),
        S224,
    ),
    "inception_v3": (
        lambda: tvm.inception_v3(weights=None, aux_logits=False, init_weights=True),
        (1, 3, 299, 299),
    ),
    "r3d_18": (lambda: tvvid.r3d_18(weights=None), (1, 3, 8, 112, 112)),
    "wide_resnet50_2": (lambda: tvm.wide_resnet50_2(weights=None), S224),
    "textdet": (lambda: TextDet(), (1, 3, 640, 640)),
    # the second batch (2026-12-06, session 46): transformers, a YOLO, a recurrent net, a
    # detector with NMS in the graph, token-id input
    "vit_b_32": (lambda: tvm.vit_b_32(weights=None), S224),
    "maxvit_t": (lambda: tvm.maxvit_t(weights=None), S224),
    "regnet_x_1_6gf": (lambda: tvm.regnet_x_1_6gf(weights=None), S224),
    "lraspp_mobilenet_v3_large": (
        lambda: SegOut(tvseg.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None)),
        (1, 3, 320, 320),
    ),
    "efficientnet_b1": (lambda: tvm.efficientnet_b1(weights=None), (1, 3, 240, 240)),
    "yolov5s": (lambda: YoloV5s(), (1, 3, 640, 640)),
    "crnn": (lambda: CRNN(), (1, 1, 32, 128)),
    "text_encoder": (lambda: TextEncoder(), (1, 128)),
    "ssdlite320_mobilenet_v3_large": (
        lambda: Detections(tvdet.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None)),
        (1, 3, 320, 320),
    ),
    # the third batch (2026-12-06, session 49): detectors with their post-processing in the
    # graph, which ttrank compiles up to it (ttrank.partition); the SSDlite above recalibrated
    "yolov5s_nms": (lambda: YoloNMS(), (1, 3, 640, 640)),
    "fasterrcnn_mobilenet_v3_large_320_fpn": (
        lambda: Detections(tvdet.fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None)),
        (1, 3, 320, 320),
    ),
}
DYNAMO = ["resnet34", "shufflenet_v2_x1_0", "convnext_tiny", "mobilenet_v3_small", "efficientnet_b1", "vit_b_32",
          "text_encoder"]


def build(name):
    fn, shape = MODELS[name]
    torch.manual_seed(0)
    m = fn().eval()
    torch.manual_seed(0)
    x = torch.randint(0, 30522, shape) if name == "text_encoder" else torch.randn(*shape)
    return m, x


def export_legacy(m, x, path, dynamic_axes=None, input_names=("input",), output_names=("output",)):
    with torch.no_grad():
        torch.onnx.export(
            m, x, path, opset_version=17, dynamo=False,
            input_names=list(input_names), output_names=list(output_names),
            do_constant_folding=True, dynamic_axes=dynamic_axes,
        )


def export_dynamo(m, x, path):
    torch.onnx.export(m, x if isinstance(x, tuple) else (x,), path, dynamo=True, external_data=False)


def writer(model, kind):
    def write(path):
        m, x = build(model)
        if kind == "legacy":
            export_legacy(m, x, path)
        elif kind == "legacy_dynbatch":
            export_legacy(m, x, path, {"input": {0: "N"}, "output": {0: "N"}})
        else:
            export_dynamo(m, x, path)
    return write


def main(names):
    jobs = []
    for n in names:
        jobs.append((n, writer(n, "legacy")))
        if n in DYNAMO:
            jobs.append((n + "_dynamo", writer(n, "dynamo")))
        if n == "resnet34":
            jobs.append((n + "_dynbatch", writer(n, "legacy_dynbatch")))
    export_all(OUT, jobs)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    OUT = sys.argv[1]
    os.makedirs(OUT, exist_ok=True)
    main(sys.argv[2:] or list(MODELS))
