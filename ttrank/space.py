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
import time

from .donors import DonorWorkload
from .kernels import Kernel
from .ranking import Candidate
from .target import cpu_tensor_intrinsics

SPACE_NETWORK = "design-space"
# draws of a kernel whose design space is small (:func:`small_space`), ordered by the second
# stage's cost model: on rocketlake the best of 12 ran 2-4.5x faster than the best transferred
# donor schedule measured for EfficientNet-B0's squeeze-excite means and GoogLeNet's max pools
# (the best draw was 7th or 12th drawn; the cost model put it in its top 3 for 3 of 4 kernels)
SMALL_SPACE_DRAWS = 12

log = logging.getLogger("ttrank")


def small_space(kernel: Kernel) -> bool:
    """Whether draws of ``kernel``'s design space find its fast region: a reduction over one
    input (a pool, a mean, a softmax's sums) reuses no data, so MetaSchedule does not tile it
    and its space is how to parallelise, vectorise and unroll it. A donor's schedule for another
    shape of it (a ResNet's 7x7 global pool on a 56x56 mean) carries little over."""
    return "R" in kernel.iter_kinds and len(kernel.input_shapes) == 1


def space_candidates(kernel: Kernel, target, n: int = 3, seed: int = 0) -> list[Candidate]:
    """Up to ``n`` distinct schedules of ``kernel`` drawn from the target's design space (fewer
    when it holds fewer: an elementwise kernel's has one). Deterministic for a ``seed``, so a
    rerun finds its earlier measurements of them."""
    from tvm.s_tir import meta_schedule as ms  # TVM loads slowly: only when a kernel needs it

    donor = DonorWorkload.of_kernel(SPACE_NETWORK, kernel)
    seen: set[str] = set()
    try:
        _draw(kernel, target, n, seed, donor, seen)
    except Exception as e:  # noqa: BLE001 - a kernel MetaSchedule cannot schedule keeps its default
        log.debug("no design space for %s: %s", kernel.name, e)
    # no ranker score: they are measured in the order drawn
    return [Candidate(kernel, donor, r, 0.0) for r in donor.records]


def _draw(kernel: Kernel, target, n: int, seed: int, donor: DonorWorkload, seen: set[str]) -> None:
    from tvm.s_tir import meta_schedule as ms

    with cpu_tensor_intrinsics(target):
        for draw in range(2 * n):  # a draw can repeat an earlier one: a few more draws
            if len(donor.records) >= n:
                break
            for sch in _space(kernel, target, seed + draw + 1):
                if len(donor.records) >= n:
                    break
                rec = donor.add(str(len(donor.records)), sch, target)
                text = json.dumps(rec.trace_json, sort_keys=True)
                if text in seen:  # a draw repeated
                    donor.records.pop()
                    continue
                seen.add(text)


def draw_seconds(kernel: Kernel, target) -> float:
    """Wall seconds of one draw of ``kernel``'s design space (one core): what each candidate of
    a search of it costs to generate, in proportion (:data:`ttrank.tune.SAMPLE_DRAWS`). A conv's
    takes 0.04 s; a kernel that fuses a hundred copies and element-wise ops, seconds."""
    with cpu_tensor_intrinsics(target):
        t0 = time.time()
        _space(kernel, target, 1)
        return time.time() - t0


def _space(kernel: Kernel, target, rand_state: int) -> list:
    """One draw of ``kernel``'s design space for ``target`` (a schedule per design space), on
    one core; the caller registers the target's tensor intrinsics."""
    from tvm.s_tir import meta_schedule as ms

    return ms.TuneContext(mod=kernel.mod, target=target, space_generator="post-order-apply",
                          task_name=kernel.name, rand_state=rand_state, num_threads=1).generate_design_space()
