"""Half-precision third-party exports for bench/exports.py: torchvision models exported after
``.half()``, and float32 exports converted by onnxconverter-common's
``convert_float_to_float16`` (the tool onnxruntime's documentation points to), once with
float16 inputs and outputs and once keeping them float32 (``keep_io_types``).

    /tmp/tv/bin/pip install onnxconverter-common   # the venv of bench/export_torchvision.py
    OMP_NUM_THREADS=1 /tmp/tv/bin/python bench/export_half.py OUT_DIR [name ...]
    python bench/exports.py OUT_DIR
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
import onnx
import torch
import torchvision.models as tvm
from onnxconverter_common import float16

from export_common import export_all
from export_torchvision import TextEncoder, YoloV5s, calibrated

torch.set_num_threads(1)
torch.backends.mha.set_fastpath_enabled(False)

# name -> (builder, input shape, how: "half" = .half() before torch.onnx, "convert" = float16
# throughout by onnxconverter-common, "convert_keepio" = the same with float32 inputs/outputs)
MODELS = {
    "resnet18_fp16": (lambda: tvm.resnet18(), (1, 3, 224, 224), "half"),
    "mobilenet_v3_small_fp16": (lambda: tvm.mobilenet_v3_small(), (1, 3, 224, 224), "half"),
    "text_encoder_fp16": (lambda: TextEncoder(), (1, 128), "half"),
    "efficientnet_b0_fp16conv": (lambda: tvm.efficientnet_b0(), (1, 3, 224, 224), "convert"),
    "yolov5s_fp16conv_keepio": (lambda: YoloV5s(), (1, 3, 640, 640), "convert_keepio"),
    # (convert_float_to_float16 leaves ViT's attention scale a float32 Div operand, which
    # onnxruntime refuses: exported after .half() instead)
    "vit_b_32_fp16": (lambda: tvm.vit_b_32(), (1, 3, 224, 224), "half"),
}


def writer(name):
    fn, shape, how = MODELS[name]

    def write(path):
        torch.manual_seed(0)
        x = torch.randint(0, 30522, shape) if name.startswith("text_encoder") else torch.randn(*shape)
        m = calibrated(fn().eval(), x)
        if how == "half":
            m = m.half()
            x = x if x.dtype == torch.int64 else x.half()
        with torch.no_grad():
            torch.onnx.export(m, x, path, opset_version=17, dynamo=False, input_names=["input"],
                              output_names=["output"])
        if how.startswith("convert"):
            model = float16.convert_float_to_float16(onnx.load(path), keep_io_types=how.endswith("keepio"))
            onnx.save(model, path)
    return write


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out, names = sys.argv[1], sys.argv[2:] or list(MODELS)
    os.makedirs(out, exist_ok=True)
    export_all(out, [(n, writer(n)) for n in names])
