"""The third batch of third-party exports for bench/exports.py: timm's and Hugging Face
transformers' models (random init from their configs, so nothing is downloaded), and two
hand-written ones (a diffusion-style UNet and a GRU keyword spotter), as their users export them.

    /tmp/tv/bin/pip install torch==2.14.1 torchvision==0.29.1 onnx onnxscript timm transformers
    OMP_NUM_THREADS=1 /tmp/tv/bin/python bench/export_hub.py OUT_DIR [name ...]
    python bench/exports.py OUT_DIR

The transformers exports have dynamic batch and sequence axes, as Optimum writes them, so each
gets OUT_DIR/<name>.args with the --input-shape that binds them (bench/exports.py passes it).
Shares its export loop with bench/export_torchvision.py. A fourth batch: CLIP (text and image
inputs), DETR, an ESPCN-style super-resolution net (PixelShuffle), and DistilBERT after
onnxruntime's transformer optimizer (com.microsoft ops):

    OMP_NUM_THREADS=1 /tmp/tv/bin/python bench/export_hub.py OUT_DIR clip_vit_b32 detr_resnet18 \
        sr_pixelshuffle distilbert_ortopt

A fifth: CLIP after the optimizer (QuickGelu), DistilBERT after it at opt_level 99, and
DistilBERT as onnxruntime saves its own optimized graph (FusedMatMul):

    OMP_NUM_THREADS=1 /tmp/tv/bin/python bench/export_hub.py OUT_DIR clip_vit_b32_ortopt \
        distilbert_ortopt99 distilbert_ortsaved
"""
import os
import sys
import tempfile

# first: it sets the thread counts before torch loads
from export_torchvision import export_dynamo, export_legacy
from export_common import export_all

import timm
import torch
import transformers as hf
from torch import nn


class Hidden(nn.Module):
    """A transformers model's last hidden state (or logits), as one plain tensor."""

    def __init__(self, m, field="last_hidden_state"):
        super().__init__()
        self.m, self.field = m, field

    def forward(self, *args):
        return getattr(self.m(*args), self.field)


def gn_block(cin, cout):
    return nn.Sequential(nn.GroupNorm(32, cin), nn.SiLU(), nn.Conv2d(cin, cout, 3, 1, 1))


class ResBlock(nn.Module):
    """A diffusion UNet's residual block: (GroupNorm, SiLU, conv3x3) twice, 1x1 skip."""

    def __init__(self, cin, cout):
        super().__init__()
        self.a, self.b = gn_block(cin, cout), gn_block(cout, cout)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        return self.skip(x) + self.b(self.a(x))


class UNet(nn.Module):
    """A diffusion-style UNet (no timestep input): residual GroupNorm blocks, strided-conv
    downsampling, nearest upsampling + conv, skip concatenation, a self-attention block at the
    bottom (one head over the 32x32 positions)."""

    def __init__(self, ch=(64, 128, 256)):
        super().__init__()
        self.inp = nn.Conv2d(3, ch[0], 3, 1, 1)
        self.down = nn.ModuleList()
        c = ch[0]
        for co in ch:
            self.down.append(nn.ModuleList([ResBlock(c, co), nn.Conv2d(co, co, 3, 2, 1)]))
            c = co
        self.mid = ResBlock(c, c)
        self.norm, self.qkv, self.proj = nn.GroupNorm(32, c), nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)
        self.up = nn.ModuleList()
        for co in reversed(ch):
            self.up.append(nn.ModuleList([nn.Conv2d(c, c, 3, 1, 1), ResBlock(c + co, co)]))
            c = co
        self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 3, 3, 1, 1))

    def forward(self, x):
        x = self.inp(x)
        skips = []
        for block, down in self.down:
            x = block(x)
            skips.append(x)
            x = down(x)
        x = self.mid(x)
        n, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(n, 3, c, h * w).unbind(1)
        a = torch.softmax(q.transpose(1, 2) @ k / c ** 0.5, -1)
        x = x + self.proj((v @ a.transpose(1, 2)).reshape(n, c, h, w))
        for (conv, block), s in zip(self.up, reversed(skips)):
            x = conv(nn.functional.interpolate(x, scale_factor=2.0, mode="nearest"))
            x = block(torch.cat([x, s], 1))
        return self.out(x)


class KWS(nn.Module):
    """A keyword spotter over 40 log-mel bands x 98 frames: two 1-D convs, a two-layer
    bidirectional GRU, attention pooling over time, 12 classes."""

    def __init__(self, mels=40, hidden=128, classes=12):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(mels, 128, 5, 1, 2), nn.BatchNorm1d(128), nn.ReLU(),
                                  nn.Conv1d(128, 128, 5, 2, 2), nn.BatchNorm1d(128), nn.ReLU())
        self.gru = nn.GRU(128, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.att, self.fc = nn.Linear(2 * hidden, 1), nn.Linear(2 * hidden, classes)

    def forward(self, x):
        y, _ = self.gru(self.conv(x).transpose(1, 2))
        w = torch.softmax(self.att(y), 1)
        return self.fc((w * y).sum(1))


def timm_model(name, **kw):
    m = timm.create_model(name, pretrained=False, **kw)
    # FastViT-style models are exported reparameterised (one conv per branch set), as deployed
    return timm.utils.reparameterize_model(m) if name.startswith(("fastvit", "mobileone", "repvgg")) else m


SEQ = 128
# name -> (builder, example inputs, input names, dynamic axes, ttrank recommend args)
TEXT_AXES = {0: "batch", 1: "sequence"}
MODELS = {
    "mobilevit_s": (lambda: timm_model("mobilevit_s"), (1, 3, 256, 256)),
    "efficientformer_l1": (lambda: timm_model("efficientformer_l1"), (1, 3, 224, 224)),
    "ghostnet_100": (lambda: timm_model("ghostnet_100"), (1, 3, 224, 224)),
    "hrnet_w18_small": (lambda: timm_model("hrnet_w18_small"), (1, 3, 224, 224)),
    "levit_128s": (lambda: timm_model("levit_128s"), (1, 3, 224, 224)),
    "poolformer_s12": (lambda: timm_model("poolformer_s12"), (1, 3, 224, 224)),
    "mobilenetv4_conv_small": (lambda: timm_model("mobilenetv4_conv_small"), (1, 3, 224, 224)),
    "cspdarknet53": (lambda: timm_model("cspdarknet53"), (1, 3, 256, 256)),
    "fastvit_t8": (lambda: timm_model("fastvit_t8"), (1, 3, 256, 256)),
    "resnet50d": (lambda: timm_model("resnet50d"), (1, 3, 224, 224)),
    "dla34": (lambda: timm_model("dla34"), (1, 3, 224, 224)),
    "edgenext_small": (lambda: timm_model("edgenext_small"), (1, 3, 256, 256)),
    "unet": (lambda: UNet(), (1, 3, 256, 256)),
    "kws_gru": (lambda: KWS(), (1, 40, 98)),
    "distilbert": (lambda: Hidden(hf.DistilBertModel(hf.DistilBertConfig())),
                   ("ids", "mask"), ("input_ids", "attention_mask")),
    "gpt2_6l": (lambda: Hidden(hf.GPT2Model(hf.GPT2Config(n_layer=6, use_cache=False))),
                ("ids",), ("input_ids",)),
    "t5_small_encoder": (lambda: Hidden(hf.T5EncoderModel(hf.T5Config(d_model=512, num_layers=6, num_heads=8,
                                                                        d_ff=2048, d_kv=64))),
                         ("ids",), ("input_ids",)),
    "whisper_tiny_encoder": (lambda: Hidden(hf.WhisperModel(hf.WhisperConfig(
        d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
        decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536)).get_encoder()),
        (1, 80, 3000)),
    "wav2vec2_4l": (lambda: Hidden(hf.Wav2Vec2Model(hf.Wav2Vec2Config(num_hidden_layers=4))), (1, 16000)),
    "segformer_b0": (lambda: Hidden(hf.SegformerForSemanticSegmentation(hf.SegformerConfig()), "logits"),
                     (1, 3, 512, 512)),
}
# the fourth batch (2026-12-06, session 49): models with several image/text inputs, a set
# prediction detector, sub-pixel upsampling; static shapes. name -> (builder, example inputs)
class Clip(nn.Module):
    """CLIP ViT-B/32 (text and image towers): the image-text logits of one image and one text."""

    def __init__(self):
        super().__init__()
        self.m = hf.CLIPModel(hf.CLIPConfig())

    def forward(self, ids, pixels):
        return self.m(input_ids=ids, pixel_values=pixels).logits_per_image


class Detr(nn.Module):
    """DETR with a ResNet-18 backbone (timm): class logits and boxes of its 100 queries."""

    def __init__(self):
        super().__init__()
        self.m = hf.DetrForObjectDetection(hf.DetrConfig(use_timm_backbone=True, use_pretrained_backbone=False,
                                                         backbone="resnet18"))

    def forward(self, x):
        o = self.m(pixel_values=x)
        return o.logits, o.pred_boxes


class SubPixel(nn.Module):
    """ESPCN-style 3x super-resolution: tanh convs, then PixelShuffle (DepthToSpace)."""

    def __init__(self, r=3):
        super().__init__()
        self.b = nn.Sequential(nn.Conv2d(3, 64, 5, padding=2), nn.Tanh(), nn.Conv2d(64, 32, 3, padding=1), nn.Tanh(),
                               nn.Conv2d(32, 3 * r * r, 3, padding=1), nn.PixelShuffle(r))

    def forward(self, x):
        return self.b(x)


STATIC = {
    "clip_vit_b32": (lambda: Clip(), (torch.randint(0, 1000, (1, 77)), torch.randn(1, 3, 224, 224))),
    "detr_resnet18": (lambda: Detr(), (torch.randn(1, 3, 320, 320),)),
    "sr_pixelshuffle": (lambda: SubPixel(), (torch.randn(1, 3, 128, 128),)),
}
# onnxruntime's transformer optimizer run on the legacy export of <base> (SkipLayerNormalization,
# BiasGelu: com.microsoft ops), as Optimum's optimized exports have it. name -> (base, its arguments)
ORT_OPTIMIZED = {
    "distilbert_ortopt": ("distilbert", {"model_type": "bert", "num_heads": 12, "hidden_size": 768}),
    # the fifth batch (session 50): the optimizer's other model types, and opt_level 99, which
    # saves onnxruntime's own graph optimizations (FusedMatMul) in the file
    "clip_vit_b32_ortopt": ("clip_vit_b32", {"model_type": "clip", "num_heads": 0, "hidden_size": 0}),
    "distilbert_ortopt99": ("distilbert", {"model_type": "bert", "num_heads": 12, "hidden_size": 768,
                                           "opt_level": 99}),
}
# the graph onnxruntime itself optimizes (ORT_ENABLE_EXTENDED: FusedMatMul, fused Gelu and
# LayerNorm), saved with SessionOptions.optimized_model_filepath, as some published files are.
# name -> base
ORT_SAVED = {"distilbert_ortsaved": "distilbert"}


def static_writer(name):
    def write(path):
        fn, x = STATIC[name]
        torch.manual_seed(0)
        with torch.no_grad():
            torch.onnx.export(fn().eval(), x, path, opset_version=17, dynamo=False)
    return write


def ort_saved_writer(name):
    def write(path):
        import onnxruntime as ort

        with tempfile.TemporaryDirectory() as tmp:
            base_path = os.path.join(tmp, ORT_SAVED[name] + ".onnx")
            cli = writer(ORT_SAVED[name], "legacy")(base_path)
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            opts.optimized_model_filepath = path
            ort.InferenceSession(base_path, opts, providers=["CPUExecutionProvider"])
        return cli
    return write


def ort_optimized_writer(name):
    def write(path):
        from onnxruntime.transformers import optimizer

        base, kw = ORT_OPTIMIZED[name]
        kw = {"opt_level": 1, **kw}
        with tempfile.TemporaryDirectory() as tmp:
            base_path = os.path.join(tmp, base + ".onnx")
            cli = (static_writer(base) if base in STATIC else writer(base, "legacy"))(base_path)
            optimizer.optimize_model(base_path, **kw).save_model_to_file(path)
        return cli
    return write


DYNAMO = ["mobilevit_s", "distilbert", "unet"]
# transformers 5 builds GPT-2's causal mask with aten::diff, which the legacy exporter lacks
DYNAMO_ONLY = ["gpt2_6l"]


def build(name):
    spec = MODELS[name]
    torch.manual_seed(0)
    m = spec[0]().eval()
    torch.manual_seed(0)
    if len(spec) == 2:
        return m, torch.randn(*spec[1]), None
    ids = torch.randint(0, 1000, (1, SEQ))
    x = tuple(ids if k == "ids" else torch.ones_like(ids) for k in spec[1])
    return m, x, spec[2]


def writer(name, kind):
    def write(path):
        m, x, text_inputs = build(name)
        if kind == "dynamo":
            export_dynamo(m, x, path)
            return None
        if text_inputs is None:
            export_legacy(m, x, path)
            return None
        # as Optimum exports a text model: batch and sequence dynamic
        axes = {n: TEXT_AXES for n in text_inputs}
        axes["output"] = TEXT_AXES
        export_legacy(m, x, path, axes, input_names=text_inputs)
        return [f"--input-shape {n}:1,{SEQ}" for n in text_inputs]
    return write


def main(names):
    jobs = []
    for n in names:
        if n in STATIC:
            jobs.append((n, static_writer(n)))
            continue
        if n in ORT_OPTIMIZED:  # after its base model
            jobs.append((n, ort_optimized_writer(n)))
            continue
        if n in ORT_SAVED:
            jobs.append((n, ort_saved_writer(n)))
            continue
        if n not in DYNAMO_ONLY:
            jobs.append((n, writer(n, "legacy")))
        if n in DYNAMO + DYNAMO_ONLY:
            jobs.append((n + "_dynamo", writer(n, "dynamo")))
    export_all(sys.argv[1], jobs)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[2:] or [*MODELS, *STATIC, *ORT_OPTIMIZED, *ORT_SAVED])
