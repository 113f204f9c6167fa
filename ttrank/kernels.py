"""Kernels: MetaSchedule task extraction, and a description of each kernel read off its TIR.

Everything here is derived from the TIR alone, so that a kernel extracted from a model and a
workload read from somebody's MetaSchedule log are described (and classed) the same way.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from functools import reduce
from typing import Any

from .target import make_target


@dataclass
class Kernel:
    """One tunable kernel (a fused PrimFunc) of a model, or a donor workload."""

    name: str
    workload_class: str  # anchor op + epilogue, free of per-model counters
    anchor_op: str  # normalised anchor block name: conv2d_nchw, group_conv2d_nchw, matmul, ...
    iter_kinds: str  # anchor block iterators, "S" spatial / "R" reduction, e.g. "SSSSRRR"
    extents: list[int]  # anchor block iterator extents
    epilogue: list[str]  # the other blocks' ops, in order
    attrs: dict[str, Any]  # stride, kernel, groups, depthwise, layout, m/n/k ...
    input_shapes: list[list[int]]
    output_shape: list[int]
    dtype: str
    flops: float
    weight: int = 1
    workload_hash: str = ""
    mod: Any = field(default=None, repr=False, compare=False)  # tvm.IRModule

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("mod")
        d["shape"] = self.extents
        return d

    @property
    def tunable(self) -> bool:
        """Kernels worth scheduling: they have a reduction or do arithmetic."""
        return self.flops > 0 or "R" in self.iter_kinds

    @property
    def is_matmul(self) -> bool:
        """Anchored on a matrix product (dense, batched, transposed)."""
        return is_matmul_op(self.anchor_op)

    def compatible(self, other: Kernel) -> bool:
        """A schedule of ``other`` can be replayed on this kernel: the same loop nest, under the
        same anchor op or a variant of it (:data:`ANCHOR_VARIANTS`)."""
        return other.anchor_op in anchor_family(self.anchor_op) and self.iter_kinds == other.iter_kinds


def is_matmul_op(anchor_op: str) -> bool:
    """Whether a (normalised) anchor block name is a matrix product's."""
    return anchor_op in ("matmul", "batch_matmul", "dense") or anchor_op.endswith("matmul_NT")


# Anchor ops whose anchor blocks have the same loop nest (batch, out channel, rows, columns;
# in channel, kernel rows, kernel columns) under another name: a schedule of one replays on the
# other once its blocks are renamed (transfer maps the anchor and its padding block).
ANCHOR_VARIANTS: dict[str, tuple[str, ...]] = {
    "conv2d_nchw": ("conv2d_nchw", "conv2d_transpose_nchw"),
    "conv2d_transpose_nchw": ("conv2d_transpose_nchw", "conv2d_nchw"),
}


def anchor_family(anchor_op: str) -> tuple[str, ...]:
    """The anchor ops whose schedules are candidates for a kernel anchored on ``anchor_op``."""
    return ANCHOR_VARIANTS.get(anchor_op, (anchor_op,))


_SUFFIX = re.compile(r"(_intermediate|_red|_sum|_rf)$")


# TE names reduction stages after their input variable ("lv8_var_sum"); keep only the stage
_REDUCTION_STAGES = ("var_sum", "sum", "mean", "red", "max", "min", "prod")


def norm_block_name(name: str) -> str:
    for stage in _REDUCTION_STAGES:
        if name.endswith("_" + stage) and re.match(r"^(lv\d*|[A-Za-z_]*\d+)_", name):
            return "reduce" if stage == "red" else stage
    n = name
    if n.startswith("T_"):
        n = n[2:]
    n = _SUFFIX.sub("", n)
    n = re.sub(r"\d+$", "", n)
    return n


def _compute_op(block) -> str:
    """Name what a generic ``compute`` block does (relu, erf, tanh, cast, ...)."""
    from tvm import ir, tirx

    body = block.body
    value = getattr(body, "value", None)
    if value is None:
        return "compute"
    if isinstance(value, tirx.Max):
        return "relu"
    if isinstance(value, tirx.Cast):
        return "cast"
    if isinstance(value, ir.Call):
        op = str(getattr(value.op, "name", "call"))
        return op.split(".")[-1]
    return type(value).__name__.lower()


def _block_token(block) -> str:
    name = norm_block_name(block.name_hint)
    if name == "compute":
        return _compute_op(block)
    return name


def _lin_coeff(expr, var) -> int | None:
    from tvm.sym.pattern import detect_linear_equation

    try:
        coeffs = detect_linear_equation(expr, [var])
        if len(coeffs) == 2:
            return int(coeffs[0])
    except Exception:
        return None
    return None


def _conv_attrs(block, extents: list[int]) -> dict[str, Any]:
    """stride, dilation, kernel, groups of a conv2d_nchw / group_conv2d_nchw anchor block."""
    iv = [v.var for v in block.iter_vars]
    data = block.reads[0]
    idx = [r.min for r in data.region]
    attrs: dict[str, Any] = {"layout": "NCHW", "kernel": [extents[5], extents[6]]}
    if len(idx) == 4 and len(iv) == 7:
        attrs["stride"] = [_lin_coeff(idx[2], iv[2]), _lin_coeff(idx[3], iv[3])]
        attrs["dilation"] = [_lin_coeff(idx[2], iv[5]), _lin_coeff(idx[3], iv[6])]
        cin = int(data.source.shape[1])
        groups = max(1, cin // max(1, extents[4]))
        attrs.update(in_channels=cin, out_channels=extents[1], groups=groups,
                     depthwise=groups > 1 and groups == cin,
                     padded_input_hw=[int(data.source.shape[2]), int(data.source.shape[3])])
    return attrs


def _matmul_attrs(block, extents: list[int], kinds: str) -> dict[str, Any]:
    spatial = [e for e, k in zip(extents, kinds) if k == "S"]
    red = [e for e, k in zip(extents, kinds) if k == "R"]
    attrs: dict[str, Any] = {"m": spatial[-2] if len(spatial) >= 2 else 1,
                             "n": spatial[-1] if spatial else 1,
                             "k": reduce(lambda a, b: a * b, red, 1),
                             "batch": reduce(lambda a, b: a * b, spatial[:-2], 1)}
    if len(block.reads) >= 2:
        kvar = [v.var for v, k in zip(block.iter_vars, kinds) if k == "R"]
        b_idx = [r.min for r in block.reads[1].region]
        if kvar and b_idx:
            last_is_k = _lin_coeff(b_idx[-1], kvar[0]) == 1
            attrs["layout"] = "NT" if last_is_k else "NN"
    return attrs


def describe(mod, name: str | None = None, weight: int = 1) -> Kernel:
    """Describe a single-function IRModule (a MetaSchedule workload) as a :class:`Kernel`."""
    import tvm_ffi
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms

    func = mod["main"] if "main" in [gv.name_hint for gv in mod.functions] else list(mod.functions.values())[0]
    sch = s_tir.Schedule(mod)
    blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root", func_name=_fname(mod)))]
    anchor = s_tir.analysis.find_anchor_sblock(mod)
    if anchor is None:
        # injective kernels: the block with the largest iteration space stands for the kernel
        anchor = max(blocks, key=lambda b: _iters(b), default=None)
    extents = [int(v.dom.extent) for v in anchor.iter_vars] if anchor is not None else []
    kinds = "".join("R" if v.iter_type == 2 else "S" for v in anchor.iter_vars) if anchor is not None else ""
    anchor_op = norm_block_name(anchor.name_hint) if anchor is not None else "empty"
    epilogue = [_block_token(b) for b in blocks
                if anchor is None or not b.same_as(anchor)]
    if anchor_op == "compute" and {"data_dilate", "kernel_transform"} <= set(epilogue):
        anchor_op = "conv2d_transpose_nchw"  # TOPI's transposed conv names its anchor "compute"
    epilogue = [t for t in epilogue if t not in ("pad_temp",)]
    attrs: dict[str, Any] = {}
    if anchor is not None and anchor_op in ("conv2d_nchw", "group_conv2d_nchw"):
        attrs = _conv_attrs(anchor, extents)
    elif is_matmul_op(anchor_op):
        attrs = _matmul_attrs(anchor, extents, kinds)
    args = ms.arg_info.ArgInfo.from_prim_func(func)
    shapes = [[int(d) for d in a.shape] for a in args]
    dtype = str(args[0].dtype) if args else "float32"
    flops = float(s_tir.analysis.estimate_tir_flops(mod))
    wclass = "+".join([anchor_op] + epilogue)
    h = f"{tvm_ffi.structural_hash(mod) & 0xFFFFFFFFFFFFFFFF:016x}"
    return Kernel(name=name or wclass.replace("+", "_"), workload_class=wclass, anchor_op=anchor_op,
                  iter_kinds=kinds, extents=extents, epilogue=epilogue, attrs=attrs,
                  input_shapes=shapes[:-1], output_shape=shapes[-1] if shapes else [],
                  dtype=dtype, flops=flops, weight=int(weight), workload_hash=h, mod=mod)


def _fname(mod) -> str:
    return [gv.name_hint for gv in mod.functions][0]


def _iters(block) -> int:
    return reduce(lambda a, b: a * b, [int(v.dom.extent) for v in block.iter_vars], 1)


def class_of_task_name(task_name: str) -> str:
    """``fused_conv2d3_add3_relu2`` -> ``conv2d_add_relu``: the per-model counters stripped."""
    name = task_name[len("fused_"):] if task_name.startswith("fused_") else task_name
    return "_".join(re.sub(r"\d+$", "", t) for t in name.split("_") if t)


FUSION_PASSES = ("LegalizeOps", "AnnotateTIROpPattern", "FoldConstant", "FuseOps", "FuseTIR")
# the PrimFunc attribute by which MetaSchedule's RewriteLayout postprocessor may choose the
# layout of a buffer (relax.transform.AttachAttrLayoutFreeBuffers sets it for every kernel)
LAYOUT_FREE = "layout_free_buffers"


def fuse(mod):
    """The fusion pipeline MetaSchedule expects before task extraction, then
    :func:`mark_prepacked_weights`: the one preparation every extraction, tuning run and
    database compile shares, so that their workloads match."""
    import tvm
    from tvm import relax

    seq = tvm.transform.Sequential([getattr(relax.transform, p)() for p in FUSION_PASSES])
    with tvm.transform.PassContext(opt_level=3):
        return mark_prepacked_weights(seq(mod))


def unmark_prepacked_weights(mod):
    """``mod`` (fused) without layout-free marks: as kernels were extracted before
    :func:`mark_prepacked_weights` (a schedule of it reads its weights as the model holds them)."""
    out = mod
    for gv, func in mod.functions.items():
        if func.attrs is not None and LAYOUT_FREE in func.attrs:
            if out is mod:
                out = mod.clone()
            out.update_func(gv, func.without_attr(LAYOUT_FREE))
    return out


def mark_prepacked_weights(mod):
    """``mod`` (fused) with each matrix product's constant weight marked layout-free, so that a
    schedule's RewriteLayout postprocessor packs it in the order the schedule reads it, once,
    when the model is compiled (the database pipeline folds the packing into the constant).

    Only matmuls: with pre-packed weights MetaSchedule's ViT-B/32 MLP matmul (50 x 768 x 3072)
    ran 1.20 against 1.62 ms and BERT's 256 x 768 x 768 1.61 against 1.75 ms after 256-512
    trials on znver3 (0.88x onnxruntime's node, from 1.02x); ResNet-18's 3x3 conv lost (0.81
    against 0.75 ms on znver5), and packed convs already get their weights in blocks. Unlike
    AttachAttrLayoutFreeBuffers this renames no kernel and marks only what the anchor reads."""
    import tvm
    from tvm import relax, s_tir, tirx

    call_tir = tvm.ir.Op.get("relax.call_tir")
    constant: dict[str, set[int]] = {}  # kernel -> the arguments constant at every call of it
    for func in mod.functions.values():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        for block in func.body.blocks:
            for binding in block.bindings:
                call = binding.value
                if not (isinstance(call, relax.Call) and call.op.same_as(call_tir)):
                    continue
                args = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else [call.args[1]]
                here = {i for i, a in enumerate(args) if isinstance(a, tvm.ir.expr.Constant)}
                name = call.args[0].name_hint
                constant[name] = constant[name] & here if name in constant else here
    marked = mod
    for gv, func in mod.functions.items():
        if not (isinstance(func, tirx.PrimFunc) and constant.get(gv.name_hint)):
            continue
        anchor = s_tir.analysis.find_anchor_sblock(tvm.IRModule({gv: func}))
        if anchor is None or not is_matmul_op(norm_block_name(anchor.name_hint)):
            continue
        # (TVM 0.27's PrimFunc parameters are the tensors its blocks read)
        free = [i for i in sorted(constant[gv.name_hint])
                if i < len(func.params) and any(r.source.same_as(func.params[i]) for r in anchor.reads)]
        if free:
            if marked is mod:
                marked = mod.clone()
            marked.update_func(gv, func.with_attr(LAYOUT_FREE, free))
    return marked


def extract(mod, target=None, include_injective: bool = True) -> list[Kernel]:
    """Extract the kernels of a Relax module (as imported; fusion runs here)."""
    from tvm.s_tir import meta_schedule as ms

    target = target or make_target()
    tasks = ms.relax_integration.extract_tasks(fuse(mod), target)
    kernels = [describe(t.dispatched[0], t.task_name, t.weight) for t in tasks]
    if not include_injective:
        kernels = [k for k in kernels if k.tunable]
    kernels.sort(key=lambda k: -k.flops * k.weight)
    return kernels


def model_kernels(model, target=None) -> list[Kernel]:
    """:func:`extract` of a :class:`~ttrank.frontend.LoadedModel`, once per target: the
    result is kept on the model (choosing its layout and recommending both need it)."""
    target = target or make_target()
    key = str(target)
    if key not in model.kernel_cache:
        model.kernel_cache[key] = extract(model.mod, target)
    return list(model.kernel_cache[key])
