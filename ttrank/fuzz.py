"""Mutation fuzzing of ONNX files through the real command line.

Each case is a small real export with one mutation: bytes flipped, cut, inserted or moved
(byte-level), or one protobuf field set to something odd (a dim, an attribute, an op type, an
initializer's data, an external-data location...). Each runs ``ttrank kernels FILE`` (or
``ttrank compile``) in its own process with a timeout. The user's answer must be exit 0, or
one line ``ttrank: error: ...`` (optionally after the line naming TVM's native log) with a
non-zero exit: never a traceback, a hang, a crash (a signal) or an "internal error".
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto

# what a user may see: exit 0, or these lines and nothing else on stderr
ERROR_PREFIX = "ttrank: error: "
NATIVE_LOG_PREFIX = "ttrank: TVM's native log of this run: "
NOTE_PREFIX = "ttrank: note: "
VERDICTS = ("ok", "user_error", "internal_error", "unclear", "traceback", "crash", "hang")


@dataclass
class Case:
    """One mutated file: how it was made, and its bytes."""

    id: int
    kind: str  # "bytes" or "field"
    mutation: str
    data: bytes = field(repr=False)
    command: str = "kernels"


@dataclass
class Outcome:
    """What the user saw for one case."""

    id: int
    kind: str
    mutation: str
    command: str
    verdict: str  # one of VERDICTS
    returncode: int | None
    seconds: float
    answer: str  # the last stderr line (or "" for a silent success)

    def to_json(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Byte-level mutations


def _flip_bits(b: bytearray, rng: random.Random) -> str:
    n = rng.randint(1, 8)
    for _ in range(n):
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    return f"flip {n} bit(s)"


def _set_bytes(b: bytearray, rng: random.Random) -> str:
    i, v = rng.randrange(len(b)), rng.choice([0x00, 0xFF, 0x7F, 0x80, rng.randrange(256)])
    n = rng.randint(1, 4)
    b[i:i + n] = bytes([v]) * len(b[i:i + n])
    return f"set {n} byte(s) at {i} to {v:#04x}"


def _truncate(b: bytearray, rng: random.Random) -> str:
    i = rng.randrange(1, len(b))
    del b[i:]
    return f"truncate at {i}"


def _insert(b: bytearray, rng: random.Random) -> str:
    i, n = rng.randrange(len(b)), rng.randint(1, 16)
    b[i:i] = bytes(rng.randrange(256) for _ in range(n))
    return f"insert {n} random byte(s) at {i}"


def _delete(b: bytearray, rng: random.Random) -> str:
    i = rng.randrange(len(b))
    n = rng.randint(1, 64)
    del b[i:i + n]
    return f"delete {n} byte(s) at {i}"


def _duplicate(b: bytearray, rng: random.Random) -> str:
    i = rng.randrange(len(b))
    n = rng.randint(1, 256)
    chunk = bytes(b[i:i + n])
    j = rng.randrange(len(b))
    b[j:j] = chunk
    return f"copy {len(chunk)} byte(s) from {i} to {j}"


def _varint_max(b: bytearray, rng: random.Random) -> str:
    # a length or dim varint made huge: the classic protobuf trap
    i = rng.randrange(len(b))
    b[i:i + 1] = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"
    return f"huge varint at {i}"


BYTE_MUTATORS: list[Callable[[bytearray, random.Random], str]] = [
    _flip_bits, _set_bytes, _truncate, _insert, _delete, _duplicate, _varint_max]


def mutate_bytes(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    b = bytearray(data)
    return rng.choice(BYTE_MUTATORS)(b, rng), bytes(b)


# --------------------------------------------------------------------------------------------
# Protobuf-field mutations

ODD_INTS = [0, -1, 1, 2, 3, 7, 1 << 20, 1 << 31, -(1 << 31), (1 << 63) - 1, 100000]
ODD_FLOATS = [0.0, -1.0, 1e30, -1e30, float("nan"), float("inf"), 1e-45]
OPS = ["Conv", "Relu", "Add", "MatMul", "Gemm", "Reshape", "Transpose", "Concat", "Softmax",
       "MaxPool", "Expand", "ConstantOfShape", "Gather", "Slice", "Resize", "Loop", "If",
       "NoSuchOp", ""]
DTYPES = [TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64, TensorProto.INT8,
          TensorProto.BOOL, TensorProto.STRING, TensorProto.FLOAT16, TensorProto.BFLOAT16,
          TensorProto.UNDEFINED, 999]


def _node(m: onnx.ModelProto, rng: random.Random) -> onnx.NodeProto:
    return rng.choice(m.graph.node)


def _f_input_dim(m, rng) -> str:
    dims = m.graph.input[0].type.tensor_type.shape.dim
    d = rng.randrange(len(dims))
    v = rng.choice(ODD_INTS + [1 << 40])
    dims[d].Clear()
    if rng.random() < 0.2:
        dims[d].dim_param = "N"
        return f"input dim {d} made dynamic"
    dims[d].dim_value = v
    return f"input dim {d} = {v}"


def _f_input_rank(m, rng) -> str:
    shape = m.graph.input[0].type.tensor_type.shape
    if rng.random() < 0.5 and len(shape.dim) > 1:
        del shape.dim[-1]
        return "input rank - 1"
    shape.dim.add().dim_value = rng.choice([1, 3])
    return "input rank + 1"


def _f_elem_type(m, rng) -> str:
    v = rng.choice(m.graph.input[:] + m.graph.output[:])
    t = rng.choice(DTYPES)
    v.type.tensor_type.elem_type = t
    return f"{v.name} elem_type = {t}"


def _f_output_dim(m, rng) -> str:
    dims = m.graph.output[0].type.tensor_type.shape.dim
    if not dims:
        return "output has no dims (unchanged)"
    d = rng.randrange(len(dims))
    v = rng.choice(ODD_INTS)
    dims[d].Clear()
    dims[d].dim_value = v
    return f"output dim {d} = {v}"


def _f_attr_int(m, rng) -> str:
    nodes = [n for n in m.graph.node if any(a.type in (onnx.AttributeProto.INT,
                                                         onnx.AttributeProto.INTS) for a in n.attribute)]
    if not nodes:
        return "no int attribute (unchanged)"
    n = rng.choice(nodes)
    a = rng.choice([a for a in n.attribute if a.type in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS)])
    v = rng.choice(ODD_INTS)
    if a.type == onnx.AttributeProto.INT:
        a.i = v
    elif a.ints:
        a.ints[rng.randrange(len(a.ints))] = v
    else:
        a.ints.append(v)
    return f"{n.op_type}.{a.name} <- {v}"


def _f_attr_float(m, rng) -> str:
    n = _node(m, rng)
    v = rng.choice(ODD_FLOATS)
    n.attribute.append(onnx.helper.make_attribute(rng.choice(["alpha", "epsilon", "beta"]), v))
    return f"{n.op_type} gets float attribute {v}"


def _f_attr_drop(m, rng) -> str:
    nodes = [n for n in m.graph.node if n.attribute]
    if not nodes:
        return "no attribute (unchanged)"
    n = rng.choice(nodes)
    a = n.attribute.pop(rng.randrange(len(n.attribute)))
    return f"{n.op_type}.{a.name} removed"


def _f_attr_string(m, rng) -> str:
    n = _node(m, rng)
    n.attribute.append(onnx.helper.make_attribute(
        rng.choice(["auto_pad", "mode", "direction"]), rng.choice(["SAME_UPPER", "VALID", "???", ""])))
    return f"{n.op_type} gets a string attribute"


def _f_op_type(m, rng) -> str:
    n = _node(m, rng)
    old, n.op_type = n.op_type, rng.choice(OPS)
    return f"op {old} -> {n.op_type or '(empty)'}"


def _f_domain(m, rng) -> str:
    n = _node(m, rng)
    n.domain = rng.choice(["com.microsoft", "ai.onnx.ml", "evil"])
    return f"{n.op_type} domain = {n.domain}"


def _f_node_input(m, rng) -> str:
    n = _node(m, rng)
    names = [v for x in m.graph.node for v in x.output] + [i.name for i in m.graph.initializer]
    choice = rng.choice(names + ["", "dangling"])
    if n.input and rng.random() < 0.7:
        i = rng.randrange(len(n.input))
        n.input[i] = choice
        return f"{n.op_type} input {i} -> {choice!r}"
    n.input.append(choice)
    return f"{n.op_type} gets an extra input {choice!r}"


def _f_drop_node(m, rng) -> str:
    i = rng.randrange(len(m.graph.node))
    n = m.graph.node.pop(i)
    return f"node {i} ({n.op_type}) removed"


def _f_dup_node(m, rng) -> str:
    n = _node(m, rng)
    m.graph.node.append(n)
    return f"{n.op_type} duplicated"


def _f_swap_nodes(m, rng) -> str:
    i, j = rng.randrange(len(m.graph.node)), rng.randrange(len(m.graph.node))
    a, b = onnx.NodeProto(), onnx.NodeProto()
    a.CopyFrom(m.graph.node[i])
    b.CopyFrom(m.graph.node[j])
    m.graph.node[i].CopyFrom(b)
    m.graph.node[j].CopyFrom(a)
    return f"nodes {i} and {j} swapped (order no longer topological)"


def _f_init_dims(m, rng) -> str:
    t = rng.choice(m.graph.initializer)
    if t.dims and rng.random() < 0.7:
        d = rng.randrange(len(t.dims))
        t.dims[d] = rng.choice(ODD_INTS + [1 << 40])
        return f"initializer {t.name} dim {d} = {t.dims[d]}"
    t.dims.append(rng.choice([1, 2, 1 << 20]))
    return f"initializer {t.name} rank + 1"


def _f_init_dtype(m, rng) -> str:
    t = rng.choice(m.graph.initializer)
    t.data_type = rng.choice(DTYPES)
    return f"initializer {t.name} data_type = {t.data_type}"


def _f_init_data(m, rng) -> str:
    t = rng.choice(m.graph.initializer)
    if t.raw_data:
        cut = rng.randrange(len(t.raw_data))
        t.raw_data = t.raw_data[:cut]
        return f"initializer {t.name} raw_data cut to {cut} bytes"
    t.raw_data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    return f"initializer {t.name} gets random raw_data"


def _f_external(m, rng) -> str:
    t = rng.choice(m.graph.initializer)
    loc = rng.choice(["../../../../etc/passwd", "/etc/passwd", "missing.bin", "/dev/zero",
                      "sub/../../x.bin", "."])
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", loc), ("offset", "0"), ("length", str(rng.choice([4, 1 << 40])))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return f"initializer {t.name} external data at {loc!r}"


def _f_opset(m, rng) -> str:
    v = rng.choice([1, 6, 9, 11, 99, 0, -1])
    m.opset_import[0].version = v
    return f"opset = {v}"


def _f_ir_version(m, rng) -> str:
    v = rng.choice([0, 1, 3, 99, -1])
    m.ir_version = v
    return f"ir_version = {v}"


def _f_graph_output(m, rng) -> str:
    o = m.graph.output[0]
    o.name = rng.choice(["", "nothing_makes_this", m.graph.input[0].name])
    return f"graph output renamed {o.name!r}"


def _f_no_inputs(m, rng) -> str:
    del m.graph.input[:]
    return "graph inputs removed"


def _f_subgraph(m, rng) -> str:
    # an If whose branches are empty graphs: nested GraphProto in an attribute
    n = onnx.helper.make_node("If", [m.graph.input[0].name], ["if_out"],
                              then_branch=onnx.helper.make_graph([], "t", [], []),
                              else_branch=onnx.helper.make_graph([], "e", [], []))
    m.graph.node.insert(0, n)
    return "an If node with empty branches inserted"


FIELD_MUTATORS: list[Callable[[onnx.ModelProto, random.Random], str]] = [
    _f_input_dim, _f_input_rank, _f_elem_type, _f_output_dim, _f_attr_int, _f_attr_float,
    _f_attr_drop, _f_attr_string, _f_op_type, _f_domain, _f_node_input, _f_drop_node, _f_dup_node,
    _f_swap_nodes, _f_init_dims, _f_init_dtype, _f_init_data, _f_external, _f_opset, _f_ir_version,
    _f_graph_output, _f_no_inputs, _f_subgraph]


def mutate_fields(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    m = onnx.ModelProto()
    m.ParseFromString(data)
    mutator = rng.choice(FIELD_MUTATORS)
    return mutator(m, rng), m.SerializeToString()


def cases(seed_file: bytes, n: int, seed: int = 0, compile_every: int = 0) -> list[Case]:
    """``n`` mutated files, byte-level and field mutations alternating, reproducible by seed.

    ``compile_every``: every that many-th case runs ``ttrank compile`` instead of ``kernels``
    (compiling, exporting and checking against onnxruntime: the longer path).
    """
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = "bytes" if i % 2 == 0 else "field"
        desc, data = (mutate_bytes if kind == "bytes" else mutate_fields)(seed_file, rng)
        cmd = "compile" if compile_every and i % compile_every == compile_every - 1 else "kernels"
        out.append(Case(i, kind, desc, data, cmd))
    return out


# --------------------------------------------------------------------------------------------
# Running a case


def classify(returncode: int | None, stdout: str, stderr: str, timed_out: bool) -> str:
    """The verdict on what the user saw."""
    if timed_out:
        return "hang"
    if returncode is not None and returncode < 0:
        return "crash"  # killed by a signal (SIGSEGV, SIGABRT, ...)
    if "Traceback (most recent call last)" in stdout + stderr:
        return "traceback"
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if returncode == 0:
        return "ok"
    if any(ln.startswith("ttrank: internal error") for ln in lines):
        return "internal_error"
    said = [ln for ln in lines if not ln.startswith((NATIVE_LOG_PREFIX, NOTE_PREFIX))]
    if len(said) == 1 and said[0].startswith(ERROR_PREFIX):
        return "user_error"
    return "unclear"


def run_cli(args: list[str], timeout: float, env: dict | None = None, cwd: str | Path | None = None,
            prefix: list[str] | None = None) -> tuple[int | None, str, str, bool, float]:
    """Run ``ttrank ARGS`` in a fresh process: (returncode, stdout, stderr, timed out, seconds).

    The process gets its own session, so a timeout kills it with everything it started.
    ``prefix``: a command to run it through (e.g. ``unshare`` with mounts).
    """
    t0 = time.time()
    proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", "ttrank.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace",
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err, False, time.time() - t0
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err, True, time.time() - t0


def run_case(case: Case, workdir: Path, timeout: float = 60.0, env: dict | None = None) -> Outcome:
    """Write the case's file into its own folder and run the CLI on it."""
    d = Path(workdir) / f"case{case.id:04d}"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    path.write_bytes(case.data)
    args = ["kernels", str(path)] if case.command == "kernels" else \
        ["compile", str(path), "-o", str(d / "model.so")]
    rc, out, err, hung, secs = run_cli(args, timeout, env=env)
    verdict = classify(rc, out, err, hung)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return Outcome(case.id, case.kind, case.mutation, case.command, verdict, rc, round(secs, 2),
                   (lines[-1] if lines else "")[:300])


def summarize(outcomes: list[Outcome]) -> dict:
    """Counts per verdict, in the keys the reliability report uses."""
    counts = {v: sum(1 for o in outcomes if o.verdict == v) for v in VERDICTS}
    return {"cases": len(outcomes), "byte_cases": sum(1 for o in outcomes if o.kind == "bytes"),
            "field_cases": sum(1 for o in outcomes if o.kind == "field"),
            "compile_cases": sum(1 for o in outcomes if o.command == "compile"),
            "crashes": counts["crash"], "tracebacks": counts["traceback"], "hangs": counts["hang"],
            "internal_errors": counts["internal_error"], "unclear": counts["unclear"],
            "ok": counts["ok"], "user_errors": counts["user_error"]}


def fuzz(seed_file: bytes, n: int, workdir: Path, seed: int = 0, compile_every: int = 0,
         timeout: float = 60.0, env: dict | None = None,
         on_case: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Run ``n`` cases one after another; ``on_case`` sees each outcome as it comes."""
    outcomes = []
    for case in cases(seed_file, n, seed, compile_every):
        o = run_case(case, workdir, timeout * (2 if case.command == "compile" else 1), env)
        outcomes.append(o)
        if on_case:
            on_case(o)
    return outcomes
