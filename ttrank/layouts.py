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
are packed too, what it leaves NCHW between packed tensors (pools, ReLU6, squeeze-excitation,
splits, concats, resizes) is computed packed, and activation layout transforms become gathers
(injective, so they fuse). Weight (and bias) transforms act on constants and are folded into
packed constants at once (:func:`fold_constant_transforms`). The module keeps its NCHW interface, so ttrank's fusion pipeline,
``tune``, ``extract_tasks`` (which then yields ``fused_conv2d_NCHWc_add_relu`` and such) and
``compile_relax`` work unchanged.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import tvm
from tvm import ir, relax, te, topi
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.tirx import IndexMap

from .graphopt import fold_constant_transforms
from .target import make_target, target_isa

log = logging.getLogger("ttrank")

# the packed-conv PrimFuncs' name hints: fused task names then read fused_conv2d_NCHWc_add_relu
PACKED_CONV = "conv2d_NCHWc"
PACKED_DEPTHWISE = "depthwise_conv2d_NCHWc"


def simd_lanes(target=None, dtype_bits: int = 32) -> int:
    """float32 lanes of the target's widest vector unit (16 with AVX-512, 8 with AVX2), from
    the CPU's features as LLVM knows them (TVM's ``llvm_get_vector_width`` says 512 for every
    x86 CPU, AVX2 ones included). A CPU LLVM does not know gets 8 lanes.

    The packed block follows it: on znver3 (AVX2), 128 MetaSchedule trials of ResNet-18's
    3x3 conv reached 1.79 ms in blocks of 8 against 2.69 ms in blocks of 16, and onnxruntime's
    own node took 2.1 ms (bench/results/kernel_gap_znver3.md)."""
    isa = target_isa(target if target is not None else make_target())
    bits = int(isa.get("vector_bits") or 256)
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


def _te_conv2d_nchwc(data, kernel, strides, padding, dilation, out_dtype, groups: int = 1):
    """Packed conv: data [N, IC//ib, H, W, ib], kernel [OC//ob, IC//groups//ib, KH, KW, ib, ob]
    -> [N, OC//ob, OH, OW, ob]; reduction over (ic_chunk, kh, kw, ic_block).

    ``groups``: a grouped conv whose groups hold whole blocks (ResNeXt's 3x3 convs from 16
    channels a group): an output chunk lies in one group and reads that group's input chunks
    only, so the loops (and the name: dense packed donors are its candidates) stay the dense
    conv's, with the input chunk offset by the group."""

    n, _, _, _, ib = (int(x) for x in data.shape)
    occ, gicc, kh, kw, _, ob = (int(x) for x in kernel.shape)
    per_group = occ // groups  # output chunks per group
    data, oh, ow, (sh, sw), (dh, dw) = _padded_geometry(data, kh, kw, strides, padding, dilation)
    ric = te.reduce_axis((0, gicc), name="ic_chunk")
    rkh = te.reduce_axis((0, kh), name="kh")
    rkw = te.reduce_axis((0, kw), name="kw")
    rib = te.reduce_axis((0, ib), name="ic_block")

    def chunk(oc):  # a dense conv's index stays as it was: its donors' workloads are unchanged
        return ric if groups == 1 else oc // per_group * gicc + ric

    return te.compute(
        (n, occ, oh, ow, ob),
        lambda b, oc, y, x, o: te.sum(
            data[b, chunk(oc), y * sh + rkh * dh, x * sw + rkw * dw, rib].astype(out_dtype)
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


def _bound(mutator: PyExprMutator, expr):
    """``expr``, or what the mutator has bound to it if it is a variable (None: a parameter)."""
    return mutator.lookup_binding(expr) if isinstance(expr, relax.Var) else expr


def padded_channels(channels: int, lanes: int) -> int:
    """The channels a conv computes for ``channels`` outputs (``channels`` when it needs no
    more): when their largest block is at most a quarter of the lanes (ShuffleNetV2's 116 =
    4 x 29 and 58 = 2 x 29) or does not divide them (Xception's 728 = 52 x 14 with 16 lanes),
    the next multiple of the lanes, if that adds at most 1/8.

    On znver4 Xception (tf2onnx) ran 131 ms in blocks of 14 and 99 ms in 16 (onnxruntime 84),
    both recommended and timed side by side; MobileNetV3's 72, 88 and 120 channels padded,
    three networks ran as before (within 1%)."""
    block = block_size(channels, lanes)
    if block * 4 > lanes and lanes % block == 0:
        return channels
    more = -(-channels // lanes) * lanes
    return more if 8 * (more - channels) <= channels else channels


# element-wise ops a padded tensor goes through padded (a zero channel may leave them non-zero:
# sigmoid(0); what reads it next multiplies it by zero weights, or slices it off). Never one that
# can make a NaN or an infinity there, which zero weights would carry into the true channels: a
# divide only by scalars or constants (padded with ones)
_PADDABLE = frozenset(f"relax.{n}" for n in (
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "nn.relu", "nn.silu", "sigmoid",
    "tanh", "clip"))


def _keeps_channels(call) -> bool:
    """Whether a rank-4 NCHW op computes each channel from that channel alone: a strided slice
    of the other axes, a 2-D pool."""
    name, a = call.op.name, call.attrs
    if name == "relax.strided_slice":
        axes = call.args[1]
        known = list(axes.fields) if isinstance(axes, relax.Tuple) else [None]
        if not all(isinstance(ax, tvm.tirx.expr.IntImm) for ax in known):
            return False  # axes known only at run time
        return all(int(ax) % 4 != 1 for ax in known)
    if name in ("relax.nn.max_pool2d", "relax.nn.avg_pool2d"):
        return a.layout == "NCHW" and (a.out_layout or "NCHW") == "NCHW"
    return False


def _pad_axis(a, axis: int, size: int, value: float = 0.0):
    width = [(0, 0)] * a.ndim
    width[axis] = (0, size - a.shape[axis])
    return np.pad(a, width, constant_values=value)


@mutator
class _ChannelPadder(PyExprMutator):
    """:func:`pad_channels`: a conv with badly blocked output channels computes
    :func:`padded_channels` of them from zero weights. Its true tensor is a *view*, the slice
    of the padded one; convs, depthwise convs and element-wise ops over a view compute on the
    padded tensor (zero weights for the extra input channels), anything else reads the view."""

    def __init__(self, mod, lanes: int):
        super().__init__(mod)
        self.lanes, self.views, self.count = lanes, {}, 0

    def _view_of(self, expr):
        """(padded tensor, true channels) if ``expr`` is the view of a padded tensor, else None."""
        return self.views.get(_bound(self, expr))

    def visit_call_(self, call):  # noqa: N802 - the mutator's hook name
        call = self.visit_expr_post_order(call)
        if not isinstance(call, relax.Call) or not isinstance(call.op, ir.Op) or not _rank4(call):
            return call
        if call.op.name == "relax.nn.conv2d":
            new = self._conv(call)
        elif call.op.name in _PADDABLE:
            new = self._elementwise(call)
        elif _keeps_channels(call):
            new = self._per_channel(call)
        else:
            new = None
        return call if new is None else new

    def _per_channel(self, call):
        """An op that keeps each channel to itself (a spatial slice, a pool) over a view:
        the same op over the padded tensor, a view again (Xception's 728 channels stayed padded
        only from a conv to the slice of its padded rows, :func:`ttrank.graphopt.pad_conv_outputs`,
        and the depthwise convs after it went back to blocks of 14)."""
        view = self._view_of(call.args[0])
        if view is None:
            return None
        return self._emit_view(relax.Call(call.op, [view[0], *call.args[1:]], call.attrs), view[1])

    def _emit_view(self, padded, channels: int):
        var = self.builder_.emit(padded)
        view = relax.op.strided_slice(var, axes=[1], begin=[0], end=[channels])
        self.views[view] = (var, channels)
        return view

    def _conv(self, call):
        a = call.attrs
        w = _bound(self, call.args[1])
        if (not isinstance(w, ir.Constant) or a.data_layout != "NCHW" or a.kernel_layout != "OIHW"
                or (a.out_layout or "NCHW") != "NCHW" or str(call.ty.dtype) != "float32"):
            return None
        w = w.value.numpy()
        out_c, in_per_group = w.shape[:2]
        groups, view = int(a.groups), self._view_of(call.args[0])
        x = call.args[0]
        if groups == 1:
            if view is not None:
                x, w = view[0], _pad_axis(w, 1, int(view[0].ty.shape[1]))
            wide = padded_channels(out_c, self.lanes)
            if wide != out_c:
                w = _pad_axis(w, 0, wide)
            elif view is None:
                return None
        elif view is not None and in_per_group == 1 and groups == out_c == view[1]:
            x, wide = view[0], int(view[0].ty.shape[1])  # depthwise: every channel its own
            w, groups = _pad_axis(w, 0, wide), wide
        else:
            return None
        self.count += 1
        conv = relax.op.nn.conv2d(x, relax.const(w), strides=a.strides, padding=a.padding,
                                  dilation=a.dilation, groups=groups, data_layout="NCHW",
                                  kernel_layout="OIHW", out_layout="NCHW", out_dtype=a.out_dtype)
        return self._emit_view(conv, out_c) if w.shape[0] != out_c else conv

    def _elementwise(self, call):
        views = [self._view_of(x) for x in call.args]
        if not any(views):
            return None
        var, channels = next(v for v in views if v)
        wide = int(var.ty.shape[1])
        divide = call.op.name == "relax.divide"
        if divide and views[1] is not None:
            return None  # its zero channels would divide
        args = []
        for x, view in zip(call.args, views):
            if view is not None:
                if int(view[0].ty.shape[1]) != wide:
                    return None
                args.append(view[0])
                continue
            if not isinstance(x.ty, relax.TensorType):
                args.append(x)  # clip's bounds
                continue
            c = _bound(self, x)
            shape = _static_shape(x)
            if shape is not None and len(shape) <= 1 and all(d == 1 for d in shape):
                args.append(x)  # a scalar
            elif isinstance(c, ir.Constant) and shape == [1, channels, 1, 1]:
                args.append(relax.const(_pad_axis(c.value.numpy(), 1, wide, float(divide))))  # per channel
            else:
                return None
        return self._emit_view(relax.Call(call.op, args, call.attrs), channels)


def pad_channels(mod, lanes: int):
    """Convs whose output channels block badly (:func:`padded_channels`) compute whole blocks,
    the extra channels from zero weights, through the convs, depthwise convs and element-wise
    ops that follow, until something that needs the true channels slices them off. Exact.

    On znver4 four 1x1 convs of 116 channels on 28x28 (ShuffleNetV2's) ran 0.85 ms in blocks of
    4 (100 GFLOP/s), and of 128 channels, 22% more work, 0.45 ms in blocks of 16."""
    padder = _ChannelPadder(mod, lanes)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            padder.builder_.update_func(gv, padder.visit_expr(func))
    if not padder.count:
        return mod
    return relax.transform.DeadCodeElimination()(relax.transform.Normalize()(padder.builder_.get()))


def pack_conv2d_nchwc(mod, target=None, lanes: int | None = None, depthwise: bool = True,
                      propagate: bool = True, stats: dict | None = None):
    """Rewrite the float32 convs of ``mod`` (an imported Relax module, before fusion) into TVM's
    x86 packed form (see the module docstring). Returns a new module.

    0. ONNX's Clip (ReLU6), which imports as opaque ``call_tir``, becomes Relax max/min ops.
    1. ``propagate``: Relax's ``ConvertLayout`` puts every conv whose channels divide by the
       vector lanes in ``NCHW[lanes]c`` / ``OIHW[lanes]i[lanes]o``, and carries that layout
       through the element-wise ops between convs (bias, ReLU, residual adds), so the data
       stays packed from conv to conv, and the bias and weight transforms are constants.
    2. Those packed ``relax.nn.conv2d`` calls, which stock legalization leaves alone, become
       ``call_tir`` of :func:`_te_conv2d_nchwc`.
    3. Every other NCHW/OIHW conv (channels that do not divide: a 3-channel stem, 24 or 40
       channels; depthwise convs, which ``ConvertLayout`` skips) is packed too: it reads a
       packed input in its own blocks when they divide its channels, else its own block sizes.
    4. What ``ConvertLayout`` leaves NCHW between packed tensors (max/avg pools, ReLU6, fast
       math's exp, squeeze-excitation's mean and product, channel splits and concats,
       upsampling) is computed packed too (:class:`_Packer`), so a network's activations are
       transformed only at its input and outputs, and where an op has no packed form.
    5. Layout transforms of activations become gathers (:func:`_te_gather_transform`) that can
       fuse; transforms of constants are folded (:func:`fold_constant_transforms`).

    ``stats`` (a dict) receives the counts: propagated, wrapped, depthwise, grouped, transforms,
    sunk.
    """

    lanes = lanes or simd_lanes(target)
    mod = pad_channels(_clip_as_relax_ops(mod), lanes)
    if propagate:
        with tvm.transform.PassContext(opt_level=3):
            mod = relax.transform.ConvertLayout(
                {"relax.nn.conv2d": [f"NCHW{lanes}c", f"OIHW{lanes}i{lanes}o"]})(mod)
    mod = fold_constant_transforms(mod)  # biases reshaped to [1, C, 1, 1] are constants then
    counts = {"propagated": 0, "wrapped": 0, "depthwise": 0, "grouped": 0, "transforms": 0, "sunk": 0}
    packer = _Packer(mod, lanes, counts, depthwise)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            packer.builder_.update_func(gv, packer.visit_expr(func))
    out = packer.builder_.get()
    # the NCHW views that every consumer now reads packed are dead; one transform per tensor
    out = relax.transform.DeadCodeElimination()(relax.transform.Normalize()(out))
    out = fold_constant_transforms(relax.transform.EliminateCommonSubexpr()(out))
    # CSE leaves var-to-var bindings (``y = x``). FuseOps sees each as an opaque node, so a
    # swish after a 1x1 conv split into three kernels: conv, sigmoid and multiply (18 extra
    # kernels in EfficientNet-B0, 22 in YOLO; 3.9 of B0's 15.3 ms of kernels on znver2).
    out = relax.transform.CanonicalizeBindings()(out)
    log.info("pack_conv2d_nchwc (lanes %d): %s", lanes, counts)
    if stats is not None:
        stats.update(counts)
    return out


# element-wise ops computed in the packed layout when their input is an NCHW view of a packed
# tensor (other operands: scalars, per-channel [1, C, 1, 1] constants, or views of the same block)
_SINKABLE = frozenset(f"relax.{n}" for n in (
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "nn.relu", "nn.silu",
    "nn.gelu", "sigmoid", "tanh", "exp", "clip", "negative", "sqrt", "rsqrt", "erf", "abs"))
_POOLS = frozenset({"relax.nn.max_pool2d", "relax.nn.avg_pool2d"})
# over H and W, keeping the dims: a global pool (squeeze-excitation, the classifier's input)
_SPATIAL_REDUCTIONS = frozenset({"relax.mean", "relax.sum", "relax.max"})
# element-wise PrimFuncs in the imported module (call_tir), by name hint: fast math's
# approximations (ttrank.frontend.with_fast_math), re-emitted on the packed tensor
_TE_UNARY = {"fast_exp": topi.fast_exp, "fast_erf": topi.fast_erf, "fast_tanh": topi.fast_tanh}
_CALL_TIR = ir.Op.get("relax.call_tir")


@mutator
class _Packer(PyExprMutator):
    """Legalizes the packed convs ``ConvertLayout`` made, packs the convs it skipped, and keeps
    data packed through what lies between them.

    An NCHW *view* is ``unpack(p)``, the transform of a packed [N, C//b, H, W, b] tensor ``p``
    back to NCHW. Element-wise ops and pools over a view are computed on ``p`` in the packed
    layout (and give a view of their own result); a conv that ``ConvertLayout`` skipped (a
    3-channel stem, depthwise, channels that do not divide by the lanes) reads ``p`` when its
    block fits and writes a packed result; a transform of a view back to the same block is
    ``p`` itself. Views nobody reads are then dead code."""

    def __init__(self, mod, lanes: int, counts: dict, depthwise: bool = True):
        super().__init__(mod)
        self.lanes, self.counts, self.depthwise = lanes, counts, depthwise
        self.views: dict = {}  # view expression -> (packed tensor, block)

    def visit_call_(self, call):  # noqa: N802 - the mutator's hook name
        call = self.visit_expr_post_order(call)
        if not isinstance(call, relax.Call) or not isinstance(call.op, ir.Op):
            return call
        name = call.op.name
        new = None
        if call.op.same_as(_CALL_TIR):
            new = self._te_unary(call)
        elif name == "relax.nn.conv2d":
            new = self._conv(call)
        elif name == "relax.layout_transform":
            new = self._transform(call)
        elif name in _SINKABLE:
            new = self._elementwise(call)
        elif name in _POOLS:
            new = self._pool(call)
        elif name in _SPATIAL_REDUCTIONS:
            new = self._spatial_reduction(call)
        elif name == "relax.concat":
            new = self._concat(call)
        elif name == "relax.strided_slice":
            new = self._slice(call)
        elif name == "relax.image.resize2d":
            new = self._resize(call)
        return call if new is None else new

    # -- views -------------------------------------------------------------------------------
    def _view_of(self, expr):
        """(packed tensor, block) if ``expr`` is an NCHW view of a packed tensor, else None."""
        return self.views.get(_bound(self, expr))

    def _unpack(self, packed, block: int):
        """An NCHW view of ``packed`` (emitted when a consumer needs NCHW; dead otherwise)."""
        view = _gather(self.builder_, packed, _unpack_map(block))
        self.views[view] = (packed, block)
        return view

    def _pack(self, x, block: int):
        """``x`` (NCHW) in blocks of ``block`` channels: the packed tensor of a view, else a
        transform (a gather; on constants, a layout_transform that is folded at the end)."""
        view = self._view_of(x)
        if view is not None and view[1] == block:
            return view[0]
        const = _bound(self, x)
        if isinstance(const, (ir.Constant, ir.GenericConst)):
            return self.builder_.emit(relax.op.layout_transform(const, _pack_map(block)))
        return self.builder_.emit(_gather(self.builder_, x, _pack_map(block)))

    def _operand(self, x, block: int, channels: int):
        """An operand of an element-wise op whose main input is packed: a view of the same
        block, a scalar, or a per-channel [1, C, 1, 1] tensor; else None."""
        view = self._view_of(x)
        if view is not None:
            return view[0] if view[1] == block else None
        shape = _static_shape(x)
        if shape is None:
            return None
        if all(d == 1 for d in shape) and len(shape) <= 1:
            return x  # a scalar broadcasts in any layout
        if len(shape) == 4 and shape[0] == 1 and shape[1] == channels and shape[2:] == [1, 1]:
            return self._pack(x, block)
        return None

    # -- rewrites ------------------------------------------------------------------------------
    def _transform(self, call):
        x = call.args[0]
        if isinstance(x, (ir.Constant, ir.GenericConst)) or call.attrs.pad_value is not None:
            return None
        shape = _static_shape(x)
        if shape is None:
            return None
        index_map = call.attrs.index_map
        view = self._view_of(x)
        if view is not None and len(shape) == 4:  # a view packed again: its own packed tensor
            out_shape = [int(d) for d in index_map.map_shape(shape)]
            if out_shape == [shape[0], shape[1] // view[1], shape[2], shape[3], view[1]] and \
                    _same_map(index_map, _pack_map(view[1]), shape):
                return view[0]
        try:
            _, pred = index_map.non_surjective_inverse(x.ty.shape)
            if not isinstance(pred, tvm.tirx.expr.IntImm) or int(pred) != 0:
                return None  # a padding transform: leave it to the stock legalization
        except Exception:  # noqa: BLE001
            return None
        self.counts["transforms"] += 1
        if len(shape) == 5 and _same_map(index_map, _unpack_map(shape[4]), shape):
            return self._unpack(x, shape[4])  # ConvertLayout's own unpack: a view
        return _gather(self.builder_, x, index_map)

    def _elementwise(self, call):
        tensors = [a for a in call.args if isinstance(a.ty, relax.TensorType)]
        views = [v for a in tensors if (v := self._view_of(a)) is not None]
        if not views or not _rank4(call) or str(call.ty.dtype) != "float32":
            return None
        block = views[0][1]
        channels = int(call.ty.shape[1])
        args = []
        for a in call.args:
            if not isinstance(a.ty, relax.TensorType):
                args.append(a)  # PrimValue bounds of clip
                continue
            packed = self._operand(a, block, channels)
            if packed is None:
                return None
            args.append(packed)
        out = self.builder_.emit(relax.Call(call.op, args, call.attrs, call.ty_args))
        self.counts["sunk"] += 1
        return self._unpack(out, block)

    def _te_unary(self, call):
        gv, args = call.args[0], call.args[1]
        fn = _TE_UNARY.get(re.sub(r"\d+$", "", gv.name_hint)) if isinstance(gv, relax.GlobalVar) else None
        if fn is None or not isinstance(args, relax.Tuple) or len(args.fields) != 1:
            return None
        view = self._view_of(args.fields[0])
        if view is None or _static_shape(call) != _static_shape(args.fields[0]):
            return None
        out = self.builder_.emit(self.builder_.call_te(fn, view[0], primfunc_name_hint=gv.name_hint))
        self.counts["sunk"] += 1
        return self._unpack(out, view[1])

    def _concat(self, call):
        """Channel concat of views of one block (inception branches, CSP and FPN merges), each
        a whole number of blocks: the packed tensors concatenated on the block axis."""
        parts = call.args[0]
        if not isinstance(parts, relax.Tuple) or call.attrs.axis is None or \
                int(call.attrs.axis) % 4 != 1 or not _rank4(call):
            return None
        views = [self._view_of(x) for x in parts.fields]
        if any(v is None for v in views) or len({v[1] for v in views}) != 1:
            return None
        out = self.builder_.emit(relax.op.concat([v[0] for v in views], axis=1))
        self.counts["sunk"] += 1
        return self._unpack(out, views[0][1])

    def _slice(self, call):
        """A slice of a view: of whole blocks on the channel axis (a CSP split), and of rows
        and columns (a padded conv's extra outputs), which are the same axes packed."""
        view = self._view_of(call.args[0])
        if view is None or not _rank4(call):
            return None
        try:
            axes, begin, end, *rest = ([int(f.value) for f in t.fields] for t in call.args[1:])
        except (AttributeError, TypeError, ValueError):
            return None
        strides = rest[0] if rest else [1] * len(axes)
        block = view[1]
        dims = [int(d) for d in call.args[0].ty.shape]
        end = [min(e, dims[ax]) for ax, e in zip(axes, end)]
        if not set(axes) <= {1, 2, 3} or any(st != 1 for st in strides) or any(
                ax == 1 and (b % block or e % block) for ax, b, e in zip(axes, begin, end)):
            return None
        out = self.builder_.emit(relax.op.strided_slice(
            view[0], axes=axes, begin=[b // block if ax == 1 else b for ax, b in zip(axes, begin)],
            end=[e // block if ax == 1 else e for ax, e in zip(axes, end)]))
        self.counts["sunk"] += 1
        return self._unpack(out, block)

    def _resize(self, call):
        """Upsampling (FPN, YOLO's neck) computed on the packed tensor."""
        view = self._view_of(call.args[0])
        a = call.attrs
        if view is None or str(a.layout) != "NCHW" or not _rank4(call):
            return None
        size = [int(d) for d in call.ty.shape.values[2:]]
        roi = [float(r) for r in a.roi] if getattr(a, "roi", None) is not None else None
        out = self.builder_.emit(relax.op.image.resize2d(
            view[0], size, roi=roi, layout=f"NCHW{view[1]}c", method=str(a.method),
            coordinate_transformation_mode=str(a.coordinate_transformation_mode),
            rounding_method=str(a.rounding_method), cubic_alpha=float(a.cubic_alpha),
            cubic_exclude=int(a.cubic_exclude), extrapolation_value=float(a.extrapolation_value),
            out_dtype=None if str(a.out_dtype) in ("", "None", "void") else str(a.out_dtype)))
        self.counts["sunk"] += 1
        return self._unpack(out, view[1])

    def _spatial_reduction(self, call):
        view = self._view_of(call.args[0])
        a = call.attrs
        if view is None or a.axis is None or not a.keepdims or not _rank4(call) or \
                sorted(int(x) % 4 for x in a.axis) != [2, 3]:
            return None
        op = {"relax.mean": relax.op.mean, "relax.sum": relax.op.sum, "relax.max": relax.op.max}[call.op.name]
        # H and W are axes 2 and 3 of the packed tensor too (not -2, -1)
        out = self.builder_.emit(op(view[0], axis=[2, 3], keepdims=True))
        self.counts["sunk"] += 1
        return self._unpack(out, view[1])

    def _pool(self, call):
        view = self._view_of(call.args[0])
        a = call.attrs
        if view is None or str(a.layout) != "NCHW" or str(a.out_layout or a.layout) != "NCHW":
            return None
        packed, block = view
        layout = f"NCHW{block}c"
        op = relax.op.nn.max_pool2d if call.op.name == "relax.nn.max_pool2d" else relax.op.nn.avg_pool2d
        kw = {} if call.op.name == "relax.nn.max_pool2d" else {"count_include_pad": bool(a.count_include_pad)}
        out = self.builder_.emit(op(packed, pool_size=[int(v) for v in a.pool_size],
                                    strides=[int(v) for v in a.strides],
                                    padding=[int(v) for v in a.padding],
                                    dilation=[int(v) for v in a.dilation], ceil_mode=bool(a.ceil_mode),
                                    layout=layout, out_layout=layout, **kw))
        self.counts["sunk"] += 1
        return self._unpack(out, block)

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
            ib, ob = int(mk.group(1)), int(mk.group(2))
            if int(md.group(1)) != ib or int(mo.group(1)) != ob:
                return None
            if groups == 1:
                self.counts["propagated"] += 1
                return bb.call_te(_te_conv2d_nchwc, x, w, strides, padding, dilation, "float32",
                                  primfunc_name_hint=PACKED_CONV)
            # ConvertLayout packs a grouped conv whose groups divide by the block, and nothing
            # legalizes that call: it reached the VM's codegen (an internal error on ResNeXt-50)
            if ws[0] % groups == 0 and ws[1] * ws[4] * groups == xs[1] * xs[4]:
                self.counts["grouped"] += 1
                return bb.call_te(_te_conv2d_nchwc, x, w, strides, padding, dilation, "float32", groups,
                                  primfunc_name_hint=PACKED_CONV)
            # a block spanning groups: no packed form here (the caller keeps the model NCHW)
            raise ValueError(f"a grouped conv ({groups} groups) whose groups split its {ob}-channel blocks")
        if (dl, kl, ol) != ("NCHW", "OIHW", "NCHW") or len(xs) != 4 or len(ws) != 4:
            return None
        cin, cout = xs[1], ws[0]
        dw = groups > 1 and groups == cin == cout and ws[1] == 1
        if groups != 1 and not (dw and self.depthwise):
            return None
        view = self._view_of(x)
        if dw:
            # the block of the packed input when it divides the channels: no transform at all
            cb = view[1] if view is not None and cin % view[1] == 0 else block_size(cin, self.lanes)
            data = self._pack(x, cb)
            kern = bb.emit(relax.op.layout_transform(
                w, lambda o, i, h, w_: (o // cb, i, h, w_, o % cb)))
            out = bb.emit(bb.call_te(_te_depthwise_nchwc, data, kern, strides, padding,
                                     dilation, "float32", primfunc_name_hint=PACKED_DEPTHWISE))
            ob = cb
            self.counts["depthwise"] += 1
        else:
            ob = block_size(cout, self.lanes)
            # a packed input is read in its own blocks (any size works with any output block)
            ib = view[1] if view is not None and cin % view[1] == 0 else block_size(cin, self.lanes, cap=ob)
            data = self._pack(x, ib)
            kern = bb.emit(relax.op.layout_transform(
                w, lambda o, i, h, w_: (o // ob, i // ib, h, w_, i % ib, o % ob)))
            out = bb.emit(bb.call_te(_te_conv2d_nchwc, data, kern, strides, padding,
                                     dilation, "float32", primfunc_name_hint=PACKED_CONV))
            self.counts["wrapped"] += 1
        return self._unpack(out, ob)


def _rank4(expr) -> bool:
    """A 4-D tensor of static shape (views are NCHW activations)."""
    shape = _static_shape(expr)
    return shape is not None and len(shape) == 4


def _pack_map(block: int):
    return _imap(lambda n, c, h, w_: (n, c // block, h, w_, c % block))


def _unpack_map(block: int):
    return _imap(lambda n, c, h, w_, o: (n, c * block + o, h, w_))


def _same_map(index_map, expected, shape) -> bool:
    """Whether two index maps send every index of ``shape`` to the same place."""
    try:
        got = index_map.map_indices(expected.initial_indices)
        want = expected.final_indices
        ana = tvm.sym.Analyzer()
        for v, extent in zip(expected.initial_indices, shape):
            ana.bind(v, tvm.ir.Range.from_min_extent(0, extent))
        return len(got) == len(want) and all(ana.can_prove_equal(g, e) for g, e in zip(got, want))
    except Exception:  # noqa: BLE001 - maps of another arity
        return False


def _clip_as_relax_ops(mod):
    """ONNX's Clip (ReLU6, hard-swish) imports as ``call_tir`` of TOPI's maximum/minimum with a
    scalar bound: opaque to ``ConvertLayout``, so the data left the packed layout around every
    ReLU6. As ``relax.maximum``/``relax.minimum`` the layout flows through them."""
    ops = {"maximum": relax.op.maximum, "minimum": relax.op.minimum}

    @mutator
    class _Clip(PyExprMutator):
        def visit_call_(self, call):  # noqa: N802
            call = self.visit_expr_post_order(call)
            if not (isinstance(call, relax.Call) and call.op.same_as(_CALL_TIR)):
                return call
            gv, args = call.args[0], call.args[1]
            base = re.sub(r"\d+$", "", gv.name_hint) if isinstance(gv, relax.GlobalVar) else ""
            if base not in ops or not isinstance(args, relax.Tuple) or len(args.fields) != 2:
                return call
            x, bound = args.fields
            xs, bs = _static_shape(x), _static_shape(bound)
            if xs is None or bs != [] or _static_shape(call) != xs:
                return call
            return ops[base](x, bound)

    clip = _Clip(mod)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            clip.builder_.update_func(gv, clip.visit_expr(func))
    return relax.transform.DeadCodeElimination()(clip.builder_.get())


def _gather(bb, x, index_map):
    return bb.call_te(lambda t: _te_gather_transform(t, index_map), x,
                      primfunc_name_hint="layout_transform")


def _imap(fn):

    return IndexMap.from_func(fn, index_dtype="int64")


_CONV_OPS = ("relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d", "relax.nn.conv1d_transpose",
             "relax.nn.conv2d_transpose")


def count_unpacked_convs(mod) -> int:
    """Convolutions still Relax ops (every packed one is a ``call_tir`` of a packed PrimFunc): on
    an imported module, all of them; after :func:`pack_conv2d_nchwc`, the grouped, transposed
    and 1-D/3-D convs it leaves as they were."""
    ops = {ir.Op.get(name) for name in _CONV_OPS}
    n = 0
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        for block in getattr(func.body, "blocks", []):
            n += sum(1 for b in block.bindings
                     if isinstance(b.value, relax.Call) and any(b.value.op.same_as(op) for op in ops))
    return n


def count_packed(mod) -> int:
    """Packed conv PrimFuncs in a module."""
    return sum(1 for gv in mod.functions if PACKED_CONV in gv.name_hint)


def to_nhwc(mod):
    """Relax's own layout conversion: every conv2d in NHWC/OHWI (transforms at the edges)."""

    with tvm.transform.PassContext(opt_level=3):
        return fold_constant_transforms(
            relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})(mod))


# layout name -> the pass that puts a module's convs in it (given the target, for vector lanes).
# nchwc-dense packs the dense convs only: depthwise convs stay NCHW (transforms around each),
# for a store whose packed donors have no depthwise conv; on znver1 MobileNetV2 (no packed
# depthwise donor but its own) ran in 14.7 ms against 20.4 ms NCHW, onnxruntime 10.7-10.8 ms
LAYOUTS = {"nchw": lambda mod, target=None: mod,
           "nchwc": lambda mod, target=None: pack_conv2d_nchwc(mod, target=target),
           "nchwc-dense": lambda mod, target=None: pack_conv2d_nchwc(mod, target=target, depthwise=False),
           "nhwc": lambda mod, target=None: to_nhwc(mod)}


def apply_layout(mod, layout: str, target=None):
    """The module with its convs in ``layout`` (nchw: unchanged)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    return LAYOUTS[layout](mod, target)


PACKED_LAYOUTS = ("nchwc", "nchwc-dense")  # those whose kernels are packed convs


def is_packed_task(task_name: str) -> bool:
    return PACKED_CONV in task_name
