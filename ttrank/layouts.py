"""Activation layouts as a tuning lever: packed NCHW[x]c convolutions for x86, and NHWC.

What TVM 0.27 offers here (read in its installed source):

- There is no packed-conv kernel a MetaSchedule user can reach. ``ConvertLayout`` to
  ``NCHW16c``/``OIHW16i16o`` leaves ``relax.nn.conv2d`` with 5-D layouts, and its legalization
  (``relax/transform/legalize_ops/nn.py:60``, ``_nn_conv2d``, lines 67-72) returns such a call
  unchanged ("cannot be legalized by TOPI at this moment"), so ``extract_tasks`` never sees it.
- ``topi/x86`` is gone; only ``topi.nn.conv2d_NCHWc`` (``topi/nn/conv2d.py:275``) is left. It
  needs a current target (line 323) and reduces over all input channels as one axis with
  div/mod indexing. MetaSchedule's ``schedule/x86`` package registers no custom rules, so the
  default LLVM space (multi-level tiling, parallel/vectorize/unroll) is all there is.
- ``ConvertLayout`` skips convs whose channels do not divide by the block (a 3-channel stem)
  and every grouped/depthwise conv, leaving them NCHW.
- A legalized ``relax.layout_transform`` (``legalize_ops/manipulate.py:319``) is written with
  ``Schedule.transform_layout`` on the write; ``AnnotateTIROpPattern`` calls it opaque (8), so
  it never fuses with anything.

:func:`pack_conv2d_nchwc` is a Relax pass on an imported module (before fusion) that works
around all four: ``ConvertLayout`` propagates the packed layout from conv to conv (through bias,
ReLU and residual adds), the 5-D convs are legalized here to a TE packed conv
(:func:`_te_conv2d_nchwc`: reduction over input-channel chunk, kh, kw, input-channel block; the
output-channel block innermost, the loop a vector FMA wants), the convs ``ConvertLayout`` skips
are packed one by one with block sizes from their own channel counts, and activation layout
transforms become gathers (injective, so they fuse). Weight (and bias) transforms act on
constants and ``FoldConstant`` folds them at compile time. The module keeps its NCHW
interface, so ttrank's fusion pipeline, ``tune``, ``extract_tasks`` (which then yields
``fused_conv2d_NCHWc_add_relu`` and such) and ``compile_relax`` work unchanged.
"""

from __future__ import annotations

import logging
import re

import tvm
from tvm import ir, relax, te, topi
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.target import codegen
from tvm.tirx import IndexMap

from .target import make_target

log = logging.getLogger("ttrank")

# the packed-conv PrimFuncs' name hints: fused task names then read fused_conv2d_NCHWc_add_relu
PACKED_CONV = "conv2d_NCHWc"
PACKED_DEPTHWISE = "depthwise_conv2d_NCHWc"


def simd_lanes(target=None, dtype_bits: int = 32) -> int:
    """float32 lanes of the target's widest vector unit (16 with AVX-512, 8 with AVX2)."""

    t = target if target is not None else make_target()
    mcpu = str(t.attrs.get("mcpu", "")) if hasattr(t, "attrs") else ""
    try:

        bits = int(codegen.llvm_get_vector_width(t)) if hasattr(codegen, "llvm_get_vector_width") else 0
    except Exception:  # noqa: BLE001 - fall back on the CPU name
        bits = 0
    if bits <= 0:
        avx512 = any(s in mcpu for s in ("znver4", "znver5", "skylake-avx512", "cascadelake",
                                          "icelake", "sapphirerapids", "emeraldrapids",
                                          "graniterapids", "tigerlake", "cooperlake"))
        bits = 512 if avx512 else 256
    return max(1, bits // dtype_bits)


def block_size(channels: int, lanes: int, cap: int | None = None) -> int:
    """The largest divisor of ``channels`` that is at most ``lanes`` (and ``cap``), as TVM's
    own x86 conv2d defaults chose oc_bn / ic_bn."""
    top = min(lanes, cap or lanes, channels)
    for b in range(top, 0, -1):
        if channels % b == 0:
            return b
    return 1


def _padded_geometry(data, kh: int, kw: int, strides, padding, dilation):
    """A packed [N, C//b, H, W, b] input padded on H and W, and the output's height and width."""
    ih, iw = int(data.shape[2]), int(data.shape[3])
    sh, sw = (int(s) for s in strides)
    dh, dw = (int(d) for d in dilation)
    pt, pl, pb, pr = (int(p) for p in padding)
    oh = (ih + pt + pb - ((kh - 1) * dh + 1)) // sh + 1
    ow = (iw + pl + pr - ((kw - 1) * dw + 1)) // sw + 1
    if pt or pl or pb or pr:
        data = topi.nn.pad(data, (0, 0, pt, pl, 0), (0, 0, pb, pr, 0), name="data_pad")
    return data, oh, ow, (sh, sw), (dh, dw)


def _te_conv2d_nchwc(data, kernel, strides, padding, dilation, out_dtype):
    """Packed conv: data [N, IC//ib, H, W, ib], kernel [OC//ob, IC//ib, KH, KW, ib, ob]
    -> [N, OC//ob, OH, OW, ob]; reduction over (ic_chunk, kh, kw, ic_block)."""

    n, icc, _, _, ib = (int(x) for x in data.shape)
    occ, _, kh, kw, _, ob = (int(x) for x in kernel.shape)
    data, oh, ow, (sh, sw), (dh, dw) = _padded_geometry(data, kh, kw, strides, padding, dilation)
    ric = te.reduce_axis((0, icc), name="ic_chunk")
    rkh = te.reduce_axis((0, kh), name="kh")
    rkw = te.reduce_axis((0, kw), name="kw")
    rib = te.reduce_axis((0, ib), name="ic_block")
    return te.compute(
        (n, occ, oh, ow, ob),
        lambda b, oc, y, x, o: te.sum(
            data[b, ric, y * sh + rkh * dh, x * sw + rkw * dw, rib].astype(out_dtype)
            * kernel[oc, ric, rkh, rkw, rib, o].astype(out_dtype),
            axis=[ric, rkh, rkw, rib]),
        name=PACKED_CONV, tag=PACKED_CONV)


def _te_depthwise_nchwc(data, kernel, strides, padding, dilation, out_dtype):
    """Packed depthwise conv: data [N, C//cb, H, W, cb], kernel [C//cb, 1, KH, KW, cb]."""

    n, cc, _, _, cb = (int(x) for x in data.shape)
    _, _, kh, kw, _ = (int(x) for x in kernel.shape)
    data, oh, ow, (sh, sw), (dh, dw) = _padded_geometry(data, kh, kw, strides, padding, dilation)
    rkh = te.reduce_axis((0, kh), name="kh")
    rkw = te.reduce_axis((0, kw), name="kw")
    return te.compute(
        (n, cc, oh, ow, cb),
        lambda b, c, y, x, o: te.sum(
            data[b, c, y * sh + rkh * dh, x * sw + rkw * dw, o].astype(out_dtype)
            * kernel[c, 0, rkh, rkw, o].astype(out_dtype),
            axis=[rkh, rkw]),
        name=PACKED_DEPTHWISE, tag=PACKED_DEPTHWISE)


def _static_shape(expr) -> list[int] | None:

    sinfo = expr.ty  # TVM 0.27 renamed struct_info to ty (relax.TensorType)
    if not isinstance(sinfo, relax.TensorType) or sinfo.shape is None:
        return None
    try:
        return [int(d) for d in sinfo.shape.values]
    except (TypeError, AttributeError):
        return None


def _te_gather_transform(x, index_map):
    """A layout transform written as a gather (out[i] = x[inverse(i)]): TIR pattern injective,
    so it fuses with its neighbours. The stock legalization (``relax.layout_transform`` via
    ``Schedule.transform_layout`` on the write) is annotated opaque and never fuses."""

    shape = [int(d) for d in x.shape]
    out_shape = [int(d) for d in index_map.map_shape(shape)]
    inverse = index_map.inverse(shape)
    return te.compute(out_shape, lambda *i: x[tuple(inverse.map_indices(list(i)))],
                      name="layout_transform")


_PACKED_DATA = re.compile(r"^NCHW(\d+)c$")
_PACKED_KERNEL = re.compile(r"^OIHW(\d+)i(\d+)o$")


def pack_conv2d_nchwc(mod, target=None, lanes: int | None = None, depthwise: bool = True,
                      propagate: bool = True, stats: dict | None = None):
    """Rewrite the float32 convs of ``mod`` (an imported Relax module, before fusion) into TVM's
    x86 packed form (see the module docstring). Returns a new module.

    1. ``propagate``: Relax's ``ConvertLayout`` puts every conv whose channels divide by the
       vector lanes in ``NCHW[lanes]c`` / ``OIHW[lanes]i[lanes]o``, and carries that layout
       through the element-wise ops between convs (bias, ReLU, residual adds), so the data
       stays packed from conv to conv, and the bias and weight transforms are constants.
    2. Those packed ``relax.nn.conv2d`` calls, which stock legalization leaves alone, become
       ``call_tir`` of :func:`_te_conv2d_nchwc`.
    3. Every other NCHW/OIHW conv (channels that do not divide: a 3-channel stem, 24 or 40
       channels; depthwise convs, which ``ConvertLayout`` skips) is packed on its own with
       block sizes from its channel counts, between transforms to and from NCHW.
    4. Layout transforms of activations become gathers (:func:`_te_gather_transform`) that can
       fuse; transforms of constants are left for ``FoldConstant``.

    ``stats`` (a dict) receives the counts: propagated, wrapped, depthwise, transforms.
    """

    lanes = lanes or simd_lanes(target)
    if propagate:
        with tvm.transform.PassContext(opt_level=3):
            mod = relax.transform.ConvertLayout(
                {"relax.nn.conv2d": [f"NCHW{lanes}c", f"OIHW{lanes}i{lanes}o"]})(mod)
    conv_op = ir.Op.get("relax.nn.conv2d")
    lt_op = ir.Op.get("relax.layout_transform")
    counts = {"propagated": 0, "wrapped": 0, "depthwise": 0, "transforms": 0}

    @mutator
    class _Packer(PyExprMutator):
        def visit_call_(self, call):  # noqa: N802 - the mutator's hook name
            call = self.visit_expr_post_order(call)
            if not isinstance(call, relax.Call):
                return call
            new = None
            if call.op.same_as(conv_op):
                new = self._conv(call)
            elif call.op.same_as(lt_op):
                new = self._transform(call)
            return call if new is None else new

        def _transform(self, call):
            x = call.args[0]
            if isinstance(x, (ir.Constant, ir.GenericConst)) or call.attrs.pad_value is not None:
                return None
            if _static_shape(x) is None:
                return None
            index_map = call.attrs.index_map
            try:
                _, pred = index_map.non_surjective_inverse(x.ty.shape)
                if not isinstance(pred, tvm.tirx.expr.IntImm) or int(pred) != 0:
                    return None  # a padding transform: leave it to the stock legalization
            except Exception:  # noqa: BLE001
                return None
            counts["transforms"] += 1
            return _gather(self.builder_, x, index_map)

        def _conv(self, call):
            a = call.attrs
            x, w = call.args
            xs, ws = _static_shape(x), _static_shape(w)
            if xs is None or ws is None:
                return None
            if x.ty.dtype != "float32" or w.ty.dtype != "float32" or str(call.ty.dtype) != "float32":
                return None
            strides = [int(s) for s in a.strides]
            padding = [int(p) for p in a.padding]
            if len(padding) == 2:
                padding = padding * 2
            dilation = [int(d) for d in a.dilation]
            groups = int(a.groups)
            dl, kl, ol = str(a.data_layout), str(a.kernel_layout), str(a.out_layout) or str(a.data_layout)
            bb = self.builder_
            md, mk, mo = _PACKED_DATA.match(dl), _PACKED_KERNEL.match(kl), _PACKED_DATA.match(ol)
            if md and mk and mo:  # from ConvertLayout: already packed, legalize it here
                if groups != 1 or int(md.group(1)) != int(mk.group(1)) or int(mk.group(2)) != int(mo.group(1)):
                    return None
                counts["propagated"] += 1
                return bb.call_te(_te_conv2d_nchwc, x, w, strides, padding, dilation, "float32",
                                  primfunc_name_hint=PACKED_CONV)
            if (dl, kl, ol) != ("NCHW", "OIHW", "NCHW") or len(xs) != 4 or len(ws) != 4:
                return None
            cin, cout = xs[1], ws[0]
            dw = groups > 1 and groups == cin == cout and ws[1] == 1
            if groups != 1 and not (dw and depthwise):
                return None
            if dw:
                cb = block_size(cin, lanes)
                data = bb.emit(_gather(bb, x, _imap(lambda n, c, h, w_: (n, c // cb, h, w_, c % cb))))
                kern = bb.emit(relax.op.layout_transform(
                    w, lambda o, i, h, w_: (o // cb, i, h, w_, o % cb)))
                out = bb.emit(bb.call_te(_te_depthwise_nchwc, data, kern, strides, padding,
                                         dilation, "float32", primfunc_name_hint=PACKED_DEPTHWISE))
                ob = cb
                counts["depthwise"] += 1
            else:
                ob = block_size(cout, lanes)
                ib = block_size(cin, lanes, cap=ob)
                data = bb.emit(_gather(bb, x, _imap(lambda n, c, h, w_: (n, c // ib, h, w_, c % ib))))
                kern = bb.emit(relax.op.layout_transform(
                    w, lambda o, i, h, w_: (o // ob, i // ib, h, w_, i % ib, o % ob)))
                out = bb.emit(bb.call_te(_te_conv2d_nchwc, data, kern, strides, padding,
                                         dilation, "float32", primfunc_name_hint=PACKED_CONV))
                counts["wrapped"] += 1
            return _gather(bb, out, _imap(lambda n, c, h, w_, o: (n, c * ob + o, h, w_)))

    packer = _Packer(mod)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            packer.builder_.update_func(gv, packer.visit_expr(func))
    out = relax.transform.Normalize()(packer.builder_.get())
    log.info("pack_conv2d_nchwc (lanes %d): %s", lanes, counts)
    if stats is not None:
        stats.update(counts)
    return out


def _gather(bb, x, index_map):
    return bb.call_te(lambda t: _te_gather_transform(t, index_map), x,
                      primfunc_name_hint="layout_transform")


def _imap(fn):

    return IndexMap.from_func(fn, index_dtype="int64")


def count_packed(mod) -> int:
    """Packed conv PrimFuncs in a module."""
    return sum(1 for gv in mod.functions if PACKED_CONV in gv.name_hint)


def to_nhwc(mod):
    """Relax's own layout conversion: every conv2d in NHWC/OHWI (transforms at the edges)."""

    with tvm.transform.PassContext(opt_level=3):
        return relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})(mod)


# layout name -> the pass that puts a module's convs in it (given the target, for vector lanes)
LAYOUTS = {"nchw": lambda mod, target=None: mod,
           "nchwc": lambda mod, target=None: pack_conv2d_nchwc(mod, target=target),
           "nhwc": lambda mod, target=None: to_nhwc(mod)}


def apply_layout(mod, layout: str, target=None):
    """The module with its convs in ``layout`` (nchw: unchanged)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    return LAYOUTS[layout](mod, target)


def is_packed_task(task_name: str) -> bool:
    return PACKED_CONV in task_name
