"""What ttrank accepts from donor logs written by others.

A donor record's schedule is a MetaSchedule trace: a list of schedule primitives that TVM
replays onto the user's kernel. Replaying can only reshape the loop nest, except for one thing:
``Annotate`` attaches a key and a value to a loop or block, and TVM's code generators read a few
keys as code. ``pragma_import_llvm`` hands its value (LLVM IR text, or an .ll/.bc path) to
LLVM's parser and links the result into the kernel; ``pragma_import_c`` does the same with C
source for C targets. A record carrying such a key would put its author's code into the
compiled kernel, which runs in the measuring workers and in the exported library. So only the
annotation keys that MetaSchedule's own search writes are accepted.
"""

from __future__ import annotations

from typing import Any

# keys MetaSchedule's CPU (and GPU) search rules and postprocessors write
SAFE_ANNOTATION_PREFIXES = ("meta_schedule.", "software_pipeline_")
SAFE_ANNOTATION_KEYS = frozenset({"pragma_auto_unroll_max_step", "pragma_unroll_explicit",
                                  "schedule_rule", "layout_free_placeholders"})


def unsafe_annotation(trace_json: Any) -> str | None:
    """The first annotation key in a trace (MetaSchedule's JSON form) that ttrank does not
    accept, or None when every key is one MetaSchedule writes.

    A malformed trace is not judged here: replaying it fails, and the record is rejected then.
    """
    try:
        insts = trace_json[0]
        for inst in insts:
            if inst[0] != "Annotate":
                continue
            key = str(inst[2][0])
            if not (key.startswith(SAFE_ANNOTATION_PREFIXES) or key in SAFE_ANNOTATION_KEYS):
                return key
    except (TypeError, IndexError, KeyError):
        return None
    return None
