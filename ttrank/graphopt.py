"""Graph clean-ups that inference compilers do before kernels are extracted.

Each pass takes and returns a Relax module as imported, so extraction, tuning and the final
compile all see the same kernels (a schedule's workload is the fused kernel after these passes).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import ir, relax, tirx
from tvm.relax.dpl import TupleGetItemPattern, is_const, is_op, rewrite_call, wildcard
from tvm.relax.expr_functor import PyExprMutator, mutator

# (op, weight layout in which axis `out_axis` holds the output channels)
_CONV_LAYOUTS = {"relax.nn.conv2d": ("OIHW", 0), "relax.nn.conv2d_transpose": ("IOHW", 1)}


def static_dims(ty) -> list[int] | None:
    """A tensor type's shape as integers; None unless every dim is a constant."""
    shape = getattr(ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr) or not all(isinstance(d, tirx.IntImm) for d in shape.values):
        return None
    return [int(d) for d in shape.values]


def uses_op(mod: tvm.IRModule, name: str) -> bool:
    """Whether a Relax function of ``mod`` calls the operator ``name`` (``relax.matmul``): the
    passes skip a module without it, which they then return exactly as it was."""
    found = False

    def visit(expr):
        nonlocal found
        found = found or (isinstance(expr, relax.Call) and isinstance(expr.op, ir.Op) and expr.op.name == name)

    for func in mod.functions.values():
        if isinstance(func, relax.Function) and not found:
            relax.analysis.post_order_visit(func, visit)
    return found


def _along(shape: tuple[int, ...], ndim: int, axis: int) -> bool:
    """Whether a constant of ``shape``, broadcast against ``ndim`` dims, varies along ``axis``
    alone (a per-channel bias: ``[C]`` against NCHW varies along W, not C)."""
    if len(shape) > ndim:
        return False  # it would add dims
    full = (1,) * (ndim - len(shape)) + tuple(shape)
    return all(d == 1 for i, d in enumerate(full) if i != axis)


def _rewrite(mod: tvm.IRModule, rewrites: list) -> None:
    """Apply ``rewrites`` ((pattern, rewriter) pairs, in order) to every Relax function of
    ``mod``, in place."""
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            new = func
            for pattern, rewriter in rewrites:
                new = rewrite_call(pattern, rewriter, new)
            if not new.same_as(func):
                mod[gvar] = new


def fold_batch_norms(mod: tvm.IRModule) -> tvm.IRModule:
    """Fold inference batch norms into the conv2d or conv2d_transpose before them.

    TVM's own ``FoldBatchnormToConv2D`` covers a bias-free conv2d only; exporters also leave a
    batch norm after a biased conv and after a transposed conv (Paddle2ONNX, torch upsampling
    heads), where it would stay a standalone kernel that no donor covers. With constant weights,
    ``bn(conv(x, W) + b) = conv(x, W * s) + (b - mean) * s + beta`` with ``s = gamma / sqrt(var + eps)``.
    Conv biases must be constants already (the importer reshapes them): :func:`clean_up` runs
    :func:`fold_constant_transforms` first.
    """
    if not uses_op(mod, "relax.nn.batch_norm"):
        return mod  # nothing to fold: the module stays exactly as imported
    original = mod
    changed = False
    for gvar, func in list(mod.functions.items()):
        if not isinstance(func, relax.Function):
            continue
        new = func
        for op_name in _CONV_LAYOUTS:
            for with_bias in (True, False):
                new = _fold_one_pattern(new, op_name, with_bias)
        if not new.same_as(func):
            mod[gvar] = new
            changed = True
    if not changed:
        return original
    seq = tvm.transform.Sequential([relax.transform.FoldConstant(),
                                    relax.transform.DeadCodeElimination()])
    return seq(mod)


def _fold_one_pattern(func: relax.Function, op_name: str, with_bias: bool) -> relax.Function:
    data, weight, bias = wildcard(), is_const(), is_const()
    conv = is_op(op_name)(data, weight)
    pre = is_op("relax.add")(conv, bias) if with_bias else conv
    gamma, beta, mean, var = is_const(), is_const(), is_const(), is_const()
    bn = is_op("relax.nn.batch_norm")(pre, gamma, beta, mean, var)
    pattern = TupleGetItemPattern(bn, 0)
    layout, out_axis = _CONV_LAYOUTS[op_name]

    def rewriter(expr, matches):
        conv_call, bn_call = matches[conv], matches[bn]
        attrs = conv_call.attrs
        if (attrs.kernel_layout != layout or attrs.data_layout != "NCHW"
                or int(bn_call.attrs.axis) != 1 or bn_call.attrs.training
                or (op_name.endswith("transpose") and int(attrs.groups) != 1)):
            return expr  # a layout or grouping this fold does not cover stays as it is
        w = matches[weight].value.numpy()
        g, bt, mu, v = (matches[p].value.numpy().astype(np.float64) for p in (gamma, beta, mean, var))
        scale = g / np.sqrt(v + float(bn_call.attrs.epsilon))
        shape = [1] * w.ndim
        shape[out_axis] = -1
        b = matches[bias].value.numpy() if with_bias else 0.0
        if with_bias and (not _along(b.shape, 4, 1) or b.size not in (1, scale.size)):
            return expr  # not a per-channel bias
        if with_bias:
            b = b.reshape(-1)
        new_w = (w * scale.reshape(shape)).astype(w.dtype)
        new_b = ((b - mu) * scale + bt).astype(w.dtype).reshape(1, -1, 1, 1)
        out = relax.Call(conv_call.op, [matches[data], relax.const(new_w)], attrs)
        return relax.op.add(out, relax.const(new_b))

    return rewrite_call(pattern, rewriter, func)


def conv_transpose_as_conv(mod: tvm.IRModule) -> tvm.IRModule:
    """Rewrite a transposed conv whose kernel equals its stride (the 2x2 stride-2 upsampling of
    U-Nets and text-detector heads) as a 1x1 conv2d and a depth-to-space shuffle.

    TOPI computes a transposed conv as a conv over the input dilated with zeros: with kernel 2
    and stride 2, three of every four multiply-adds are by zero. Here every output pixel takes
    exactly one tap, so ``y[n, o, h*k+i, w*k+j] = sum_c x[n, c, h, w] * W[c, o, i, j]``: a 1x1
    conv to ``o*k*k`` channels (a kernel every conv2d donor covers), then a reshape.
    """
    if not uses_op(mod, "relax.nn.conv2d_transpose"):
        return mod
    data, weight, bias = wildcard(), is_const(), is_const()
    conv_t = is_op("relax.nn.conv2d_transpose")(data, weight)
    patterns = [(is_op("relax.add")(conv_t, bias), True), (conv_t, False)]

    def rewriter_for(with_bias: bool):
        def rewriter(expr, matches):
            call = matches[conv_t]
            a = call.attrs
            w = matches[weight].value.numpy()
            cin, cout, kh, kw = w.shape
            shape = static_dims(call.args[0].ty)
            if (a.kernel_layout != "IOHW" or a.data_layout != "NCHW" or int(a.groups) != 1
                    or [int(x) for x in a.strides] != [kh, kw]
                    or any(int(x) for x in a.padding) or any(int(x) for x in a.output_padding)
                    or any(int(x) != 1 for x in a.dilation) or shape is None):
                return expr
            n, _, h, wd = shape
            w2 = w.transpose(1, 2, 3, 0).reshape(cout * kh * kw, cin, 1, 1)
            y = relax.op.nn.conv2d(matches[data], relax.const(np.ascontiguousarray(w2)))
            if with_bias:
                b = matches[bias].value.numpy()
                if not _along(b.shape, 4, 1) or b.size not in (1, cout):
                    return expr  # not a per-channel bias
                b = b.reshape(-1)
                b = np.broadcast_to(b, (cout,))
                # the bias of channel o repeated over its k*k sub-pixels: it stays in the conv's
                # fused epilogue instead of the shuffle
                y = relax.op.add(y, relax.const(np.repeat(b, kh * kw).astype(w.dtype)
                                                .reshape(1, -1, 1, 1)))
            y = relax.op.reshape(y, [n, cout, kh, kw, h, wd])
            y = relax.op.permute_dims(y, [0, 1, 4, 2, 5, 3])
            return relax.op.reshape(y, [n, cout, h * kh, wd * kw])
        return rewriter

    _rewrite(mod, [(pattern, rewriter_for(with_bias)) for pattern, with_bias in patterns])
    return mod


def _channel_bias(b: np.ndarray, ndim: int, channels: int) -> relax.Constant | None:
    """A constant added after a conv of ``ndim`` dims as the 2-D conv's ``[1, O, 1, 1]`` bias;
    None unless it is one value per output channel (or one for all)."""
    if not _along(b.shape, ndim, 1) or b.size not in (1, channels):
        return None
    return relax.const(np.ascontiguousarray(np.broadcast_to(b.reshape(-1), (channels,)).reshape(1, channels, 1, 1)))


def _epilogue(y, bias, epilogue: int, residual=None):
    """``y`` with the matched epilogue: 0 none, 1 the bias (and ``residual`` added), 2 those
    and a ReLU."""
    if epilogue >= 1:
        y = relax.op.add(y, bias)
    if residual is not None:
        y = relax.op.add(y, residual)
    return relax.op.nn.relu(y) if epilogue >= 2 else y


def conv1d_as_conv2d(mod: tvm.IRModule) -> tvm.IRModule:
    """Rewrite a 1-D conv (speech and audio front-ends: wav2vec2's feature extractor, Whisper's
    stem, keyword spotters, TCNs) as a 2-D conv over ``[N, C, 1, W]`` with a ``1 x k`` kernel,
    the op every CNN donor covers and the packed layouts reach, its bias, a residual sum and
    ReLU fused in the 2-D conv's epilogue.

    A conv1d has donors only from the zoo's one audio network: wav2vec2's strided 512-channel
    convs ran at 61-154 GFLOP/s on znver4 with them, where the zoo's 2-D convs reach 200+.
    As 2-D convs, a 4-layer wav2vec2 export went from 1.63x to 0.95x onnxruntime's time.
    """
    if not uses_op(mod, "relax.nn.conv1d"):
        return mod
    data, weight, bias, other = wildcard(), is_const(), is_const(), wildcard()
    conv = is_op("relax.nn.conv1d")(data, weight)
    biased = is_op("relax.add")(conv, bias)
    relu = is_op("relax.nn.relu")(biased)
    # a residual block's sum, and its ReLU: in the 2-D conv's epilogue too, as a conv1d's were
    residual = is_op("relax.add")(biased, other)
    residual_relu = is_op("relax.nn.relu")(residual)

    def rewriter_for(epilogue: int, with_residual: bool = False):
        def rewriter(expr, matches):
            call = matches[conv]
            a = call.attrs
            shape, oshape = static_dims(call.args[0].ty), static_dims(call.ty)
            if (a.data_layout != "NCW" or a.kernel_layout != "OIW" or (a.out_layout or "NCW") != "NCW"
                    or shape is None or oshape is None
                    or (with_residual and static_dims(matches[other].ty) != oshape)):
                return expr
            w = matches[weight].value.numpy()
            o, cg, k = w.shape
            b = _channel_bias(matches[bias].value.numpy(), 3, o) if epilogue >= 1 else None
            if epilogue >= 1 and b is None:
                return expr  # not a per-channel bias
            left, right = [int(x) for x in a.padding]
            y = relax.op.nn.conv2d(
                relax.op.reshape(matches[data], [shape[0], shape[1], 1, shape[2]]),
                relax.const(w.reshape(o, cg, 1, k)), strides=[1, int(a.strides[0])],
                padding=[0, left, 0, right], dilation=[1, int(a.dilation[0])], groups=int(a.groups),
                out_dtype=a.out_dtype)
            residual_4d = (relax.op.reshape(matches[other], [*oshape[:2], 1, oshape[2]])
                           if with_residual else None)
            return relax.op.reshape(_epilogue(y, b, epilogue, residual_4d), oshape)
        return rewriter

    _rewrite(mod, [(residual_relu, rewriter_for(2, True)), (residual, rewriter_for(1, True)),
                   (relu, rewriter_for(2)), (biased, rewriter_for(1)), (conv, rewriter_for(0))])
    # one conv's output back to [N, C, W] and into the next as [N, C, 1, W]: no copy between
    inner = wildcard()
    round_trip = is_op("relax.reshape")(is_op("relax.reshape")(inner, wildcard()), wildcard())

    def straight_through(expr, matches):
        x = matches[inner]
        return x if static_dims(x.ty) is not None and static_dims(x.ty) == static_dims(expr.ty) else expr

    _rewrite(mod, [(round_trip, straight_through)])
    return mod


def conv3d_as_conv2d(mod: tvm.IRModule) -> tvm.IRModule:
    """Rewrite a 3-D conv (video nets: R3D, R(2+1)D; volumetric U-Nets) as a 2-D conv, the op
    every CNN donor covers, with its bias and ReLU fused in the 2-D conv's epilogue.

    - A temporal conv (kernel kd x 1 x 1, unit spatial stride, no spatial padding) is a 2-D
      conv over frames x pixels: ``x`` as ``[N, C, D, H*W]`` with a ``kd x 1`` kernel, by
      reshapes alone.
    - Any other: the frames go into the batch and the ``kd`` temporal taps into the channels.
      ``y[n, o, t] = sum_a conv2d(x[n, :, t*sd + a*dd], W[:, :, a])`` is one 2-D conv of the
      ``kd`` shifted frame stacks ``[N*Do, kd*C, H, W]`` with the weight ``[O, kd*C, kh, kw]``;
      its output goes back to ``[N, O, Do, Ho, Wo]``. The stacking copies the input ``kd``
      times, a small part of a conv's work.

    No donor covers conv3d: TOPI's 3-D conv was left to ``--tune-missing``'s budget, and
    R3D-18 (8x112x112 clips) ran 1.8x onnxruntime on znver4.
    """
    if not uses_op(mod, "relax.nn.conv3d"):
        return mod
    data, weight, bias = wildcard(), is_const(), is_const()
    conv = is_op("relax.nn.conv3d")(data, weight)
    biased = is_op("relax.add")(conv, bias)
    relu = is_op("relax.nn.relu")(biased)

    def rewriter_for(epilogue: int):
        def rewriter(expr, matches):
            call = matches[conv]
            a = call.attrs
            shape, oshape = static_dims(call.args[0].ty), static_dims(call.ty)
            w = matches[weight].value.numpy()
            groups = int(a.groups)
            if (a.data_layout != "NCDHW" or a.kernel_layout != "OIDHW"
                    or (a.out_layout or "NCDHW") != "NCDHW" or shape is None or oshape is None):
                return expr
            o, cg, kd, kh, kw = w.shape
            (n, c, d, h, wd), (od, oh, ow) = shape, oshape[2:]
            (sd, sh, sw), (dd, dh, dw) = [int(x) for x in a.strides], [int(x) for x in a.dilation]
            front, top, left, back, bottom, right = [int(x) for x in a.padding]
            b = _channel_bias(matches[bias].value.numpy(), 5, o) if epilogue >= 1 else None
            if epilogue >= 1 and b is None:
                return expr  # not a per-channel bias

            def epilogue_of(y):
                return _epilogue(y, b, epilogue)

            x = matches[data]
            if kh == kw == 1 and sh == sw == 1 and not (top or left or bottom or right):
                y = relax.op.nn.conv2d(
                    relax.op.reshape(x, [n, c, d, h * wd]), relax.const(w.reshape(o, cg, kd, 1)),
                    strides=[sd, 1], padding=[front, 0, back, 0], dilation=[dd, 1], groups=groups,
                    out_dtype=a.out_dtype)
                return relax.op.reshape(epilogue_of(y), [n, o, od, oh, ow])
            if groups != 1 and kd != 1:
                return expr  # stacked taps would interleave the groups' channels
            if front or back:
                x = relax.op.nn.pad(x, [0, 0, 0, 0, front, back, 0, 0, 0, 0])
            frames = relax.op.permute_dims(x, [0, 2, 1, 3, 4])  # [N, D, C, H, W]
            span = (od - 1) * sd + 1
            taps = [frames if (t * dd, sd, span) == (0, 1, d + front + back) else
                    relax.op.strided_slice(frames, axes=[1], begin=[t * dd], end=[t * dd + span],
                                           strides=[sd])
                    for t in range(kd)]
            y = taps[0] if kd == 1 else relax.op.concat(taps, axis=2)
            w2 = np.ascontiguousarray(w.transpose(0, 2, 1, 3, 4).reshape(o, kd * cg, kh, kw))
            y = relax.op.nn.conv2d(
                relax.op.reshape(y, [n * od, kd * c, h, wd]), relax.const(w2), strides=[sh, sw],
                padding=[top, left, bottom, right], dilation=[dh, dw], groups=groups,
                out_dtype=a.out_dtype)
            y = relax.op.reshape(epilogue_of(y), [n, od, o, oh, ow])
            return relax.op.permute_dims(y, [0, 2, 1, 3, 4])
        return rewriter

    _rewrite(mod, [(relu, rewriter_for(2)), (biased, rewriter_for(1)), (conv, rewriter_for(0))])
    return mod


# resizes whose weights are a fixed linear combination of input pixels (every method; not
# tf_crop_and_resize, which writes extrapolation_value outside its box), and those of them
# that are the identity when the size does not change
_LINEAR_RESIZE_MODES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_half_pixel_for_nn")
_IDENTITY_RESIZE_MODES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric")


def pointwise_conv_before_resize(mod: tvm.IRModule) -> tvm.IRModule:
    """A 1x1 conv over a channel concat of resized maps (SegFormer's all-MLP head, HRNet's
    segmentation head: every scale upsampled to the largest, concatenated, fused by a 1x1
    conv) as the sum of 1x1 convs on each map before its resize.

    A resize mixes pixels with fixed weights and a 1x1 conv mixes channels, so they commute:
    ``conv(concat(resize(x_i)), W) = sum_i resize(conv(x_i, W_i))`` with ``W_i`` the weight's
    columns of part ``i``. Each part's conv runs at its own resolution, and neither the
    upsampled maps nor their concat is written. The full-resolution part's conv takes the
    sum of the others as its residual epilogue. A resize to the size it already has is
    dropped. SegFormer-B0 at 512x512: its 1024-channel concat of four bilinear resizes took
    55 ms on znver4 and the conv over it 41 ms, against onnxruntime's 148 ms for the model;
    rewritten, the model went from 1.34x to 0.80x onnxruntime's time."""
    if not uses_op(mod, "relax.image.resize2d"):
        return mod
    values = _bindings(mod)
    parts, weight = wildcard(), is_const()
    concat = is_op("relax.concat")(parts)
    conv = is_op("relax.nn.conv2d")(concat, weight)

    def resize_of(item):
        """``item``'s resize call when it is one of the linear ones in NCHW, else None."""
        val = values.get(item, item)
        if (isinstance(val, relax.Call) and isinstance(val.op, ir.Op) and val.op.name == "relax.image.resize2d"
                and val.attrs.layout == "NCHW" and val.attrs.coordinate_transformation_mode in _LINEAR_RESIZE_MODES):
            return val
        return None

    def rewriter(expr, matches):
        a, w = expr.attrs, matches[weight].value.numpy()
        cat = matches[concat]
        items = values.get(matches[parts], matches[parts])
        oshape = static_dims(expr.ty)
        if (a.data_layout != "NCHW" or a.kernel_layout != "OIHW" or (a.out_layout or "NCHW") != "NCHW"
                or w.shape[2:] != (1, 1) or int(a.groups) != 1 or any(int(x) != 1 for x in a.strides)
                or any(int(x) != 0 for x in a.padding) or int(cat.attrs.axis) not in (1, -3)
                or not isinstance(items, relax.Tuple) or oshape is None):
            return expr
        widths = [static_dims(item.ty) for item in items.fields]
        if any(d is None for d in widths) or all(resize_of(item) is None for item in items.fields):
            return expr
        full, full_w, low, c0 = [], [], [], 0
        for item, dims in zip(items.fields, widths):
            w_i = np.ascontiguousarray(w[:, c0:c0 + dims[1]])
            c0 += dims[1]
            r = resize_of(item)
            src = static_dims(r.args[0].ty) if r is not None else None
            if r is not None and src is not None and src[2] * src[3] < dims[2] * dims[3]:
                # at the map's own size, then upsampled
                y = relax.op.nn.conv2d(r.args[0], relax.const(w_i), out_dtype=a.out_dtype)
                low.append(relax.Call(r.op, [y, *r.args[1:]], r.attrs))
                continue
            if (r is not None and src == dims
                    and r.attrs.coordinate_transformation_mode in _IDENTITY_RESIZE_MODES):
                item = r.args[0]  # a resize to its own size
            full.append(item)
            full_w.append(w_i)
        if not low:
            return expr
        # the full-size parts stay one conv over their concat (DeepLabV3's ASPP branches); the
        # sum of the upsampled ones is its residual epilogue
        terms = low
        if full:
            x = full[0] if len(full) == 1 else relax.op.concat(full, axis=1)
            terms = [relax.op.nn.conv2d(x, relax.const(np.concatenate(full_w, axis=1)), out_dtype=a.out_dtype),
                     *low]
        y = terms[0]
        if len(terms) > 1:
            total = terms[1]
            for t in terms[2:]:
                total = relax.op.add(total, t)
            y = relax.op.add(y, total)
        return y

    _rewrite(mod, [(conv, rewriter)])
    return mod


# a dilated conv is split into zones only when that saves this much of its work, and into no
# more than this many zones per spatial axis (each zone is a kernel of its own to tune)
ZONE_MIN_SAVING = 1.5
ZONE_MAX_PER_AXIS = 3


def tap_zones(size: int, out: int, k: int, stride: int, dilation: int, pad: int
              ) -> list[tuple[int, int, int, int]] | None:
    """Along one spatial axis of a conv: runs of outputs ``[o0, o1)`` whose taps in the input
    (not in its zero padding) are the same, ``[t0, t1)``; None when some output has none."""
    zones: list[tuple[int, int, int, int]] = []
    for o in range(out):
        taps = [t for t in range(k) if 0 <= o * stride - pad + t * dilation < size]
        if not taps:
            return None
        t0, t1 = taps[0], taps[-1] + 1
        if zones and zones[-1][2:] == (t0, t1):
            zones[-1] = (zones[-1][0], o + 1, t0, t1)
        else:
            zones.append((o, o + 1, t0, t1))
    return zones


def dilated_conv_zones(mod: tvm.IRModule) -> tvm.IRModule:
    """Rewrite a conv whose taps mostly read its zero padding (DeepLab's atrous convs, rates of
    12-36 on a 14x14 map) as one conv per zone of outputs that read the same taps, each over
    its slice of the input with only those taps and no padding, concatenated back.

    An exact rewrite: the dropped multiply-adds are all by padding zeros. At rate 24 or more
    on 14x14 only the centre tap ever reads the map (a 1x1 conv, 9x less work); at rate 12 the
    corners read 2-4 taps, the middle one (0.18 of the work). Kernels skip nothing: TOPI
    computes every tap of the padded input.
    """
    data, weight = wildcard(), is_const()
    conv = is_op("relax.nn.conv2d")(data, weight)

    def rewriter(expr, matches):
        call = matches[conv]
        a = call.attrs
        shape, oshape = static_dims(call.args[0].ty), static_dims(call.ty)
        if (a.data_layout != "NCHW" or a.kernel_layout != "OIHW" or a.out_layout != "NCHW"
                or all(int(x) == 1 for x in a.dilation) or shape is None or oshape is None):
            return expr
        w = matches[weight].value.numpy()
        (_, _, h, wd), (oh, ow) = shape, oshape[2:]
        (sh, sw), (dh, dw) = [int(x) for x in a.strides], [int(x) for x in a.dilation]
        top, left = int(a.padding[0]), int(a.padding[1])
        kh, kw = w.shape[2:]
        rows = tap_zones(h, oh, kh, sh, dh, top)
        cols = tap_zones(wd, ow, kw, sw, dw, left)
        if not rows or not cols or max(len(rows), len(cols)) > ZONE_MAX_PER_AXIS:
            return expr
        work = sum((o1 - o0) * (t1 - t0) for o0, o1, t0, t1 in rows) \
            * sum((o1 - o0) * (t1 - t0) for o0, o1, t0, t1 in cols)
        if oh * kh * ow * kw < ZONE_MIN_SAVING * work:
            return expr
        x = matches[data]
        grid = []
        for o0, o1, r0, r1 in rows:
            line = []
            for p0, p1, c0, c1 in cols:
                begin = [o0 * sh - top + r0 * dh, p0 * sw - left + c0 * dw]
                end = [(o1 - 1) * sh - top + (r1 - 1) * dh + 1, (p1 - 1) * sw - left + (c1 - 1) * dw + 1]
                part = x if begin == [0, 0] and end == [h, wd] else \
                    relax.op.strided_slice(x, axes=[2, 3], begin=begin, end=end)
                taps = np.ascontiguousarray(w[:, :, r0:r1, c0:c1])
                line.append(relax.op.nn.conv2d(
                    part, relax.const(taps), strides=[sh, sw], padding=[0, 0, 0, 0],
                    dilation=[dh if r1 - r0 > 1 else 1, dw if c1 - c0 > 1 else 1],
                    groups=int(a.groups), out_dtype=a.out_dtype))
            grid.append(line[0] if len(line) == 1 else relax.op.concat(line, axis=3))
        return grid[0] if len(grid) == 1 else relax.op.concat(grid, axis=2)

    _rewrite(mod, [(conv, rewriter)])
    return mod


def _bindings(mod: tvm.IRModule) -> dict:
    """The variables of ``mod``'s Relax functions and the values bound to them."""
    return {v: val for func in mod.functions.values() if isinstance(func, relax.Function)
            for v, val in relax.analysis.get_var2val(func).items()}


def _constants(mod: tvm.IRModule) -> dict:
    """The variables of ``mod``'s Relax functions that are bound to constants, and their values."""
    return {v: val for v, val in _bindings(mod).items() if isinstance(val, ir.Constant)}


def _bound_constant(expr, consts: dict) -> np.ndarray | None:
    """``expr``'s value if it is a constant or a variable bound to one, else None."""
    if isinstance(expr, relax.Var):
        expr = consts.get(expr, expr)
    return expr.value.numpy() if isinstance(expr, ir.Constant) else None


def flatten_matmul_rows(mod: tvm.IRModule) -> tvm.IRModule:
    """A matmul by a constant [K, N] weight whose rows are not laid out as rows (a
    sequence-first ``[L, 1, K]`` projection, a 2-D ``[M, K]`` Gemm) runs as ``[1, M, K]``, the
    shape every language and vision transformer donor was tuned on, and is reshaped back.

    The rows of a matmul are its rows whatever the leading dims: TOPI's matmul treats
    ``[50, 1, 768] x [768, 2304]`` (torchvision's attention in-projection) as 50 products of a
    single row, whose loops no [1, 128, K] donor tiles well: 69 GFLOP/s on znver4 against
    156 for the same work as ``[1, 50, 768]``. With the bias add kept beside the matmul."""
    if not uses_op(mod, "relax.matmul"):
        return mod
    consts = _constants(mod)
    data, weight, bias = wildcard(), wildcard(), wildcard()
    matmul = is_op("relax.matmul")(data, weight)
    biased = is_op("relax.add")(matmul, bias)

    def rewriter_for(with_bias: bool):
        def rewriter(expr, matches):
            w = _bound_constant(matches[weight], consts)
            shape = static_dims(matches[data].ty)
            if w is None or w.ndim != 2 or shape is None or len(shape) < 2:
                return expr
            rows = int(np.prod(shape[:-1]))
            if rows == 1 or (len(shape) > 2 and shape[-2] != 1):
                # one row (a classifier), or rows laid out already ([1, M, K], Swin's [1, H, W, C]):
                # the reshape back is a view that would split the matmul from its epilogue
                return expr
            b = None
            if with_bias:
                b = _bound_constant(matches[bias], consts)
                if b is None or not _along(b.shape, len(shape), len(shape) - 1) or b.size != w.shape[1]:
                    return expr  # not one value per output column
            call = matches[matmul]
            y = relax.op.matmul(relax.op.reshape(matches[data], [1, rows, w.shape[0]]), relax.const(w),
                                out_dtype=call.attrs.out_dtype)
            if b is not None:
                y = relax.op.add(y, relax.const(np.ascontiguousarray(b.reshape(-1))))
            return relax.op.reshape(y, [*shape[:-1], w.shape[1]])
        return rewriter

    _rewrite(mod, [(biased, rewriter_for(True)), (matmul, rewriter_for(False))])
    return mod


def powers_as_products(mod: tvm.IRModule) -> tvm.IRModule:
    """``x ** 2`` and ``x ** 3`` as products, ``x ** 0.5`` as a square root, for a constant
    exponent (GPT-2's tanh GELU takes ``x ** 3``; T5's and hand-written layer norms square).

    TVM lowers a power to libm's ``powf`` per element, which no loop vectorises: GPT-2's
    GELU ran at 12 GFLOP/s on znver4, 7.2 of its 76 ms; with products a 6-layer GPT-2 export
    went from 1.30x to 1.11x onnxruntime's time."""
    if not uses_op(mod, "relax.power"):
        return mod
    consts = _constants(mod)
    base, exponent = wildcard(), wildcard()
    pattern = is_op("relax.power")(base, exponent)

    def rewriter(expr, matches):
        e, x = _bound_constant(matches[exponent], consts), matches[base]
        if (e is None or e.size == 0 or not np.all(e == e.flat[0]) or static_dims(x.ty) is None
                or static_dims(x.ty) != static_dims(expr.ty) or not str(expr.ty.dtype).startswith("float")):
            return expr  # a computed or varying exponent, or one that broadcasts the base
        v = float(e.flat[0])
        if v == 2.0:
            return relax.op.multiply(x, x)
        if v == 3.0:
            return relax.op.multiply(relax.op.multiply(x, x), x)
        return relax.op.sqrt(x) if v == 0.5 else expr

    _rewrite(mod, [(pattern, rewriter)])
    return mod


def padded_columns(n: int) -> int:
    """The column count a matmul weight with ``n`` columns is padded to (``n`` when it needs
    none): a multiple of 64 when that adds at most 2%, else of 16, so that the output's last
    loop splits into whole vectors of every x86 CPU (8 or 16 floats) and tiles around them."""
    if n % 8 == 0 or n < 64:
        return n
    by64 = -(-n // 64) * 64
    return by64 if by64 - n <= 0.02 * n else -(-n // 16) * 16


def pad_matmul_columns(mod: tvm.IRModule) -> tvm.IRModule:
    """A matmul by a constant [K, N] weight whose N fills no whole vector (a language model's
    vocabulary: GPT-2's 50257 = 29 x 1733, BERT's 30522, a recogniser's 6625 characters) runs
    on a weight padded with zero columns (:func:`padded_columns`), and its output is sliced back.

    MetaSchedule tiles a loop only by exact divisors, so such an N leaves no vector-wide inner
    tile: on znver4 GPT-2's head ([128, 768] x [768, 50257]) ran 635 ms with a BERT matmul's
    schedule and 90 ms with one tuned for it, and padded to 50304, 65 ms with the same BERT
    schedule (onnxruntime: 49-53 ms). The slice is a copy of the output, a small part of that.

    A product of two activations (attention's scores, Q K^T over ViT-B/32's 50 tokens or
    Swin's 49) gets its second operand padded on the fly to a multiple of 16 columns when that
    adds at most a third: on znver4 ViT-B/32's [12, 50, 64] x [12, 64, 50] ran at 11 GFLOP/s,
    and at 136 on 64 columns.
    """
    if not uses_op(mod, "relax.matmul"):
        return mod
    consts = _constants(mod)
    data, weight, other = wildcard(), is_const(), wildcard()
    pattern = is_op("relax.matmul")(data, weight)
    products = is_op("relax.matmul")(data, other)

    def rewriter(expr, matches):
        w = matches[weight].value.numpy()
        shape = getattr(getattr(expr, "ty", None), "shape", None)
        if w.ndim != 2 or shape is None or (n := w.shape[1]) == (n_pad := padded_columns(w.shape[1])):
            return expr
        wp = np.zeros((w.shape[0], n_pad), w.dtype)
        wp[:, :n] = w
        y = relax.op.matmul(matches[data], relax.const(wp), out_dtype=expr.attrs.out_dtype)
        return relax.op.strided_slice(y, axes=[len(shape) - 1], begin=[0], end=[n])

    def product_rewriter(expr, matches):
        # two activations (attention's Q K^T over 50 or 197 tokens): zero columns padded on
        # the fly, a small copy beside a product whose last loop would not vectorise
        b, shape = matches[other], static_dims(expr.ty)
        b_shape = static_dims(b.ty)
        if (_bound_constant(b, consts) is not None or b_shape is None or shape is None
                or len(b_shape) < 2):
            return expr
        n = b_shape[-1]
        n_pad = -(-n // 16) * 16
        if n % 8 == 0 or n < 16 or 3 * (n_pad - n) > n:
            return expr
        b = relax.op.nn.pad(b, [0, 0] * (len(b_shape) - 1) + [0, n_pad - n])
        y = relax.op.matmul(matches[data], b, out_dtype=expr.attrs.out_dtype)
        return relax.op.strided_slice(y, axes=[len(shape) - 1], begin=[0], end=[n])

    _rewrite(mod, [(pattern, rewriter), (products, product_rewriter)])
    return mod


def padded_extent(n: int) -> int:
    """The output rows or columns a conv computes for ``n`` (``n`` when it needs no more):
    MetaSchedule tiles a loop only by its divisors, so a prime 71 or 17 gets no register tile
    at all; the next extent with a divisor between 4 and 16 (72, 18) gets them."""
    def tiles(m: int) -> bool:
        return any(m % d == 0 for d in range(4, 17))

    if n <= 16 or tiles(n):
        return n
    return next(m for m in range(n + 1, 2 * n) if tiles(m))


def pad_conv_outputs(mod: tvm.IRModule) -> tvm.IRModule:
    """A conv whose output rows or columns tile badly (:func:`padded_extent`: Inception's 71
    and 17 at 299x299, a detector's 19 and 38 at 608) computes a row or column more from
    padding zeros, and its output is sliced back after its bias and ReLU (which stay fused
    with it): exact, the extra outputs are dropped.

    On znver4 Inception-v3's 3x3 conv 80->192 on 73x73 (1.4 GFLOP) took 12.8 ms with every
    transferred schedule, its 71-wide loops tiled [71, 1, 1, 1] (109 GFLOP/s); on 72, 6.3 ms.
    """
    data, weight, bias = wildcard(), is_const(), is_const()
    conv = is_op("relax.nn.conv2d")(data, weight)
    biased = is_op("relax.add")(conv, bias)
    relu = is_op("relax.nn.relu")(biased)

    def padded(call, matches):
        """The conv computing padded outputs, and its real rows and columns; None if fine."""
        a = call.attrs
        shape = static_dims(call.ty)
        if a.data_layout != "NCHW" or a.out_layout != "NCHW" or shape is None:
            return None
        oh, ow = shape[2:]
        ph, pw = padded_extent(oh), padded_extent(ow)
        if (ph, pw) == (oh, ow) or ph * pw > 1.15 * oh * ow:
            return None
        (sh, sw), pad = [int(x) for x in a.strides], [int(x) for x in a.padding]
        return relax.op.nn.conv2d(
            matches[data], matches[weight], strides=[sh, sw],
            padding=[pad[0], pad[1], pad[2] + (ph - oh) * sh, pad[3] + (pw - ow) * sw],
            dilation=[int(x) for x in a.dilation], groups=int(a.groups), data_layout="NCHW",
            kernel_layout=a.kernel_layout, out_layout="NCHW", out_dtype=a.out_dtype), (oh, ow)

    def rewriter_for(epilogue: int):
        def rewriter(expr, matches):
            got = padded(matches[conv], matches)
            if got is None or (epilogue >= 1 and not _along(matches[bias].value.shape, 4, 1)):
                return expr  # a constant that varies along H or W would not fit the padded rows
            y, (oh, ow) = got
            if epilogue >= 1:
                y = relax.op.add(y, matches[bias])
            if epilogue >= 2:
                y = relax.op.nn.relu(y)
            return relax.op.strided_slice(y, axes=[2, 3], begin=[0, 0], end=[oh, ow])
        return rewriter

    _rewrite(mod, [(relu, rewriter_for(2)), (biased, rewriter_for(1)), (conv, rewriter_for(0))])
    return mod


def clean_up(mod: tvm.IRModule) -> tvm.IRModule:
    """Every clean-up, in order: constant reshapes, then batch norms (they fold into a
    transposed conv too), transposed convs that are 1x1 convs, 3-D and 1-D convs as 2-D convs,
    1x1 convs over concatenated resizes before the resizes, dilated convs split into the zones
    that read their input, conv outputs padded to tileable extents, matmul rows as [1, M, K],
    matmul weights padded to whole vectors, constant powers as products."""
    return powers_as_products(pad_matmul_columns(flatten_matmul_rows(pad_conv_outputs(dilated_conv_zones(
        pointwise_conv_before_resize(conv1d_as_conv2d(conv3d_as_conv2d(conv_transpose_as_conv(
            fold_batch_norms(fold_constant_transforms(mod)))))))))))


_INDEX_OPS = {tirx.Add: np.add, tirx.Sub: np.subtract, tirx.Mul: np.multiply,
              tirx.FloorDiv: np.floor_divide, tirx.FloorMod: np.mod}


def _eval_index(expr, env: dict):
    """An index expression of an IndexMap (vars, integers, + - *, floordiv, floormod),
    evaluated on numpy index arrays (broadcast, so no full grid per axis)."""
    if isinstance(expr, tirx.Var):
        return env[expr.name]
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Cast):
        return _eval_index(expr.value, env)
    for kind, fn in _INDEX_OPS.items():
        if isinstance(expr, kind):
            return fn(_eval_index(expr.a, env), _eval_index(expr.b, env))
    raise NotImplementedError(type(expr).__name__)


def transform_constant(data: np.ndarray, index_map) -> np.ndarray | None:
    """``data`` laid out by ``index_map`` (a bijection), computed with numpy; None when the
    map pads, drops or repeats elements, or uses an expression this does not evaluate."""
    axes = np.ogrid[tuple(slice(0, n) for n in data.shape)]
    env = {v.name: a for v, a in zip(index_map.initial_indices, axes)}
    try:
        idx = [np.broadcast_to(_eval_index(e, env), data.shape) for e in index_map.final_indices]
    except NotImplementedError:
        return None
    if any(int(i.min()) < 0 for i in idx):
        return None
    shape = tuple(int(i.max()) + 1 for i in idx)
    if int(np.prod(shape)) != data.size:
        return None
    out = np.empty(shape, data.dtype)
    seen = np.zeros(shape, bool)
    out[tuple(idx)] = data
    seen[tuple(idx)] = True
    return out if seen.all() else None


def _static_ints(expr) -> list[int] | None:
    values = getattr(expr, "values", None)
    if values is None or not all(isinstance(v, tirx.IntImm) for v in values):
        return None
    return [int(v.value) for v in values]


def _fold_reshape(call, data: np.ndarray) -> np.ndarray | None:
    shape = _static_ints(call.args[1])
    return data.reshape(shape) if shape is not None and int(np.prod(shape)) == data.size else None


def _fold_layout_transform(call, data: np.ndarray) -> np.ndarray | None:
    if call.attrs.pad_value is not None:
        return None
    return transform_constant(data, call.attrs.index_map)


def _fold_permute_dims(call, data: np.ndarray) -> np.ndarray | None:
    axes = call.attrs.axes
    return data.transpose(None if axes is None else [int(a) for a in axes])


# data movement on constants that numpy does in microseconds (no arithmetic: FoldConstant's
# results for those stay bit for bit TVM's)
_FOLDS = {"relax.reshape": _fold_reshape, "relax.layout_transform": _fold_layout_transform,
          "relax.permute_dims": _fold_permute_dims}


def fold_constant_transforms(mod):
    """Reshapes, permutations and layout transforms of constants (packed weights, biases made
    [1, C, 1, 1]) replaced by the constants they make, computed with numpy. Relax's
    ``FoldConstant`` compiles and runs one TIR function per shape with LLVM, at every kernel
    extraction and every compile of the model: 9 s for packed ResNet-50 on 2 cores. What
    this does not fold is left to it."""
    ops = {tvm.ir.Op.get(name): fn for name, fn in _FOLDS.items()}

    @mutator
    class _Fold(PyExprMutator):
        def visit_call_(self, call):  # noqa: N802
            call = self.visit_expr_post_order(call)
            fn = ops.get(call.op) if isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op) else None
            if fn is None:
                return call
            x = call.args[0]
            if isinstance(x, relax.Var):
                x = self.lookup_binding(x)
            if not isinstance(x, ir.GenericConst):
                return call
            data = x.value.numpy()
            folded = fn(call, data)
            if folded is None:
                return call
            self.folded += 1
            return relax.const(np.ascontiguousarray(folded), str(data.dtype))

    # a var bound to a folded call still looks up as the call in the same pass: a chain
    # (a bias reshaped, then packed) folds one link per pass
    for _ in range(8):
        fold = _Fold(mod)
        fold.folded = 0
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                fold.builder_.update_func(gv, fold.visit_expr(func))
        mod = relax.transform.DeadCodeElimination()(fold.builder_.get())
        if not fold.folded:
            break
    return mod
