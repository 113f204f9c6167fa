"""Features of a (target kernel, donor schedule) pair: pure functions, no TVM needed.

Groups (all numeric, in the fixed order of :data:`FEATURE_NAMES`):
- ``t_*``  the target workload: extents, FLOPs, conv/matmul attributes;
- ``d_*``  the donor workload, the same way;
- ``s_*``  the donor schedule's primitives, read from its trace JSON: tile factors per loop and
  level, vectorize/parallel/unroll, cache-write and compute-at placement, trace size;
- ``a_*``  the donor's tiles as adapted to the target's extents (what will actually run): tile
  factors per loop and level, parallel chunks, register and L1 tile volumes, vector fit;
- ``r_*``  relations: extent ratios, divisibility, how much tile adaptation must change, the
  padding waste of keeping the inner tiles, epilogue match, the donor's own GFLOPS and rank;
- ``c_*``  the CPU that will run the schedule (:func:`ttrank.target.cpu_description`): vector
  width, FMA/AVX-512/VNNI/AMX/SVE, vendor, cores, runtime threads, caches; and how the donor's
  tuning relates to it: the same CPU or not, its thread count, its vector loop in lanes.
  Missing facts (an older row without caches, a CPU LLVM does not know) are NaN, which
  XGBoost treats as missing.

The schema grows by appending groups: a ranker reads only its own groups' columns, so one
fitted before a group was added still works. Bump :data:`FEATURE_VERSION` whenever an existing
name, order or meaning changes: rankers refuse files written for another version.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, NamedTuple

from .kernels import Kernel

FEATURE_VERSION = 2
MAX_LOOPS = 7
MAX_LEVELS = 4  # spatial tiles have 4 levels on CPU (SSRSRS), reductions 2


def _l2(x: float) -> float:
    return math.log2(x) if x and x > 0 else 0.0


def _names() -> list[str]:
    names = []
    for side in ("t", "d"):
        names += [f"{side}_ext{j}" for j in range(MAX_LOOPS)]
        names += [f"{side}_nloops", f"{side}_nreduce", f"{side}_flops", f"{side}_kernel_h",
                  f"{side}_stride", f"{side}_groups", f"{side}_depthwise", f"{side}_cin",
                  f"{side}_cout", f"{side}_m", f"{side}_n", f"{side}_k", f"{side}_batch",
                  f"{side}_epilogue_len", f"{side}_out_elems"]
    names += [f"s_tile{j}_{lv}" for j in range(MAX_LOOPS) for lv in range(MAX_LEVELS)]
    names += ["s_inner_spatial", "s_inner_reduce", "s_outer_spatial", "s_parallel", "s_vectorize",
              "s_unroll", "s_cache_write", "s_cache_read", "s_compute_at", "s_compute_loc",
              "s_ninsts", "s_nsplits", "s_rfactor"]
    names += [f"a_tile{j}_{lv}" for j in range(MAX_LOOPS) for lv in range(MAX_LEVELS)]
    names += ["a_parallel_chunks", "a_outer2_chunks", "a_reg_spatial", "a_reg_reduce", "a_l1_spatial",
              "a_acc_bytes", "a_vec_extent", "a_vec_mult16", "a_vec_mult8", "a_inner_ones"]
    names += [f"r_ratio{j}" for j in range(MAX_LOOPS)]
    names += ["r_ratio_l1", "r_same_shape", "r_divisible_loops", "r_tiles_changed",
              "r_inner_change", "r_pad_waste", "r_parallel_fit", "r_inner_fit",
              "r_same_class", "r_epilogue_jaccard", "r_epilogue_len_diff", "r_flops_ratio",
              "r_donor_gflops", "r_donor_rank", "r_donor_rel_latency", "r_donor_pred_s"]
    names += CPU_NAMES
    return names


CPU_FACTS = ("vector_bits", "fma", "avx512", "vnni", "amx", "sve", "amd", "arm")
CPU_NAMES = [f"c_{f}" for f in CPU_FACTS] + [
    "c_cores", "c_threads", "c_l1d_kb", "c_l2_kb", "c_l3_kb", "c_same_cpu", "c_donor_threads", "c_vec_lanes"]


FEATURE_NAMES: list[str] = _names()
# groups a ranker may use or leave out (chosen by leave-one-out evaluation): the name's prefix
FEATURE_GROUPS: tuple[str, ...] = ("t", "d", "s", "a", "r", "c")


def group_columns(groups: tuple[str, ...] | list[str]) -> list[int]:
    """Indices into :data:`FEATURE_NAMES` of the features in ``groups``."""
    unknown = set(groups) - set(FEATURE_GROUPS)
    if unknown:
        raise ValueError(f"unknown feature groups {sorted(unknown)}; known: {FEATURE_GROUPS}")
    return [i for i, n in enumerate(FEATURE_NAMES) if n.split("_", 1)[0] in groups]


# --------------------------------------------------------------------------------------------
# tile adaptation: how a donor's tiling maps onto the target's extents. Transfer applies it;
# the features here describe what it will do, so both read the same function.


@functools.lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


@functools.lru_cache(maxsize=65536)
def nearest_divisor(n: int, want: int) -> int:
    """The divisor of n closest to ``want`` in ratio (ties: the smaller)."""
    want = max(1, want)
    return min(divisors(n), key=lambda d: (abs(math.log(d / want)), d))


def adapt_tiles(factors: list[int], extent: int) -> list[int]:
    """Map a perfect tiling of another extent onto ``extent``.

    Inner factors (register and vector tiles) are kept where they divide what is left, else
    replaced by the nearest divisor; the outermost factor takes the remainder.
    """
    # ranking calls this for every (kernel, donor record) pair: the same few tilings and extents
    return list(_adapt_tiles(tuple(factors), extent))


@functools.lru_cache(maxsize=65536)
def _adapt_tiles(factors: tuple[int, ...], extent: int) -> tuple[int, ...]:
    if math.prod(factors) == extent:
        return factors
    new = [1] * len(factors)
    rest = extent
    for i in range(len(factors) - 1, 0, -1):
        d = nearest_divisor(rest, factors[i])
        new[i] = d
        rest //= d
    new[0] = rest
    return tuple(new)


def workload_features(k: Kernel, side: str) -> dict[str, float]:
    ext = list(k.extents)[:MAX_LOOPS]
    f = {f"{side}_ext{j}": _l2(ext[j]) if j < len(ext) else 0.0 for j in range(MAX_LOOPS)}
    a = k.attrs or {}
    out_elems = 1
    for d in k.output_shape or []:
        out_elems *= d
    f.update({
        f"{side}_nloops": len(k.extents), f"{side}_nreduce": k.iter_kinds.count("R"),
        f"{side}_flops": _l2(k.flops), f"{side}_kernel_h": (a.get("kernel") or [0])[0],
        f"{side}_stride": (a.get("stride") or [0])[0] or 0, f"{side}_groups": _l2(a.get("groups", 0)),
        f"{side}_depthwise": float(bool(a.get("depthwise"))), f"{side}_cin": _l2(a.get("in_channels", 0)),
        f"{side}_cout": _l2(a.get("out_channels", 0)), f"{side}_m": _l2(a.get("m", 0)),
        f"{side}_n": _l2(a.get("n", 0)), f"{side}_k": _l2(a.get("k", 0)),
        f"{side}_batch": _l2(a.get("batch", 0)), f"{side}_epilogue_len": len(k.epilogue),
        f"{side}_out_elems": _l2(out_elems),
    })
    return f


def parse_trace(trace_json: Any) -> dict[str, Any]:
    """The schedule primitives of a MetaSchedule trace JSON ([insts, decisions])."""
    insts, decisions = trace_json[0], dict((int(i), d) for i, d in trace_json[1])
    blocks: dict[str, str] = {}  # block RV -> name
    loops: dict[str, tuple[str, int]] = {}  # loop RV -> (block name, index)
    tiles: dict[int, list[int]] = {}  # anchor loop index -> factors
    anchor = None
    info = {"parallel": 0, "vectorize": 0, "unroll": 0, "cache_write": 0, "cache_read": 0,
            "compute_at": 0, "compute_loc": 0, "ninsts": 0, "nsplits": 0, "rfactor": 0}
    for pos, inst in enumerate(insts):
        kind, inputs, attrs, outputs = inst[0], inst[1], inst[2], inst[3]
        if kind == "EnterPostproc":
            break
        info["ninsts"] += 1
        if kind == "GetSBlock":
            blocks[outputs[0]] = str(attrs[0]).strip('"')
        elif kind == "GetLoops" and inputs and inputs[0] in blocks:
            for j, rv in enumerate(outputs):
                loops[rv] = (blocks[inputs[0]], j)
        elif kind == "SamplePerfectTile" and inputs and inputs[0] in loops:
            bname, j = loops[inputs[0]]
            if anchor is None:
                anchor = bname
            if bname == anchor and pos in decisions:
                tiles[j] = [int(x) for x in decisions[pos]]
        elif kind == "Split":
            info["nsplits"] += 1
        elif kind == "Annotate" and len(attrs) >= 1:
            key = str(attrs[0]).strip('"')
            val = inputs[1] if len(inputs) > 1 else None
            if key == "meta_schedule.parallel":
                info["parallel"] = _num(val)
            elif key == "meta_schedule.vectorize":
                info["vectorize"] = _num(val)
            elif key == "meta_schedule.unroll_explicit" or key == "meta_schedule.unroll_implicit":
                info["unroll"] = _categorical(val, insts, decisions)
        elif kind == "CacheWrite" or kind == "ReindexCacheWrite":
            info["cache_write"] += 1
        elif kind == "CacheRead" or kind == "ReindexCacheRead":
            info["cache_read"] += 1
        elif kind in ("ComputeAt", "ReverseComputeAt"):
            info["compute_at"] += 1
        elif kind == "SampleComputeLocation" and pos in decisions:
            info["compute_loc"] = int(decisions[pos])
        elif kind == "RFactor":
            info["rfactor"] += 1
    info["anchor"] = anchor
    info["tiles"] = tiles
    return info


def _num(v) -> float:
    try:
        return float(str(v).strip('"'))
    except (TypeError, ValueError):
        return 0.0


def _categorical(rv, insts, decisions) -> float:
    """The value a SampleCategorical chose (unroll depth), found by its output RV."""
    for pos, inst in enumerate(insts):
        if inst[0] == "SampleCategorical" and inst[3] and inst[3][0] == rv and pos in decisions:
            cands = inst[2][0] if inst[2] else []
            idx = int(decisions[pos])
            try:
                return float(cands[idx])
            except (IndexError, TypeError, ValueError):
                return float(idx)
    return _num(rv)


def schedule_features(trace: dict[str, Any], kinds: str) -> dict[str, float]:
    f = {}
    tiles = trace["tiles"]
    inner_s = inner_r = outer_s = 1
    for j in range(MAX_LOOPS):
        fac = tiles.get(j, [])
        for lv in range(MAX_LEVELS):
            f[f"s_tile{j}_{lv}"] = _l2(fac[lv]) if lv < len(fac) else 0.0
        if fac:
            if j < len(kinds) and kinds[j] == "R":
                inner_r *= fac[-1]
            else:
                inner_s *= fac[-1]
                outer_s *= fac[0]
    f.update({"s_inner_spatial": _l2(inner_s), "s_inner_reduce": _l2(inner_r),
              "s_outer_spatial": _l2(outer_s), "s_parallel": _l2(trace["parallel"]),
              "s_vectorize": _l2(trace["vectorize"]), "s_unroll": _l2(trace["unroll"] + 1),
              "s_cache_write": trace["cache_write"], "s_cache_read": trace["cache_read"],
              "s_compute_at": trace["compute_at"], "s_compute_loc": trace["compute_loc"],
              "s_ninsts": trace["ninsts"], "s_nsplits": trace["nsplits"], "s_rfactor": trace["rfactor"]})
    return f


class _Loop(NamedTuple):
    """What one donor loop's tiling becomes on one target extent (:class:`PairFeaturizer`)."""

    logs: tuple[float, ...]  # log2 of the adapted factors, up to MAX_LEVELS
    reduce: bool
    new: tuple[int, ...]
    ones: int  # every inner factor 1
    divisible: int  # the donor's inner tiles divide the extent
    changed: int
    inner_change: float
    waste: float


@functools.lru_cache(maxsize=1 << 18)
def _adapted_loop(fac: tuple[int, ...], e: int, reduce: bool) -> _Loop:
    """A donor loop's tiling ``fac`` on a target extent ``e`` (:func:`adapt_tiles`), and what
    the features read of it. Ranking meets the same few hundred thousand pairs again and again."""
    new = _adapt_tiles(fac, e)
    inner = math.prod(fac[1:]) if len(fac) > 1 else 1
    changed = new != fac
    return _Loop(tuple(_l2(x) for x in new[:MAX_LEVELS]), reduce, new,
                 int(len(new) > 1 and all(x == 1 for x in new[1:])), int(e % inner == 0), int(changed),
                 sum(abs(_l2(a) - _l2(b)) for a, b in zip(new[1:], fac[1:])) if changed else 0.0,
                 # keeping the donor's inner tiles and padding the extent up to a multiple of them
                 _l2(math.ceil(e / inner) * inner / e) if e else 0.0)


class PairFeaturizer:
    """The features of one target kernel paired with donor records, on one CPU.

    Ranking pairs a kernel with tens of thousands of records: what depends on the kernel alone,
    on the kernel and one donor workload, or on the kernel and one loop's tiling is computed
    once and reused (most records share their loops' tilings). ``cpu``: see
    :func:`cpu_features`. :meth:`ttrank.donors.DonorStore.pair_rows` drives it."""

    def __init__(self, target: Kernel, cpu: dict[str, Any] | None = None) -> None:
        self.target, self.cpu = target, cpu
        self.t_row = [float(x) for x in _T_NAMES(workload_features(target, "t"))]
        kinds, ext = target.iter_kinds, list(target.extents)
        self._last_s = max((j for j in range(len(kinds)) if kinds[j] == "S"), default=None)
        spatial = math.prod(e for e, k in zip(ext, kinds) if k == "S")
        self._l2_spatial = _l2(spatial)
        self._workloads: dict[int, list[float]] = {}
        self._cpus: dict[tuple | None, list[float]] = {}

    def _workload(self, donor: Kernel) -> list[float]:
        """The ``r_`` features of the two workloads: r_ratio0.. and r_ratio_l1, r_same_shape;
        then r_same_class, r_epilogue_jaccard, r_epilogue_len_diff, r_flops_ratio."""
        got = self._workloads.get(id(donor))
        if got is None:
            t = self.target
            ratios = [(_l2(t.extents[j]) - _l2(donor.extents[j])) if j < len(t.extents) and j < len(donor.extents)
                      else 0.0 for j in range(MAX_LOOPS)]
            te, de = set(t.epilogue), set(donor.epilogue)
            got = self._workloads[id(donor)] = [
                *ratios, sum(abs(r) for r in ratios), float(list(t.extents) == list(donor.extents)),
                float(t.workload_class == donor.workload_class),
                len(te & de) / len(te | de) if te | de else 1.0, len(t.epilogue) - len(donor.epilogue),
                _l2(t.flops) - _l2(donor.flops)]
        return got

    def _cpu(self, prov: dict[str, Any] | None) -> list[float]:
        key = (prov.get("mcpu"), prov.get("threads")) if prov else None  # what cpu_features reads of it
        got = self._cpus.get(key)
        if got is None:
            f = cpu_features(self.cpu, prov, 0.0)
            got = self._cpus[key] = [f[n] for n in CPU_NAMES]
        return got

    def row(self, donor: Kernel, trace: dict[str, Any], ds_row: list[float], donor_latency_s: float,
            donor_best_s: float, rank: int, donor_prov: dict[str, Any] | None,
            tiles: tuple[tuple[int, tuple[int, ...]], ...]) -> list[float]:
        """One candidate's features in :data:`FEATURE_NAMES` order. ``trace``: the donor
        record's :func:`parse_trace`; ``ds_row``: its ``d_`` and ``s_`` features in order
        (:func:`donor_row`); ``tiles``: :func:`tile_items` of the trace."""
        n_ext = len(self.target.extents)
        a_tiles = [0.0] * (MAX_LOOPS * MAX_LEVELS)
        par = par2 = reg_s = reg_r = l1_s = 1
        vec = ones = divisible = changed = 0
        inner_change = waste = 0.0
        for j, fac in tiles:
            if j >= n_ext:
                continue
            lp = _adapted_loop(fac, self.target.extents[j], self.target.iter_kinds[j] == "R")
            if j < MAX_LOOPS:
                a_tiles[j * MAX_LEVELS:j * MAX_LEVELS + len(lp.logs)] = lp.logs
            divisible += lp.divisible
            changed += lp.changed
            inner_change += lp.inner_change
            waste += lp.waste
            new = lp.new
            if lp.reduce:
                reg_r *= new[-1]
                continue
            par *= new[0]
            par2 *= new[0] * (new[1] if len(new) > 2 else 1)
            reg_s *= new[-1]
            l1_s *= math.prod(new[2:]) if len(new) > 2 else new[-1]
            ones += lp.ones
            if j == self._last_s:
                vec = new[-1]
        vec_l2 = _l2(vec)
        a_rest = [_l2(par), _l2(par2), _l2(reg_s), _l2(reg_r), _l2(l1_s),
                  # fp32 accumulators of the register tile: past the register file they spill
                  _l2(reg_s * 4), vec_l2, float(vec > 0 and vec % 16 == 0), float(vec > 0 and vec % 8 == 0),
                  ones]
        par_fit = 0.0
        if trace["parallel"] and n_ext:
            par_fit = self._l2_spatial - _l2(trace["parallel"])
        inner_fit = 0.0
        tile_of = trace["tiles"]
        if tile_of and n_ext and self._last_s in tile_of:
            inner_fit = float(self.target.extents[self._last_s] % tile_of[self._last_s][-1] == 0)
        w = self._workload(donor)
        gflops = donor.flops / donor_latency_s / 1e9 if donor_latency_s > 0 else 0.0
        r_rest = [*w[MAX_LOOPS:MAX_LOOPS + 2], divisible, changed, inner_change, waste, par_fit, inner_fit,
                  *w[MAX_LOOPS + 2:], gflops, rank,
                  donor_latency_s / donor_best_s if donor_best_s > 0 else 1.0,
                  # the donor's throughput carried over to the target's work: a naive latency guess
                  _l2(self.target.flops / (gflops * 1e9) * 1e6) if gflops > 0 else 0.0]
        c = self._cpu(donor_prov)
        if not math.isnan(c[-1]):  # log2 of the vectorised loop in vectors of this CPU
            c = [*c[:-1], c[-1] + vec_l2]
        return [*self.t_row, *ds_row, *a_tiles, *a_rest, *w[:MAX_LOOPS], *r_rest, *c]


def tile_items(trace: dict[str, Any]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """A parsed trace's anchor tiles as (loop, factors) pairs, hashable."""
    return tuple((j, tuple(fac)) for j, fac in trace["tiles"].items())


def donor_features(donor: Kernel, trace_json: Any) -> tuple[dict[str, Any], dict[str, float]]:
    """What depends on the donor record alone: its parsed trace, and its ``d_`` and ``s_``
    features. Ranking scores one record against many kernels, so callers cache this."""
    trace = parse_trace(trace_json)
    f = workload_features(donor, "d")
    f.update(schedule_features(trace, donor.iter_kinds))
    return trace, f


def _log_kb(v) -> float:
    return _l2(float(v)) if v else math.nan


def cpu_features(cpu: dict[str, Any] | None, donor_prov: dict[str, Any] | None,
                 vec_extent: float) -> dict[str, float]:
    """The ``c_`` features: ``cpu`` is :func:`ttrank.target.cpu_description` of the measuring
    CPU (None: unknown, every one NaN), ``donor_prov`` the donor record's provenance (where it
    was tuned), ``vec_extent`` log2 of the adapted schedule's vectorised loop (``a_vec_extent``)."""
    if not cpu:
        return {n: math.nan for n in CPU_NAMES}
    f = {f"c_{k}": float(cpu[k]) if cpu.get(k) is not None else math.nan for k in CPU_FACTS}
    threads = cpu.get("threads")
    f.update({"c_cores": float(cpu["cores"]) if cpu.get("cores") else math.nan,
              "c_threads": float(threads) if threads else math.nan,
              "c_l1d_kb": _log_kb(cpu.get("l1d_kb")), "c_l2_kb": _log_kb(cpu.get("l2_kb")),
              "c_l3_kb": _log_kb(cpu.get("l3_kb"))})
    donor_prov = donor_prov or {}
    f["c_same_cpu"] = (float(donor_prov["mcpu"] == cpu.get("mcpu"))
                       if donor_prov.get("mcpu") and cpu.get("mcpu") else math.nan)
    dt = donor_prov.get("threads")
    # the donor's parallel structure was searched for this many threads, relative to ours
    f["c_donor_threads"] = _l2(dt) - _l2(threads) if dt and threads else math.nan
    lanes = (cpu.get("vector_bits") or 0) / 32  # fp32 lanes of the widest vector
    # log2 of the vectorised loop in vectors of this CPU: 0 fills one exactly
    f["c_vec_lanes"] = vec_extent - _l2(lanes) if lanes else math.nan
    return f


_T_NAMES = operator.itemgetter(*(n for n in FEATURE_NAMES if n.startswith("t_")))
_DS_NAMES = operator.itemgetter(*(n for n in FEATURE_NAMES if n.startswith(("d_", "s_"))))


def donor_row(donor_part: dict[str, float]) -> list[float]:
    """The ``d_`` and ``s_`` features of :func:`donor_features` in :data:`FEATURE_NAMES` order."""
    return [float(x) for x in _DS_NAMES(donor_part)]


def vector(f: dict[str, float]) -> list[float]:
    return [float(f.get(n, 0.0)) for n in FEATURE_NAMES]
