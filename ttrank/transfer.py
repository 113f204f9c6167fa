"""Transfer a donor schedule onto a target kernel of the same anchor op.

Steps, per (donor record, target kernel):
1. compatibility: same anchor op and loop nest (``Kernel.compatible``);
2. the donor trace without its post-processing part (those instructions encode loop choices
   for the donor's extents; MetaSchedule's postprocessors re-derive them for the new shapes);
3. tile adaptation: ``SamplePerfectTile`` decisions whose product does not equal the target
   extent are mapped deliberately (inner tiles kept as the nearest divisors, outer recomputed),
   and every change is recorded; a conv whose activations outweigh its weights gets its outer
   row tiles first (:func:`rows_first`), so that its threads split the rows, not the channels;
4. apply: plain replay when the donor and target have the same blocks, else MetaSchedule's
   anchor-trace replay (which inlines or skips the blocks that differ); fall back between them;
5. postprocessors (parallel/vectorize/unroll rewriting, reduction decomposition, layout rewrite).

Correctness (the transferred kernel computes what the untuned kernel computes) is checked
when candidates are measured (:mod:`ttrank.measure`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from .donors import DonorRecord, DonorWorkload, materialize
from .features import adapt_tiles
from .kernels import Kernel, norm_block_name
from .target import cpu_tensor_intrinsics

log = logging.getLogger("ttrank")

VALID = "valid"
REJECTED = "rejected"
WRONG_RESULT = "wrong_result"

# instructions that change a block's loops; a GetLoops after them no longer sees the iterators
_LOOP_TRANSFORMS = {"Split", "Fuse", "Reorder", "TransformLayout", "TransformBlockLayout",
                    "ReIndex", "Blockize", "AddUnitLoop", "LoopPartition", "Merge"}


@dataclass
class TileChange:
    block: str
    loop: int
    extent: int
    donor: list[int]
    new: list[int]

    def to_json(self) -> dict:
        return self.__dict__.copy()


@dataclass
class Transferred:
    """A donor schedule applied to a target kernel (the program), or the reason it could not be.
    How the schedule was ranked is :class:`ttrank.ranking.Candidate`'s."""

    kernel: Kernel
    donor: DonorWorkload
    record: DonorRecord
    status: str = REJECTED  # valid / rejected / wrong_result
    reason: str = ""
    method: str = ""  # replay / anchor
    adapt: str = "ttrank"  # ttrank (deliberate tile adaptation) / tvm (TVM's own re-sampling)
    tile_changes: list[TileChange] = field(default_factory=list)
    thread_split: str = ""  # "rows" where :func:`rows_first` reordered its outer tiles
    mod: Any = field(default=None, repr=False)  # the scheduled target IRModule
    trace: Any = field(default=None, repr=False)  # its s_tir.Trace (replays onto kernel.mod)

    @property
    def id(self) -> str:
        return f"{self.kernel.workload_hash}<-{self.record.id}"

    @property
    def ok(self) -> bool:
        return self.status == VALID

    @property
    def seedable(self) -> bool:
        """Whether MetaSchedule's search may start from its trace (:class:`ttrank.tune.Seed`):
        a replayed donor trace is one of MetaSchedule's own design-space traces, mutated as any.
        An anchor-trace replay's trace is not: on tiny_cnn's residual conv, searches seeded with
        such traces aborted on a mutant that no longer replays (a step's loops differ), 1 in 2
        at MetaSchedule's default share of seeds, every one at ttrank's; replayed ones, 0 in 12."""
        return self.ok and self.method == "replay"

    def program_hash(self) -> str:
        """The transferred program's structural hash (``""`` when nothing applied): two donor
        schedules that transfer to the same program need one build and one measurement."""
        if self.mod is None:
            return ""
        import tvm_ffi  # TVM loads slowly: only once a program exists

        return f"{tvm_ffi.structural_hash(self.mod) & 0xFFFFFFFFFFFFFFFF:016x}"

    def summary(self) -> dict:
        return {"kernel": self.kernel.name, "donor_network": self.donor.network,
                "donor_kernel": self.donor.kernel.name, "donor_record": self.record.id,
                "status": self.status, "reason": self.reason, "method": self.method,
                "adapt": self.adapt, "tile_changes": [t.to_json() for t in self.tile_changes],
                **({"thread_split": self.thread_split} if self.thread_split else {})}


# --------------------------------------------------------------------------------------------
# tile adaptation (the arithmetic is :func:`ttrank.features.adapt_tiles`: features score it too)


def _strip_postproc(trace):
    """The trace up to EnterPostproc, with its decisions."""
    from tvm import s_tir

    insts = list(trace.insts)
    cut = next((i for i, inst in enumerate(insts) if inst.kind.name == "EnterPostproc"), len(insts))
    kept = insts[:cut]
    decisions = {inst: trace.decisions[inst] for inst in kept if inst in trace.decisions}
    return s_tir.Trace(kept, decisions)


def _tile_plan(trace, target_mod) -> list[tuple[Any, TileChange]]:
    """For each SamplePerfectTile on an untransformed loop of a block the target also has,
    the adapted decision (only where it differs)."""
    from tvm import s_tir

    sch = s_tir.Schedule(target_mod)
    insts = list(trace.insts)
    block_of: list[tuple[Any, str]] = []  # (BlockRV, name) from GetSBlock
    loop_of: list[tuple[Any, str, int, int]] = []  # (LoopRV, block name, index, GetLoops position)
    touched: dict[str, int] = {}  # block name -> first loop-transform position
    plan = []
    for pos, inst in enumerate(insts):
        kind = inst.kind.name
        if kind == "GetSBlock":
            block_of.append((inst.outputs[0], str(inst.attrs[0])))
        elif kind == "GetLoops":
            name = next((n for rv, n in block_of if rv.same_as(inst.inputs[0])), None)
            if name is not None:
                loop_of.extend((rv, name, j, pos) for j, rv in enumerate(inst.outputs))
        elif kind in _LOOP_TRANSFORMS:
            for rv in inst.inputs:
                for lrv, name, _, _ in loop_of:
                    if lrv.same_as(rv):
                        touched.setdefault(name, pos)
        elif kind == "SamplePerfectTile":
            hit = next(((n, j, p) for rv, n, j, p in loop_of if rv.same_as(inst.inputs[0])), None)
            if hit is None:
                continue
            name, j, getloops_pos = hit
            if touched.get(name, len(insts)) < getloops_pos:
                continue  # the loops were already transformed: extents unknown here
            try:
                loops = sch.get_loops(sch.get_sblock(name))
            except Exception:
                continue  # the target lacks this block
            if j >= len(loops):
                continue
            extent = int(sch.get(loops[j]).extent)
            donor = [int(x) for x in trace.decisions[inst]]
            new = adapt_tiles(donor, extent)
            if new != donor:
                plan.append((inst, TileChange(name, j, extent, donor, new)))
    return plan


# --------------------------------------------------------------------------------------------
# the threads' split of a conv's output
#
# MetaSchedule's multi-level tiling orders a conv's outer tiles as its block's axes come (batch,
# out channels, rows, columns, [channel block]), and its postprocessor parallelises the outermost
# tiles, so threads split the output channels: each then reads all of its input, half of which
# the other thread wrote in the layer before, from the other core's cache or from memory. With
# the row tiles first, a thread reads the rows it wrote. ResNet-50, packed layout, 2 threads
# (znver2): the 512 -> 128 1x1 conv at 28x28 ran 1.48 ms a call in the model against 0.70 alone;
# with every conv's rows first the model went 73.9 -> 68.8 ms, and 67.3 ms with the convs whose
# weights outweigh their activations left as they were (each thread then streams half the
# weights: the stride-2 3x3 conv of stage 4, 9.4 MB of weights, went 3.0 -> 4.7 ms rows first).
# Over the 9 CNNs, each network's choices built both ways and timed side by side: 1.047x on
# average, MobileNetV2 1.17x, MnasNet 1.14x, ResNet-50 1.09x, none slower by over 1.5%
# (bench/results/thread_split.md).

_ROW_AXES = (0, 2)  # batch and output rows, in every conv layout (NCHW, NCHWc)


def splits_rows(kernel: Kernel) -> bool:
    """Whether a kernel's threads should split its output rows: a conv (not a matmul) whose
    input and output together are no smaller than its weights."""
    if "conv" not in kernel.anchor_op or len(kernel.input_shapes) < 2 or len(kernel.iter_kinds) < 3:
        return False
    if kernel.iter_kinds[2] != "S":
        return False
    act = math.prod(kernel.input_shapes[0]) + math.prod(kernel.output_shape or [0])
    return act >= math.prod(kernel.input_shapes[1])


def rows_first(trace, iter_kinds: str):
    """``trace`` with its tiling's outer spatial tiles reordered, the row and batch tiles first
    (the relative order of the rest kept); None if it has no multi-level tiling of a block whose
    axes are ``iter_kinds`` ("S" spatial, "R" reduction, in block order)."""
    from tvm import s_tir

    insts = list(trace.insts)
    made: dict[Any, tuple[int, int]] = {}  # random variable -> (instruction, output position)
    for i, inst in enumerate(insts):
        for j, out in enumerate(inst.outputs):
            made[out] = (i, j)

    def axis(loop) -> tuple[int, int] | None:
        """(the GetLoops it came from, the block axis) of a tile loop, through its splits."""
        i, j = made.get(loop, (-1, -1))
        while i >= 0 and insts[i].kind.name == "Split":
            i, j = made.get(insts[i].inputs[0], (-1, -1))
        return (i, j) if i >= 0 and insts[i].kind.name == "GetLoops" else None

    for at, inst in enumerate(insts):
        if inst.kind.name != "Reorder":
            continue
        axes = [axis(loop) for loop in inst.inputs]
        if any(a is None for a in axes) or len({a[0] for a in axes}) != 1 \
                or len(insts[axes[0][0]].outputs) != len(iter_kinds):
            continue
        # the spatial tiles before the first reduction tile: the two outer levels of SSRSRS
        head = next((p for p, a in enumerate(axes) if iter_kinds[a[1]] != "S"), len(axes))
        order = [p for p in range(head) if axes[p][1] in _ROW_AXES] + \
                [p for p in range(head) if axes[p][1] not in _ROW_AXES] + list(range(head, len(axes)))
        if order == list(range(len(axes))):
            return trace
        moved = s_tir.schedule.Instruction(inst.kind, [inst.inputs[p] for p in order], inst.attrs, inst.outputs)
        kept = [moved if i == at else x for i, x in enumerate(insts)]
        return s_tir.Trace(kept, {x: trace.decisions[x] for x in kept if x in trace.decisions})
    return None


# --------------------------------------------------------------------------------------------
# apply


def _block_list(mod) -> list[str]:
    from tvm import s_tir

    sch = s_tir.Schedule(mod)
    return [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]


def block_renames(donor_blocks: list[str], target_blocks: list[str]) -> dict[str, str]:
    """Donor block names the target spells differently (TE names reduction stages after their
    input variable: ``lv26_red`` in one model is ``lv375_red`` in another), matched in order
    by their normalised names."""
    free = [t for t in target_blocks if t not in donor_blocks]
    out = {}
    for d in donor_blocks:
        if d in target_blocks:
            continue
        nd = norm_block_name(d)
        hit = next((t for t in free if norm_block_name(t) == nd), None)
        if hit is not None:
            out[d] = hit
            free.remove(hit)
    return out


# the block that pads the anchor's input, per anchor op (TOPI's names)
_PAD_BLOCK = {"conv2d_nchw": "pad_temp", "conv2d_transpose_nchw": "data_pad"}


def variant_renames(donor_mod, donor_op: str, target_mod, target_op: str) -> dict[str, str]:
    """Donor block names mapped onto an op variant's: the anchor block (``conv2d_nchw`` ->
    ``compute`` of a transposed conv) and its input padding (``pad_temp`` -> ``data_pad``).
    Blocks only the variant has (the zero-dilation of a transposed conv's input, its kernel
    flip) are unknown to the trace, and anchor-trace replay inlines them."""
    from tvm import s_tir

    d_anchor = s_tir.analysis.find_anchor_sblock(donor_mod)
    t_anchor = s_tir.analysis.find_anchor_sblock(target_mod)
    if d_anchor is None or t_anchor is None:
        return {}
    out = {d_anchor.name_hint: t_anchor.name_hint}
    d_pad, t_pad = _PAD_BLOCK.get(donor_op), _PAD_BLOCK.get(target_op)
    if d_pad and t_pad and d_pad in _block_list(donor_mod) and t_pad in _block_list(target_mod):
        out[d_pad] = t_pad
    return out


def _rename_blocks(trace, renames: dict[str, str]):
    """The same trace with GetSBlock instructions looking up the target's block names."""
    from tvm import s_tir
    from tvm.s_tir.schedule import Instruction

    if not renames:
        return trace
    insts, decisions = [], {}
    for inst in trace.insts:
        new = inst
        if inst.kind.name == "GetSBlock" and str(inst.attrs[0]) in renames:
            new = Instruction(inst.kind, list(inst.inputs),
                                    [renames[str(inst.attrs[0])], *list(inst.attrs)[1:]],
                                    list(inst.outputs))
        insts.append(new)
        if inst in trace.decisions:
            decisions[new] = trace.decisions[inst]
    return s_tir.Trace(insts, decisions)


_POSTPROCS: dict[str, list] = {}


def postprocessors(target) -> list:
    """MetaSchedule's llvm postprocessors, initialised once per target."""
    from tvm.s_tir import meta_schedule as ms

    key = str(target)
    if key not in _POSTPROCS:
        with cpu_tensor_intrinsics(target):
            ctx = ms.TuneContext(target=target, num_threads="physical")
        procs = list(ms.postproc.Postproc.create("llvm"))
        for p in procs:
            p._initialize_with_tune_context(ctx)  # pylint: disable=protected-access
        _POSTPROCS[key] = procs
    return _POSTPROCS[key]


def _postprocess(sch, target) -> bool:
    # marked as MetaSchedule marks its own: a replay that drops the post-processing part (its
    # search picking this trace from a database, :class:`ttrank.tune.SeededDatabase`) then
    # post-processes afresh, instead of running the post-processors over their own output
    sch.enter_postproc()
    return all(p.apply(sch) for p in postprocessors(target))


def _apply(kernel_mod, trace, method: str, target):
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms

    sch = s_tir.Schedule(kernel_mod, debug_mask="all")
    if method == "replay":
        trace.apply_to_schedule(sch, remove_postproc=True)
    else:
        ms.trace_apply.schedule_using_anchor_trace(sch, trace, target)
    return sch


def transfer(record: DonorRecord, kernel: Kernel, donor: DonorWorkload, target,
             adapt: str = "ttrank", split_rows: bool = True) -> Transferred:
    """Apply ``record`` (a schedule of ``donor``) to ``kernel``; never raises for bad pairs.
    ``split_rows=False``: keep the donor's thread split where :func:`splits_rows` would not."""
    cand = Transferred(kernel, donor, record, adapt=adapt)
    if not kernel.compatible(donor.kernel):
        cand.reason = (f"incompatible structure: {donor.kernel.anchor_op}/{donor.kernel.iter_kinds} "
                       f"vs {kernel.anchor_op}/{kernel.iter_kinds}")
        return cand
    try:
        _, full = materialize(donor, record)
        trace = _strip_postproc(full)
    except Exception as e:
        cand.reason = f"apply error: donor trace does not load: {_short(e)}"
        return cand
    target_blocks, donor_blocks = _block_list(kernel.mod), _block_list(donor.module())
    renames = block_renames(donor_blocks, target_blocks)
    if donor.kernel.anchor_op != kernel.anchor_op:  # an op variant: its anchor and padding
        renames.update(variant_renames(donor.module(), donor.kernel.anchor_op,
                                       kernel.mod, kernel.anchor_op))
    if renames:
        try:
            trace = _rename_blocks(trace, renames)
            donor_blocks = [renames.get(b, b) for b in donor_blocks]
        except Exception as e:
            log.debug("block renaming failed for %s: %s", cand.id, e)
    if adapt == "ttrank":  # after renaming, so that the target's extents are found by name
        try:
            plan = _tile_plan(trace, kernel.mod)
        except Exception as e:
            plan = []
            log.debug("tile plan failed for %s: %s", cand.id, e)
        for inst, change in plan:
            trace = trace.with_decision(inst, [int(x) for x in change.new], remove_postproc=True)
            cand.tile_changes.append(change)
    same_blocks = set(target_blocks) == set(donor_blocks)
    methods = ["replay", "anchor"] if same_blocks else ["anchor", "replay"]
    traces = [trace]
    if split_rows and splits_rows(kernel):
        try:
            rows = rows_first(trace, kernel.iter_kinds)
        except Exception as e:
            rows = None
            log.debug("rows_first failed for %s: %s", cand.id, e)
        if rows is not None and rows is not trace:
            traces = [rows, trace]  # the donor's own order, should the reordered trace not apply
    errors = []
    for method, tr in [(m, t) for t in traces for m in methods]:
        try:
            sch = _apply(kernel.mod, tr, method, target)
            if not _postprocess(sch, target):
                if tr is trace:  # the reordered trace only ever falls back to the donor's own
                    errors.append(f"{method}: a postprocessor rejected the schedule")
                continue
            cand.mod, cand.trace, cand.method, cand.status, cand.reason = (
                sch.mod, sch.trace, method, VALID, "")
            cand.thread_split = "rows" if tr is not trace else ""
            return cand
        except Exception as e:
            if tr is trace:
                errors.append(f"{method}: {_short(e)}")
    cand.reason = "apply error: " + "; ".join(errors)
    return cand


def _short(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    msg = next((ln for ln in reversed(lines) if "Error" in ln or "Check" in ln), lines[-1] if lines else "")
    return f"{type(e).__name__}: {msg}"[:300]
