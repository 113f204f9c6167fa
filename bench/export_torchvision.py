"""Third-party exports for bench/exports.py: torchvision's models (random init, weights=None,
so nothing is downloaded) through torch.onnx, as their users export them.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch==2.14.1 torchvision==0.29.1 onnx onnxscript
    OMP_NUM_THREADS=1 /tmp/tv/bin/python bench/export_torchvision.py OUT_DIR [name ...]
    python bench/exports.py OUT_DIR

ttrank does not depend on torch, hence the venv of its own. Writes OUT_DIR/<name>.onnx (the
legacy TorchScript exporter, opset 17), <name>_dynamo.onnx for a few models (the torch.export
based exporter, opset 20), and resnet34_dynbatch.onnx (legacy, a dynamic batch axis), plus a
hand-written DBNet-like text detector (ConvTranspose and bilinear upsampling). Failures go to
OUT_DIR/export_failures.json. On 2026-12-06 every one exported and ran in onnxruntime.
"""
import json
import os
import sys
import traceback
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
import torch.nn as nn
import torchvision.models as tvm
import torchvision.models.segmentation as tvseg
import torchvision.models.video as tvvid

torch.set_num_threads(1)
try:
    torch.set_num_interop_threads(1)
except RuntimeError:
    pass
warnings.filterwarnings("ignore")

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
}
DYNAMO = ["resnet34", "shufflenet_v2_x1_0", "convnext_tiny", "mobilenet_v3_small"]


def one_line(e):
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}"[:400]


def build(name):
    fn, shape = MODELS[name]
    torch.manual_seed(0)
    m = fn().eval()
    torch.manual_seed(0)
    x = torch.randn(*shape)
    return m, x


def rm(path):
    for p in (path, path + ".data"):
        if os.path.exists(p):
            os.remove(p)


def export_legacy(m, x, path, dynamic_axes=None):
    with torch.no_grad():
        torch.onnx.export(
            m, x, path, opset_version=17, dynamo=False,
            input_names=["input"], output_names=["output"],
            do_constant_folding=True, dynamic_axes=dynamic_axes,
        )


def export_dynamo(m, x, path):
    torch.onnx.export(m, (x,), path, dynamo=True, external_data=False)


def main(names):
    fails_path = os.path.join(OUT, "export_failures.json")
    fails = json.load(open(fails_path)) if os.path.exists(fails_path) else {}
    jobs = []
    for n in names:
        jobs.append((n, n, "legacy"))
        if n in DYNAMO:
            jobs.append((n, n + "_dynamo", "dynamo"))
        if n == "resnet34":
            jobs.append((n, n + "_dynbatch", "legacy_dynbatch"))
    for model, fname, kind in jobs:
        path = os.path.join(OUT, fname + ".onnx")
        rm(path)
        print(f"[export] {fname} ({kind})", flush=True)
        try:
            m, x = build(model)
            if kind == "legacy":
                export_legacy(m, x, path)
            elif kind == "legacy_dynbatch":
                export_legacy(m, x, path, {"input": {0: "N"}, "output": {0: "N"}})
            else:
                export_dynamo(m, x, path)
            if os.path.exists(path + ".data"):
                raise RuntimeError("exporter wrote external data despite external_data=False")
            fails.pop(fname, None)
            print(f"[ok] {fname} {os.path.getsize(path) / 2**20:.1f} MB", flush=True)
        except Exception as e:  # record and go on
            traceback.print_exc()
            rm(path)
            fails[fname] = {"model": model, "exporter": kind, "error": one_line(e)}
            print(f"[FAIL] {fname}: {one_line(e)}", flush=True)
        json.dump(fails, open(fails_path, "w"), indent=1, sort_keys=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    OUT = sys.argv[1]
    os.makedirs(OUT, exist_ok=True)
    main(sys.argv[2:] or list(MODELS))
