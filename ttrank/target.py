"""The compilation target and the provenance of every measurement, detected from the host."""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import importlib.util
import json
import os
import platform
import re
import shutil
import sys
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import psutil

from .errors import TTRankError


@lru_cache(maxsize=1)
def host_cpu_model() -> str:
    """The CPU's marketing name (from /proc/cpuinfo), for provenance."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def host_mcpu() -> str:
    """LLVM's name for the host CPU (e.g. znver3, emeraldrapids)."""
    from tvm.target import codegen

    return str(codegen.llvm_get_system_cpu())


@lru_cache(maxsize=1)
def host_caches() -> dict[str, int]:
    """The host's data and unified cache sizes in KiB (``l1d_kb``, ``l2_kb``, ``l3_kb``), from
    sysfs; empty where the kernel does not say."""
    out: dict[str, int] = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return out
    for e in entries:
        try:
            level = int(open(f"{base}/{e}/level").read())
            kind = open(f"{base}/{e}/type").read().strip()
            size = open(f"{base}/{e}/size").read().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not size:
            continue
        kb = int(size[:-1]) * (1024 if size.endswith("M") else 1) if size[-1] in "KM" else int(size) // 1024
        out["l1d_kb" if level == 1 else f"l{level}_kb"] = kb
    return out


# LLVM CPU names of AMD's x86 cores (LLVM does not name the vendor)
_AMD_CPUS = ("znver", "bdver", "btver", "barcelona", "amdfam10", "athlon", "opteron", "k8")


# LLVM's name of an x86 feature -> the flag Linux's /proc/cpuinfo gives it: the features that
# decide which vector instructions compiled code may use
X86_FEATURE_FLAGS = {
    "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
    "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512dq": "avx512dq", "avx512vl": "avx512vl",
    "avx512cd": "avx512cd", "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16",
    "avxvnni": "avx_vnni", "amx-tile": "amx_tile", "amx-int8": "amx_int8", "amx-bf16": "amx_bf16",
}


@lru_cache(maxsize=1)
def host_flags() -> frozenset[str]:
    """The CPU flags Linux reports for this host (x86); empty where it names none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def host_mattr(mcpu: str, flags: frozenset[str] | None = None) -> list[str]:
    """LLVM feature switches that make ``mcpu`` fit this x86 host's flags (``flags``: Linux's):
    ``-f`` for a vector feature the name implies and the host lacks (a hypervisor can hide
    AVX-512 behind a real CPU model, and code using it dies of SIGILL), ``+f`` for one the host
    has and the name lacks (an LLVM older than the CPU names an older model, or "generic").
    Empty where they agree, off x86, or where Linux names no flags."""
    flags = host_flags() if flags is None else flags
    if not flags or not host_triple().startswith(("x86_64", "i386", "i686")):
        return []
    named = _llvm_features(mcpu)
    if named is None:  # a name this LLVM does not know: its features are the host's
        named = set()
    # AMX is never switched on: its tiles need the kernel's permission (arch_prctl) first
    return ([f"-{f}" for f, flag in X86_FEATURE_FLAGS.items() if f in named and flag not in flags]
            + [f"+{f}" for f, flag in X86_FEATURE_FLAGS.items()
               if f not in named and flag in flags and not f.startswith("amx")])


@lru_cache(maxsize=64)
def cpu_isa(mcpu: str, triple: str = "", mattr: tuple[str, ...] = ()) -> dict[str, float]:
    """What LLVM knows of ``mcpu``'s instruction set (with the feature switches ``mattr``): the
    widest float vector in bits, FMA, AVX-512, VNNI, AMX and SVE, and the vendor. Empty for a
    CPU this LLVM does not know."""
    return dict(_cpu_isa(mcpu, triple, tuple(mattr)))  # a copy: callers may add to it


def target_isa(target) -> dict[str, float]:
    """:func:`cpu_isa` of the CPU, triple and feature switches a TVM target names."""
    attrs = target.attrs if hasattr(target, "attrs") else {}
    return cpu_isa(str(attrs.get("mcpu", "") or ""), str(attrs.get("mtriple", "") or ""),
                   tuple(str(a) for a in (attrs.get("mattr") or ())))


def vector_class(mcpu: str, triple: str = "") -> tuple[float, float] | None:
    """(arm, widest float vector in bits) of ``mcpu``: CPUs of one class run a schedule's
    vector loops alike (an AVX-512 schedule's 16-lane loops take two instructions on AVX2).
    None for a CPU this LLVM does not know."""
    isa = _cpu_isa(mcpu, triple)
    return (isa["arm"], isa["vector_bits"]) if isa else None


def cpu_family(mcpu: str) -> str | None:
    """The family of CPUs whose measurements teach each other: architecture, vendor and widest
    float vector, as "x86-amd-256" (Zen 1-3) or "x86-intel-512". None for a CPU this LLVM does
    not know. Named from the CPU alone (a row from another host names no triple)."""
    isa = cpu_description({"mcpu": mcpu})
    if "vector_bits" not in isa:
        return None
    if isa["arm"]:
        return f"arm-{int(isa['vector_bits'])}" + ("-sve" if isa["sve"] else "")
    return f"x86-{'amd' if isa['amd'] else 'intel'}-{int(isa['vector_bits'])}"


@lru_cache(maxsize=256)
def _llvm_features(mcpu: str, triple: str = "", mattr: tuple[str, ...] = ()) -> frozenset[str] | None:
    """LLVM's features of ``mcpu`` (with ``mattr``); None for a name this LLVM does not know."""
    import tvm
    from tvm.target import codegen

    if not mcpu:
        return None
    spec = {"kind": "llvm", **({"mtriple": triple} if triple else {})}
    try:
        # LLVM logs an error for a name it does not know: ask for its list first
        if mcpu not in {str(c) for c in codegen.llvm_get_cpu_archlist(tvm.target.Target(spec))}:
            return None
        t = tvm.target.Target({**spec, "mcpu": mcpu, **({"mattr": list(mattr)} if mattr else {})})
        return frozenset(str(f) for f in codegen.llvm_get_cpu_features(t))
    except Exception:  # an unknown name, or an LLVM built without that architecture
        return None


@lru_cache(maxsize=256)
def _cpu_isa(mcpu: str, triple: str = "", mattr: tuple[str, ...] = ()) -> dict[str, float]:
    feats = _llvm_features(mcpu, triple, mattr)
    if feats is None:
        return {}
    arm = triple.startswith(("aarch64", "arm")) or "neon" in feats
    bits = 512 if "avx512f" in feats else 256 if "avx" in feats else 128 if feats & {"sse2", "neon"} else 0
    return {"vector_bits": float(bits), "fma": float("fma" in feats or arm),
            "avx512": float("avx512f" in feats), "vnni": float(bool(feats & {"avx512vnni", "avxvnni"})),
            "amx": float("amx-tile" in feats), "sve": float("sve" in feats),
            "amd": float(mcpu.startswith(_AMD_CPUS)), "arm": float(arm)}


# what cpu_description reads of a provenance: rows that agree on these describe one CPU
CPU_KEYS = ("mcpu", "cores", "threads", "caches", "device_key", "device_triple", "target")


def cpu_description(prov: dict) -> dict[str, Any]:
    """The facts about a measuring CPU that the ranker's ``c_`` features read, from a row's or
    a run's provenance: its name, ISA (:func:`cpu_isa`), cores, runtime threads and caches
    (rows written before caches were recorded have none)."""
    mcpu = prov.get("mcpu") or ""
    triple = prov.get("device_triple") or ""
    mattr: tuple[str, ...] = ()
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        target = json.loads(prov.get("target") or "{}")
        mattr = tuple(str(a) for a in target.get("mattr") or ())
        if not triple and not prov.get("device_key"):
            triple = target.get("mtriple") or ""
    # a row from another host names no triple: the CPU name tells which architecture it was
    isa = {}
    for t in dict.fromkeys([triple or host_triple(), "x86_64-linux-gnu", "aarch64-linux-gnu"]):
        if isa := cpu_isa(mcpu, t, mattr):
            break
    return {"mcpu": mcpu, **isa, "cores": prov.get("cores"), "threads": prov.get("threads"),
            **(prov.get("caches") or {})}


def host_cores() -> int:
    """Physical cores available to this process (the runtime's thread count)."""
    import psutil

    try:
        avail = len(os.sched_getaffinity(0))
    except AttributeError:
        avail = os.cpu_count() or 1
    phys = psutil.cpu_count(logical=False) or avail
    return max(1, min(avail, phys))


def use_host_threads() -> None:
    """Give the TVM runtime one thread per core, unless TVM_NUM_THREADS is already set.

    TVM's default is half the CPU count on x86, to skip hyper-threads; on a small VM whose
    vCPUs are separate cores (2 here) that leaves half the machine idle, while onnxruntime uses
    it all. Set in the environment so that measuring workers, started later, inherit it.
    """
    os.environ.setdefault("TVM_NUM_THREADS", str(host_cores()))


def runtime_threads() -> int:
    """The TVM runtime's thread count in this process and the workers it starts."""
    try:
        return max(1, int(os.environ["TVM_NUM_THREADS"]))
    except (KeyError, ValueError):
        n = os.cpu_count() or 1
        return max(1, n // 2 if platform.machine() in ("x86_64", "AMD64") else n)


def load_average() -> float | None:
    """The host's 1-minute load average (runnable processes), for provenance."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


# psutil's system-wide CPU times that count as work (idle and iowait do not; steal is apart)
BUSY_TIMES = ("user", "nice", "system", "irq", "softirq")


def _cpu_seconds() -> tuple[float, float]:
    """The machine's busy and stolen CPU seconds so far, summed over its logical CPUs."""
    c = psutil.cpu_times()
    return sum(getattr(c, k, 0.0) for k in BUSY_TIMES), getattr(c, "steal", 0.0)


def cpu_busy_now(window_s: float = 0.3) -> float | None:
    """How many cores' worth of work (anyone's, this process's too; other virtual machines'
    steal included) ran over the next ``window_s`` seconds, or None where that cannot be read."""
    try:
        (busy0, steal0), t0 = _cpu_seconds(), time.monotonic()
        time.sleep(window_s)
        (busy1, steal1), wall = _cpu_seconds(), time.monotonic() - t0
    except (psutil.Error, OSError, NotImplementedError):
        return None
    return max(0.0, busy1 - busy0 + steal1 - steal0) / wall if wall > 0 else None


@dataclass(frozen=True)
class CpuShare:
    """What this machine's CPUs did besides our own processes over a stretch of time, in cores
    (mean over the stretch): ``others`` ran other processes' work, ``steal`` went to other
    virtual machines (the hypervisor's steal time). Either skews a timing: a candidate's repeats
    and the kernel's other candidates no longer see the same machine."""

    others: float
    steal: float

    @property
    def cores(self) -> float:
        return self.others + self.steal

    def to_json(self) -> dict:
        return {"others": round(self.others, 2), "steal": round(self.steal, 2)}


class ForeignLoad:
    """Samples :class:`CpuShare` between :meth:`start` and :meth:`stop`: the machine's busy CPU
    time (psutil's system-wide times) less that of this process and its children (the runner's
    and builders' workers)."""

    # the counters tick at 10 ms: over a shorter stretch one tick of another process would read
    # as a tenth of a core or more, so such a stretch says nothing
    MIN_WINDOW_S = 0.2

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._t0 = self._busy0 = self._steal0 = self._ours0 = 0.0

    def _ours(self) -> float:
        total = 0.0
        for p in (self._me, *self._me.children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                c = p.cpu_times()  # children_*: its children that ended, no longer in the tree
                total += c.user + c.system + c.children_user + c.children_system
        return total

    def start(self) -> None:
        self._t0, (self._busy0, self._steal0), self._ours0 = time.monotonic(), _cpu_seconds(), self._ours()

    def stop(self) -> CpuShare | None:
        wall = time.monotonic() - self._t0
        if wall < self.MIN_WINDOW_S:
            return None
        busy, steal = _cpu_seconds()
        ours = self._ours() - self._ours0
        return CpuShare(max(0.0, busy - self._busy0 - ours) / wall, max(0.0, steal - self._steal0) / wall)


def machine_busy(threshold: float = 0.5) -> str | None:
    """Why measuring now would be noisy (other work holding the cores), or None. The cores'
    work of the last 0.3 s counts, not the 1-minute load average: that one still holds a
    job that ended a minute ago (each collect of a network warned of its predecessor)."""
    cores = host_cores()
    busy = cpu_busy_now()
    if busy is None:  # no CPU times to read: the load average is all there is
        load = load_average()
        if load is not None and load > threshold * cores:
            return f"the machine is busy (1-minute load {load:.1f} on {cores} cores)"
        return None
    if busy > threshold * cores:
        return f"the machine is busy ({busy:.1f} of {os.cpu_count() or 1} logical CPUs at work now)"
    return None


def host_target_dict() -> dict[str, Any]:
    """This host's target: its CPU as LLVM names it, with the feature switches that make the
    name fit what the CPU reports (:func:`host_mattr`), and its cores."""
    mcpu = host_mcpu()
    mattr = host_mattr(mcpu)
    return {"kind": "llvm", "mcpu": mcpu, **({"mattr": mattr} if mattr else {}), "num-cores": host_cores()}


def parse_target(spec: str | dict | None) -> dict[str, Any]:
    """A target dict from None (the host), a dict, a JSON string, or a path to a JSON file."""
    if spec is None or spec == "" or spec == "host":
        return host_target_dict()
    if isinstance(spec, dict):
        return dict(spec)
    text = spec
    if os.path.exists(spec):
        with open(spec) as f:
            text = f.read()
    if re.fullmatch(r"[a-z_]+(\s+-[\w-]+=\S+)*\s*", text.strip()):
        return target_from_string(text)
    try:
        d = json.loads(text)
    except json.JSONDecodeError:
        raise TTRankError(
            f"--target must be a TVM target dict in JSON, e.g. "
            f"'{{\"kind\": \"llvm\", \"mcpu\": \"cortex-a72\", \"mtriple\": \"aarch64-linux-gnu\"}}', "
            f"got {spec!r}") from None
    if not isinstance(d, dict) or "kind" not in d:
        raise TTRankError("--target JSON must be an object with at least a \"kind\" key")
    return d


def target_from_string(text: str) -> dict[str, Any]:
    """A target dict from TVM's command-line form, e.g. ``llvm -mtriple=aarch64-linux-gnu
    -mattr=+neon``: TVM 0.27's Target no longer parses that form itself."""
    kind, *opts = text.split()
    d: dict[str, Any] = {"kind": kind}
    for opt in opts:
        key, _, value = opt.lstrip("-").partition("=")
        if key in ("mattr", "libs", "keys"):
            d[key] = value.split(",")
        elif value.isdigit():
            d[key] = int(value)
        else:
            d[key] = value
    return d


def host_triple() -> str:
    from tvm.target import codegen

    return str(codegen.llvm_get_system_triple())


def is_foreign(target) -> bool:
    """Whether ``target`` is another architecture than the host's (cross-compiled, and the host
    cannot run what is built for it)."""
    triple = str(target.attrs.get("mtriple") or "") if target is not None else ""
    return bool(triple) and triple.split("-")[0] != host_triple().split("-")[0]


def cross_compiler(target):
    """The compiler that links libraries for ``target`` (None: the host's own), from
    ``TTRANK_CROSS_CC`` or ``<triple>-g++``; one clear error when it is not installed."""
    from tvm.support import cc

    if not is_foreign(target):
        return None
    triple = str(target.attrs["mtriple"])
    compiler = os.environ.get("TTRANK_CROSS_CC") or f"{triple}-g++"
    if shutil.which(compiler.split()[0]) is None:
        raise TTRankError(f"the target is {triple}, another architecture than this host's: linking for it "
                          f"needs a cross compiler, and {compiler} is not installed (set TTRANK_CROSS_CC)")
    return cc.cross_compiler(compiler)


def make_target(spec: str | dict | None = None):
    import tvm

    d = parse_target(spec)
    triple = str(d.get("mtriple") or host_triple())
    if d.get("kind") == "llvm" and "num-cores" not in d and triple.split("-")[0] == host_triple().split("-")[0]:
        # MetaSchedule refuses a CPU target without its core count ("llvm -mcpu=znver1" failed
        # as an internal error): one for this host's architecture runs here, on its cores
        d["num-cores"] = host_cores()
    try:
        return tvm.target.Target(d)
    except Exception as e:
        raise TTRankError(f"invalid target {json.dumps(d)}: {str(e).splitlines()[-1]}") from None


def target_key(target) -> str:
    """A stable string for a target, for matching records (ignores num-cores)."""
    d = json.loads(str(target)) if not isinstance(target, dict) else dict(target)
    return f"{d.get('kind')}/{d.get('mcpu', '')}/{d.get('mtriple', '')}"


def provenance(target=None) -> dict[str, Any]:
    """CPU, target, TVM version and date: attached to every measurement."""
    import tvm

    t = target if target is not None else make_target()
    return {
        "cpu": host_cpu_model(),
        "mcpu": host_mcpu(),
        "cores": host_cores(),
        "threads": runtime_threads(),
        "caches": host_caches(),
        "load_1m": load_average(),
        "target": str(t),
        "tvm": tvm.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
    }


def target_cpu(target=None) -> dict[str, Any]:
    """:func:`cpu_description` of this host running ``target`` (the CPU it names, if any)."""
    prov = provenance(target)
    mcpu = target.attrs.get("mcpu") if target is not None else None
    return cpu_description({**prov, "mcpu": str(mcpu or prov["mcpu"])})


INTRINSICS_PACKAGE = "tvm.s_tir.tensor_intrin"
# the module of tvm.s_tir.tensor_intrin that registers a CPU family's intrinsics
_ISA_INTRINSICS = {"x86_64": "x86", "i386": "x86", "i686": "x86", "amd64": "x86",
                   "aarch64": "arm_cpu", "arm64": "arm_cpu", "arm": "arm_cpu",
                   "riscv64": "riscv_cpu", "riscv32": "riscv_cpu"}


def isa_intrinsics_module(target) -> str | None:
    """The tensor-intrinsics module a CPU target's schedule rules can use (None: not a CPU
    target, or one this does not know, so every backend's are needed)."""
    if target is None or target.kind.name != "llvm":
        return None
    triple = str(target.attrs.get("mtriple", "") or "")
    arch = (triple.split("-", 1)[0] if triple else platform.machine()).lower()
    if arch.startswith("armv") or arch.startswith("thumb"):
        arch = "arm"
    return _ISA_INTRINSICS.get(arch)


@contextlib.contextmanager
def cpu_tensor_intrinsics(target) -> Iterator[None]:
    """Register only the target's own ISA's tensor intrinsics while MetaSchedule runs.

    ``TuneContext`` imports ``tvm.s_tir.tensor_intrin``, whose ``__init__`` registers every
    backend's intrinsics (CUDA, ROCm, Hexagon, Arm, x86): 30 s of TVMScript parsing on an idle
    2-core machine and minutes on a busy one, paid by every tuning process. A CPU target's
    schedule rules use only its ISA's (x86: VNNI/AVX-512/AMX dot products), so the package
    stands in as an empty shell with its real path, that one module is imported into it, and
    the shell is removed afterwards: a later full import still registers the rest.

    One thread at a time: another thread's exit would remove the shell under this one, whose
    MetaSchedule call would then import the whole package."""
    with _INTRINSICS_LOCK:
        isa = isa_intrinsics_module(target)
        if isa is None or INTRINSICS_PACKAGE in sys.modules:
            yield
            return
        real = importlib.util.find_spec(INTRINSICS_PACKAGE)
        shell = types.ModuleType(INTRINSICS_PACKAGE)
        shell.__path__ = list(real.submodule_search_locations or [])
        shell.__package__ = INTRINSICS_PACKAGE
        sys.modules[INTRINSICS_PACKAGE] = shell
        try:
            importlib.import_module(f"{INTRINSICS_PACKAGE}.{isa}")
            yield
        finally:
            if sys.modules.get(INTRINSICS_PACKAGE) is shell:
                del sys.modules[INTRINSICS_PACKAGE]


_INTRINSICS_LOCK = threading.RLock()
