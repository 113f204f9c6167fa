"""Third-party exports for bench/exports.py from another exporter: Keras models through tf2onnx,
and torchvision models at the old opsets (7-12) of the ONNX Model Zoo's era.

    python -m venv /tmp/tf && /tmp/tf/bin/pip install tensorflow-cpu==2.15.1 tf2onnx
    /tmp/tf/bin/python bench/export_keras.py OUT_DIR [name ...]        # the Keras models
    /tmp/tv/bin/python bench/export_keras.py OUT_DIR --old-opsets [name ...]  # torch venv (export_torchvision)
    python bench/exports.py OUT_DIR

tf2onnx writes NHWC graphs (a Transpose at the input, its layout optimiser pushing the rest
into the convs), Keras' own padding and activation layers, and a dynamic batch axis. Random
init (weights=None), so nothing is downloaded. Failures go to OUT_DIR/export_failures.json.
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_common import export_all  # framework-free: both venvs import it


def keras_models():
    """name -> (builder, input shape without the batch axis)."""
    import tensorflow as tf

    ka, L = tf.keras.applications, tf.keras.layers

    def unet():
        """A small Keras U-Net: Conv2DTranspose up-sampling, skip concats, BN and ReLU."""
        x = inp = tf.keras.Input((256, 256, 3))
        skips = []
        for f in (32, 64, 128):
            x = L.ReLU()(L.BatchNormalization()(L.Conv2D(f, 3, padding="same")(x)))
            x = L.ReLU()(L.BatchNormalization()(L.Conv2D(f, 3, padding="same")(x)))
            skips.append(x)
            x = L.MaxPool2D()(x)
        x = L.Conv2D(256, 3, padding="same", activation="relu")(x)
        for f, s in zip((128, 64, 32), reversed(skips)):
            x = L.Conv2DTranspose(f, 2, strides=2)(x)
            x = L.Concatenate()([x, s])
            x = L.Conv2D(f, 3, padding="same", activation="relu")(x)
        return tf.keras.Model(inp, L.Conv2D(2, 1, activation="softmax")(x))

    def lstm_classifier():
        """Embedding, a bidirectional LSTM and a dense head: a Keras text classifier."""
        inp = tf.keras.Input((64,), dtype="int32")
        x = L.Embedding(20000, 128)(inp)
        x = L.Bidirectional(L.LSTM(64, return_sequences=True))(x)
        x = L.GlobalMaxPool1D()(x)
        return tf.keras.Model(inp, L.Dense(4, activation="softmax")(L.Dense(64, activation="relu")(x)))

    return {
        "tf_mobilenet_v2": lambda: ka.MobileNetV2(weights=None),
        "tf_efficientnet_b0": lambda: ka.EfficientNetB0(weights=None),
        "tf_resnet50": lambda: ka.ResNet50(weights=None),
        "tf_xception": lambda: ka.Xception(weights=None),
        "tf_nasnet_mobile": lambda: ka.NASNetMobile(weights=None),
        "tf_mobilenet_v3_small": lambda: ka.MobileNetV3Small(weights=None, input_shape=(224, 224, 3)),
        "tf_unet": unet,
        "tf_lstm_classifier": lstm_classifier,
    }


def keras_jobs(names):
    import tensorflow as tf
    import tf2onnx

    tf.config.threading.set_intra_op_parallelism_threads(1)
    models = keras_models()

    def writer(name):
        def write(path):
            tf.keras.utils.set_random_seed(0)
            m = models[name]()
            spec = [tf.TensorSpec((None, *i.shape[1:]), i.dtype, name=i.name) for i in m.inputs]
            tf2onnx.convert.from_keras(m, input_signature=spec, opset=15, output_path=path)
        return write

    return [(n, writer(n)) for n in names or models]


def old_opset_jobs(names):
    """torchvision models through torch.onnx at opsets 7-12, in the forms exporters wrote then:
    initializers listed as graph inputs, unfolded constants, Upsample and opset-10/11 Resize."""
    import torch
    import torchvision.models as tvm
    import torchvision.models.segmentation as tvseg

    from export_torchvision import SegOut, TextDet, YoloV5s

    models = {
        # name -> (builder, input shape, opset, torch.onnx.export's extra arguments)
        "resnet18_op9_initin": (lambda: tvm.resnet18(), 224, 9, {"keep_initializers_as_inputs": True}),
        "squeezenet_op7": (lambda: tvm.squeezenet1_0(), 224, 7, {}),
        "shufflenet_op9": (lambda: tvm.shufflenet_v2_x1_0(), 224, 9, {}),
        "textdet_op9": (lambda: TextDet(), 640, 9, {}),
        "yolov5s_op10": (lambda: YoloV5s(), 640, 10, {}),
        "inception_v3_op10": (lambda: tvm.inception_v3(aux_logits=False, init_weights=True), 299, 10, {}),
        "mobilenet_v2_op11_nofold": (lambda: tvm.mobilenet_v2(), 224, 11, {"do_constant_folding": False}),
        "fcn_resnet50_op11": (lambda: SegOut(tvseg.fcn_resnet50(weights=None, weights_backbone=None)), 224, 11, {}),
        "googlenet_op12": (lambda: tvm.googlenet(aux_logits=False, init_weights=True), 224, 12, {}),
    }

    def writer(name):
        fn, size, opset, extra = models[name]

        def write(path):
            torch.manual_seed(0)
            m = fn().eval()
            x = torch.randn(1, 3, size, size)
            with torch.no_grad():
                torch.onnx.export(m, x, path, opset_version=opset, dynamo=False, input_names=["data"],
                                  output_names=["out"], **extra)
        return write

    return [(n, writer(n)) for n in names or models]


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--old-opsets"]
    if not args:
        sys.exit(__doc__)
    out, names = args[0], args[1:]
    os.makedirs(out, exist_ok=True)
    jobs = old_opset_jobs(names) if "--old-opsets" in sys.argv else keras_jobs(names)
    export_all(out, jobs)
