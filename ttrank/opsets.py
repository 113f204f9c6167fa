"""Graphs written for old opsets, brought to the forms TVM's ONNX importer converts.

TVM 0.27's importer has many converters only for an op's newest signature (Slice, Gemm,
Gather, Flatten: opset 13; Resize: 18) and applies it whatever the model's opset. So the
ONNX Model Zoo's and older exporters' graphs (opsets 7-12) fail or, worse, mean something
else: an opset-10 Resize ``(X, scales)`` has its scales read as the ROI, an opset-9 Upsample
fails. onnx's version converter rewrites each node into the signature of a newer opset (an
Upsample into a Resize, attributes into inputs). Exporters also pass "no scales" as an empty
constant rather than an absent input, which the importer reads as both scales and sizes given.

onnxruntime still checks the compiled model against the graph as the user gave it.
"""

from __future__ import annotations

import logging

import onnx
from onnx import helper, version_converter

log = logging.getLogger("ttrank")

# graphs older than this are converted ...
OLDEST_IMPORTED = 13
# ... to this opset: what torch.onnx writes by default, and what ttrank's zoo is exported at
CONVERTED_TO = 17


def default_opset(model: onnx.ModelProto) -> int:
    """The model's opset of the default ONNX domain (1 when it declares none)."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def modernize(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` in forms the importer converts as the ONNX spec means them, and what was
    changed (none: ``model`` itself comes back)."""
    changed = []
    opset = default_opset(model)
    if opset < OLDEST_IMPORTED:
        try:
            model = _convert(model, opset)
        except Exception as e:  # noqa: BLE001 - no adapter for one of its ops: import as it is
            why = (str(e).strip() or type(e).__name__).splitlines()[0][:200]
            log.info("onnx's version converter cannot bring opset %d to %d (%s); importing as exported",
                     opset, CONVERTED_TO, why)
        else:
            changed.append(f"opset {opset} to {CONVERTED_TO}")
    empty = _empty_constants(model)
    # (node, input) of each Resize's roi or scales that is an empty constant: an empty one means none
    absent = [(j, i) for j, n in enumerate(model.graph.node)
              if n.op_type == "Resize" and n.domain in ("", "ai.onnx")
              for i in (1, 2) if i < len(n.input) and n.input[i] in empty]
    if absent:
        if not changed:  # the caller's model stays as given
            copy = onnx.ModelProto()
            copy.CopyFrom(model)
            model = copy
        for j, i in absent:
            model.graph.node[j].input[i] = ""
        changed.append("Resize's empty roi/scales as absent inputs")
    return model, changed


def _convert(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """``model`` (at ``opset``) converted to :data:`CONVERTED_TO`.

    Upsample and opset 10's Resize map output pixels to input ones as opset 11's "asymmetric"
    does (and onnxruntime rounds their nearest pixel down); the converter leaves opset 11's
    defaults, half_pixel and round_prefer_floor, which shift every pixel. So the graph goes to
    opset 10 first (an Upsample becomes a Resize there, under a new name), where every Resize
    is one of those; from 10 on the converter keeps their names."""
    if opset < 10:
        model = version_converter.convert_version(model, 10)
    legacy = {n.output[0] for n in model.graph.node if n.op_type == "Resize"} if opset < 11 else set()
    model = version_converter.convert_version(model, CONVERTED_TO)
    for n in model.graph.node:
        if n.op_type == "Resize" and n.output[0] in legacy:
            _set_default(n, "coordinate_transformation_mode", "asymmetric")
            _set_default(n, "nearest_mode", "floor")
    return model


def _empty_constants(model: onnx.ModelProto) -> set[str]:
    """Names of the main graph's constants with no elements (initializers and Constant nodes)."""
    out = {t.name for t in model.graph.initializer if 0 in t.dims}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            for a in n.attribute:
                if a.name == "value" and 0 in a.t.dims:
                    out.add(n.output[0])
    return out


def _set_default(node: onnx.NodeProto, name: str, value: str) -> None:
    """Give ``node`` the string attribute ``name`` unless it has one."""
    if not any(a.name == name for a in node.attribute):
        node.attribute.append(helper.make_attribute(name, value))
