"""Design-space candidates: schedules for a kernel that no donor covers, sampled from
MetaSchedule's own design space for the target (its post-order-apply rules: what a tuning run
starts from, before any search).

They enter the pipeline as donor records of the kernel itself (network ``design-space``), so
they are shortlisted, replayed, checked, measured and chosen like any donor's. A kernel nothing
covers (an elementwise op in a layout no donor saw, a new reduction) is then parallelised and
vectorised instead of running TVM's single-threaded default; the kernels that still hold a large
share of the model go on to ``recommend``'s own MetaSchedule search.
"""

from __future__ import annotations

import json
import logging
import math

from .donors import DonorRecord, DonorWorkload
from .kernels import Kernel
from .layouts import simd_lanes
from .ranking import Candidate
from .target import cpu_tensor_intrinsics

SPACE_NETWORK = "design-space"

log = logging.getLogger("ttrank")


def space_candidates(kernel: Kernel, target, n: int = 3, seed: int = 0, draws: bool = True) -> list[Candidate]:
    """Up to ``n`` distinct schedules of ``kernel`` drawn from the target's design space (fewer
    when it holds fewer: an elementwise kernel's has one), then, for a kernel without a
    reduction, the two of :func:`parallel_block_traces`; ``draws=False``: those two only.
    Deterministic for a ``seed``, so a rerun finds its earlier measurements of them."""
    from tvm.s_tir import meta_schedule as ms  # TVM loads slowly: only when a kernel needs it

    workload = ms.database.Workload(kernel.mod)
    donor = DonorWorkload(SPACE_NETWORK, kernel, workload.as_json(), source=SPACE_NETWORK, _mod=kernel.mod)
    seen: set[str] = set()
    if draws:
        try:
            _draw(kernel, workload, target, n, seed, donor, seen)
        except Exception as e:  # noqa: BLE001 - a kernel MetaSchedule cannot schedule keeps its default
            log.debug("no design space for %s: %s", kernel.name, e)
    if "R" not in kernel.iter_kinds:
        for trace in parallel_block_traces(kernel, simd_lanes(target)):
            _add(donor, kernel, workload, trace, target, seen)
    # no ranker score: they are measured in the order drawn
    return [Candidate(kernel, donor, r, 0.0) for r in donor.records[:n]]


def parallel_block_traces(kernel: Kernel, lanes: int) -> list:
    """Schedules of a kernel without a reduction that keep every block as written (no inlining)
    and run each over all cores: its loops fused, then split into a parallel loop and a
    vector of ``lanes`` (when they divide it), or parallel alone. Both variants, as traces.

    MetaSchedule's own space inlines every producer into the last block: on YOLO's output head
    (four concats, three layout transforms and reshapes, a sigmoid) that one expression of
    nested selects ran 10.8 ms against 1.5 ms for TVM's single-threaded default, so neither
    its samples nor its search could help. Memory-bound copies want what onnxruntime does:
    each op its own parallel loop."""
    from tvm import s_tir

    out = []
    for vectorize in (True, False):
        try:
            sch = s_tir.Schedule(kernel.mod)
            func = [gv.name_hint for gv in kernel.mod.functions][0]
            for block in sch.get_child_blocks(sch.get_sblock("root", func_name=func)):
                loops = sch.get_loops(block)
                if not loops:
                    continue
                fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
                extent = int(sch.get(fused).extent)
                if vectorize and extent % lanes == 0 and extent >= 2 * lanes:
                    outer, inner = sch.split(fused, [None, lanes])
                    sch.parallel(outer)
                    sch.vectorize(inner)
                elif extent > 1:
                    sch.parallel(fused)
            out.append(sch.trace)
        except Exception as e:  # noqa: BLE001 - a block these primitives cannot take: no such candidate
            log.debug("no parallel-block schedule for %s: %s", kernel.name, e)
    return out


def _add(donor: DonorWorkload, kernel: Kernel, workload, trace, target, seen: set[str]) -> None:
    """``trace`` as the next design-space record of ``donor``, unless an earlier one is the same."""
    from tvm.s_tir import meta_schedule as ms

    # the trace as a database line holds it (a donor record's form)
    line = ms.database.TuningRecord(trace, workload).as_json()[0]
    text = json.dumps(line, sort_keys=True)
    if text in seen:
        return
    seen.add(text)
    rank = len(donor.records)
    donor.records.append(DonorRecord(
        id=f"{SPACE_NETWORK}/{kernel.workload_hash}/{rank}", network=SPACE_NETWORK,
        kernel=kernel.name, workload_key=donor.key, rank=rank, latency_s=math.nan,
        trace_json=line, target=str(target)))


def _draw(kernel: Kernel, workload, target, n: int, seed: int, donor: DonorWorkload, seen: set[str]) -> None:
    from tvm.s_tir import meta_schedule as ms

    with cpu_tensor_intrinsics(target):
        for draw in range(2 * n):  # a draw can repeat an earlier one: a few more draws
            if len(donor.records) >= n:
                break
            ctx = ms.TuneContext(mod=kernel.mod, target=target, space_generator="post-order-apply",
                                 task_name=kernel.name, rand_state=seed + draw + 1, num_threads=1)
            for sch in ctx.generate_design_space():
                if len(donor.records) >= n:
                    break
                _add(donor, kernel, workload, sch.trace, target, seen)

