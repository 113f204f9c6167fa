"""The ``ttrank`` command line: a thin layer over the library API."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from . import (adapt, collect, donors, frontend, kernels, locations, pipeline, profiling, runtime, training, tune,
               util, zoo)
from .coverage import choose_layout, coverage
from .errors import BusyError, CheckError, OutputError, TTRankError
from .evaluate import KEYS, PAPER_PAIRING
from .frontend import onnx_complaint
from .layouts import LAYOUTS
from .measure import COLD_CACHE, Measurer, RunnerSpec
from .pipeline import MEASURE_SECONDS
from .ranker import Ranker
from .target import cross_compiler, machine_busy, make_target, provenance
from .util import atomic_write_json, cache_dir, on_sigint, say
from .workdir import loaded_as, open_database

log = logging.getLogger("ttrank")


def _console():
    from rich.console import Console

    con = Console(stderr=False, highlight=False)
    if not con.is_terminal:
        # piped output: wide rows beat folded cells
        con = Console(stderr=False, highlight=False, width=200)
    return con


def _setup_logging(verbose: int) -> None:
    level = logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", force=True)
    log.setLevel(logging.INFO if verbose else logging.WARNING)
    # MetaSchedule prints a task table every batch; keep it for -v
    for name in ("tvm", "tvm.s_tir.meta_schedule"):
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR)


def _add_model_args(p: argparse.ArgumentParser, auto_layout: bool = False, database_layout: bool = False) -> None:
    p.add_argument("model", help="ONNX file, or zoo:NAME for a zoo network")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME:D1,D2,...",
                   help="bind an input's dims (repeatable), e.g. input:1,3,224,224")
    p.add_argument("--target", default=None,
                   help="TVM target as a JSON dict or in TVM's command-line form, e.g. 'llvm "
                        "-mtriple=aarch64-linux-gnu -mattr=+neon' (default: this host, or with "
                        "--rpc-tracker what the devices report)")
    math = p.add_mutually_exclusive_group()
    math.add_argument("--exact-math", action="store_true",
                      help="libm's exact exp/sigmoid/erf/tanh/GELU (default: vectorised "
                           "approximations with error ~1e-6, as onnxruntime's own kernels; much "
                           "faster swish, sigmoid, GELU and softmax)")
    # the default since fast math became it; kept so that earlier commands still run
    math.add_argument("--fast-math", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", choices=list(LAYOUTS) + (["auto"] if auto_layout else []),
                   default="auto" if auto_layout else None if database_layout else "nchw",
                   help="the convolutions' activation layout: nchw (as exported), nchwc (packed "
                        "convs blocked by the target's vector width, as onnxruntime's CPU "
                        "kernels), nchwc-dense (the dense convs packed, depthwise ones as "
                        "exported) or nhwc; the model's inputs and outputs keep theirs. Schedules "
                        "transfer only between kernels of the same layout"
                        + ("; auto (the default): nchwc when the packing reaches the model's convs "
                           "and the donor store has packed schedules for every one, nchwc-dense "
                           "when only its depthwise convs have none, else nchw"
                           if auto_layout else " (default: the one --database was tuned in, else nchw)"
                           if database_layout else " (default: nchw)"))


def load_model_arg(args, target=None, layout: str | None = None):
    """Load ``args.model``: ``path.onnx`` or ``zoo:NAME`` (built on demand and cached), with
    the command's input shapes, math and layout (``layout`` if given; blocked for ``target``).

    Keeps the model in ``args``: if TVM fails on it later, and the file is not valid ONNX,
    that is the user's to fix, not a ttrank bug.
    """
    model = zoo.load(args.model, frontend.parse_input_shapes(args.input_shape),
                     fast_math=not args.exact_math, layout=layout or args.layout, target=target)
    args.loaded_model = model
    for spec in model.inputs:
        if spec.batch_defaulted:
            other = ",".join(map(str, [8, *spec.shape[1:]]))
            say(f"note: input {spec.name!r} has a dynamic batch dim: compiled for batch 1 "
                f"(--input-shape {spec.name}:{other} for another)")
    if model.simplified_because:  # the importer's own complaint went to the native log (-v)
        say(f"note: simplified the graph with onnxslim before import: {model.simplified_because}")
    return model


# --------------------------------------------------------------------------------------------
# commands


def cmd_zoo(args) -> int:
    con = _console()
    if args.zoo_cmd == "list":
        from rich.table import Table

        t = Table("name", "family", "paper", "description")
        for e in zoo.ZOO.values():
            t.add_row(e.name, e.family, "yes" if e.name in zoo.PAPER_NETWORKS else "",
                      e.description)
        con.print(t)
        return 0
    path = zoo.export(args.name, args.out, dynamic=args.dynamic)
    con.print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


def cmd_kernels(args) -> int:
    target = make_target(args.target)
    model = load_model_arg(args, target)
    ks = kernels.extract(model.mod, target, include_injective=not args.tunable)
    if args.coverage:
        return _print_coverage(model.name, ks, args)
    if args.json:
        print(json.dumps([k.to_json() for k in ks], indent=1))
        return 0
    from rich.table import Table

    t = Table(title=f"{model.name}: {len(ks)} kernels", show_lines=False)
    for col in ("name", "class", "anchor", "attrs", "extents", "GFLOPs", "weight"):
        t.add_column(col, overflow="fold")
    total = 0.0
    for k in ks:
        total += k.flops * k.weight
        t.add_row(k.name, k.workload_class, k.anchor_op, _fmt_attrs(k.attrs),
                  "x".join(map(str, k.extents)), f"{k.flops / 1e9:.4f}", str(k.weight))
    con = _console()
    con.print(t)
    con.print(f"total: {total / 1e9:.3f} GFLOPs ({total / 2e9:.3f} G multiply-adds)")
    return 0


def _print_coverage(name: str, ks: list, args) -> int:
    """Which kernels the donor store has schedules for, before anything is measured."""
    exclude = {name} if args.leave_one_out else set()
    rows = coverage(ks, donors.DonorStore.load(args.donors or None), exclude)
    uncovered = sum(r.flop_share for r in rows if not r.covered)
    if args.json:
        print(json.dumps({"model": name, "excluded_networks": sorted(exclude),
                          "uncovered_flop_share": uncovered,
                          "kernels": [r.to_json() for r in rows]}, indent=1))
        return 0
    from rich.table import Table

    t = Table(title=f"{name}: donor coverage of {len(rows)} kernels")
    for col in ("name", "class", "candidates", "donor networks", "FLOP share"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r.name, r.workload_class, str(r.candidates) if r.covered else "[b]none[/b]",
                  ", ".join(r.donor_networks[:4]) + (" ..." if len(r.donor_networks) > 4 else ""),
                  f"{100 * r.flop_share:.1f}%")
    con = _console()
    con.print(t)
    con.print(f"{sum(not r.covered for r in rows)} kernels without a candidate, "
              f"{100 * uncovered:.1f}% of the FLOPs; recommend tunes those that matter "
              f"(--tune-missing)")
    return 0


def _fmt_attrs(attrs: dict) -> str:
    keys = ("kernel", "stride", "groups", "depthwise", "layout", "m", "n", "k", "batch")
    parts = []
    for key in keys:
        if key in attrs and attrs[key] not in (None, False):
            v = attrs[key]
            parts.append(f"{key}={'x'.join(map(str, v)) if isinstance(v, list) else v}")
    return " ".join(parts)


def cmd_compile(args) -> int:
    con = _console()
    if (args.profile or args.profile_json) and args.no_check:
        raise TTRankError("--profile runs the compiled model beside onnxruntime; drop --no-check")
    target = make_target(args.target)
    # the model loaded as the database's kernels were (recommend packs a CNN's convs): in
    # another layout no workload matches, and every conv compiles untuned
    how = loaded_as(args.database) if args.database else {}
    if args.layout is None and how.get("layout"):
        con.print(f"layout: {how['layout']} (the database's kernels were tuned in it)")
    args.layout = args.layout or how.get("layout", "nchw")
    args.exact_math = args.exact_math or how.get("fast_math") is False
    model = load_model_arg(args, target)
    _check_output_space(model, Path(args.output))  # before compiling, not after
    database = None
    if args.database:
        database = open_database(args.database)
    t0 = time.time()
    if database is None:
        staged = runtime.export_staged(runtime.compile_model(model, target), args.output, target)
    else:  # the kernels compiled in parallel, one build worker per core
        staged = runtime.compile_in_parallel(model, target, database, args.output)
    tail = None  # the onnxruntime tail's temp file, staged beside the library's
    try:
        con.print(f"compiled {model.name} in {time.time() - t0:.1f} s "
                  f"({'database ' + args.database if database else 'default CPU pipeline, untuned'})")
        if not args.no_check:  # the exported library is what is checked and timed
            compiled = runtime.CompiledModel.load(staged, model)
            res = runtime.check_against_onnxruntime(compiled, model)
            con.print(f"check vs onnxruntime: max abs error {res.max_abs_error:.3g} "
                      f"(max rel {res.max_rel_error:.3g}) over {res.outputs} output(s): "
                      f"{'OK' if res.ok else 'MISMATCH'}")
            if not res.ok:
                raise CheckError(f"compiled outputs differ from onnxruntime "
                                 f"(max abs error {res.max_abs_error:.3g}); nothing written")
            if args.time:
                lat = runtime.alternate_ms(model, {"tvm": compiled}, rounds=3, min_repeat_ms=200)
                con.print(f"latency (timed in alternation, min of 3): ttrank/TVM {lat['tvm']:.2f} ms, "
                          f"onnxruntime {lat['onnxruntime']:.2f} ms")
            if args.profile or args.profile_json:
                _print_profile(con, args, model, compiled, target)
        tail = runtime.stage_tail(model, args.output)
        os.replace(staged, args.output)
        runtime.drop_stale_tail(model, args.output)
        if tail is not None:
            os.replace(tail, runtime.tail_path(args.output))
            con.print(f"the graph from its first {'/'.join(model.tail.ops)} on ({model.tail.nodes} nodes) runs "
                      f"in onnxruntime: {runtime.tail_path(args.output)}")
    finally:
        for left in (staged, tail):
            if left is not None and left.exists():
                left.unlink()
    con.print(f"wrote {args.output}")
    return 0


def _num(x: float | None, fmt: str) -> str:
    """A table cell: ``x`` formatted, or "-" where there is none."""
    return format(x, fmt) if x else "-"


def _print_profile(con, args, model, compiled, target) -> None:
    from rich.table import Table

    profiles = profiling.profile(model, compiled, kernels.model_kernels(model, target))
    rows = profiling.class_table(profiles)
    t = Table(title=f"{model.name}: in-model ms per run, by op class (mean of 20 runs, engines in alternate blocks)")
    for col in ("op class", "ttrank ms", "calls", "onnxruntime ms", "nodes", "ttrank / onnxruntime"):
        t.add_column(col, justify="left" if col == "op class" else "right")
    for r in rows:
        t.add_row(r["op_class"], f"{r['ttrank_ms']:.3f}", str(r.get("ttrank_calls", "")),
                  f"{r['onnxruntime_ms']:.3f}", str(r.get("onnxruntime_nodes", "")),
                  _num(r["ratio"], ".2f"))
    con.print(t)
    tt = profiles["ttrank"]
    top = sorted(tt.items, key=lambda i: -i["ms"])[:10]
    con.print(f"profiling cost: ttrank's run took {tt.run_ms:.2f} ms with the VM's hook on every call, "
              f"{tt.plain_run_ms:.2f} ms without: its kernels' times are upper bounds, their shares hold")
    con.print("heaviest kernels: " + "; ".join(
        f"{i['name']} ({i['op_class']}, x{i['calls']}) {i['ms']:.3f} ms" for i in top))
    convs = profiling.conv_table(profiles)
    if convs:
        t = Table(title="convs beside onnxruntime's same convs, the largest gap first (ms per run)")
        for col in ("conv (in -> out, kernel)", "ttrank ms", "calls", "GFLOP/s", "onnxruntime ms", "GFLOP/s ",
                    "ttrank / onnxruntime", "ttrank's kernels"):
            t.add_column(col, justify="left" if col.startswith(("conv", "ttrank's")) else "right")
        for r in convs[:10]:
            t.add_row(r["conv"], _num(r["ttrank_ms"], ".3f"), str(r["ttrank_calls"]), _num(r["ttrank_gflops"], ".0f"),
                      _num(r["onnxruntime_ms"], ".3f"), _num(r["onnxruntime_gflops"], ".0f"), _num(r["ratio"], ".2f"),
                      " ".join(r["kernels"]))
        con.print(t)
    if args.profile_json:
        atomic_write_json(args.profile_json, {
            "model": model.name, "classes": rows, "convs": convs, "provenance": provenance(target),
            **{k: p.to_json() for k, p in profiles.items()}})
        con.print(f"wrote {args.profile_json}")


def cmd_tune(args) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    con = _console()
    # MetaSchedule's own tuning runner settings, on the fleet's devices with --rpc-tracker
    runner = _runner_spec(args, cache_flush=False, repeat=1, number=3, min_repeat_ms=50)
    target = _make_target(args, runner)
    model = load_model_arg(args, target)
    name = args.name or (args.model[4:] if args.model.startswith("zoo:") else model.name)
    why = util.writable_dir(args.out)
    if why:
        raise OutputError(f"cannot write into {args.out}: {why}")
    # MetaSchedule appends to the database files itself: one tuning run per work_dir at a time
    with _exclusive(Path(args.out) / "tune", f"tuning into {args.out}"), \
            Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                     TextColumn("{task.completed}/{task.total} trials"), TextColumn("{task.fields[info]}"),
                     TimeElapsedColumn(), console=con, transient=False,
                     disable=args.no_progress) as bar:
        job = bar.add_task(f"tune {name}", total=1, info="extracting kernels")

        def on_progress(p: tune.TuneProgress) -> None:
            est = p.estimated_ms()
            left = ""
            if p.budget_s:
                left = f" | budget left {max(0.0, p.budget_s - (time.time() - p.started)) / 60:.1f} min"
            cur = p.tasks[p.current].name if 0 <= p.current < len(p.tasks) else ""
            bar.update(job, total=p.trials_total, completed=p.trials_done,
                       info=f"tasks {p.tasks_done}/{len(p.tasks)} | {cur} | est. "
                            f"{est:.2f} ms{left}" if est else f"tasks {p.tasks_done}/{len(p.tasks)}{left}")

        prog = tune.tune(model.mod, args.out, trials_per_task=args.trials_per_task,
                         budget_minutes=args.budget_minutes, target=target, model_name=name,
                         injective_trials=args.injective_trials, seed=args.seed,
                         on_progress=on_progress, only=args.only,
                         runner=runner if runner.kind == "rpc" else None, layout=model.layout,
                         small_trials=args.small_trials)
    complete = prog.trials_done >= prog.trials_total
    cannot = runtime.host_cannot_time(target, remote=runner.kind == "rpc") if args.measure_model else None
    if cannot:
        con.print(f"--measure-model skipped: {cannot}")
    elif complete and args.measure_model:
        lat = tune.measure_model(model, target, args.out, on_start=lambda: con.print(
            "measuring the whole model: untuned, tuned, onnxruntime ..."))
        if lat:
            con.print(f"untuned {lat['untuned']:.1f} ms, tuned {lat['tuned']:.2f} ms, "
                      f"onnxruntime {lat['onnxruntime']:.2f} ms")
    state = "complete" if complete else "partial (rerun to resume)"
    con.print(f"{name}: {prog.trials_done}/{prog.trials_total} trials, {prog.tasks_done}/"
              f"{len(prog.tasks)} kernels, search {prog.search_s:.0f} s, {state}; database in {args.out}")
    return 0


class _NativeLog:
    """The file that holds TVM's native stderr during a command (None with -v)."""

    def __init__(self, path: str | None = None, fd: int | None = None) -> None:
        self.path, self.fd, self.keep = path, fd, False

    def explain(self) -> None:
        """Point the user at the log before the error line, if TVM wrote anything there."""
        if self.fd is None or self.keep:
            return
        sys.stderr.flush()
        if os.fstat(self.fd).st_size > 0:
            self.keep = True
            say(f"TVM's native log of this run: {self.path}")


@contextlib.contextmanager
def _native_stderr_captured(enabled: bool):
    """TVM's C++ warnings write straight to fd 2; keep them in a log file unless -v.

    The log is kept (and its path printed, by :meth:`_NativeLog.explain`) only when a failure
    is one it can explain and TVM wrote something; else it is removed when the command ends.
    """
    if not enabled:
        yield _NativeLog()
        return
    logdir = cache_dir() / "logs"
    try:
        logdir.mkdir(parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(dir=logdir, prefix="native-stderr-", suffix=".log")
    except OSError:
        yield _NativeLog()
        return
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(fd, 2)
    util.USER_STDERR_FD[0] = saved
    native = _NativeLog(path, fd)
    try:
        yield native
    finally:
        # TVM objects of a failed step (a half-built module) print as they die: let them die here
        gc.collect()
        sys.stderr.flush()
        util.USER_STDERR_FD[0] = 2
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)
        if not native.keep:  # a log someone cleared meanwhile must not turn the exit into a traceback
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def cmd_donors(args) -> int:
    con = _console()
    if args.donors_cmd == "add":
        dest, rep = donors.add_work_dir(args.dir, name=args.name)
        skipped = ", ".join(f"{n} {why}" for why, n in rep.skipped.items()) or "none"
        con.print(f"added {rep.workloads} kernels, {rep.kept} records (of {rep.records} lines; "
                  f"skipped: {skipped}) as donor network {dest.name!r} in {dest}")
        return 0
    store, rows = donors.listing([Path(d) for d in args.dirs] if args.dirs else None)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.table import Table

    t = Table(title=f"donor store: {len(store.workloads)} kernels, {len(store.records())} records")
    for col in ("network", "kernels", "records", "trials", "search", "untuned ms", "tuned ms",
                "speedup", "onnxruntime ms", "layout", "threads", "cpu"):
        t.add_column(col)
    fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
    for r in rows:
        trials = f"{r['trials']}/{r['trials_target']}" if r.get("trials") is not None else "-"
        speed = (r["untuned_ms"] / r["tuned_ms"]) if r["untuned_ms"] and r["tuned_ms"] else None
        t.add_row(r["folder"], str(r["kernels"]), str(r["records"]), trials,
                  fmt(r.get("search_seconds"), "{:.0f} s"), fmt(r["untuned_ms"], "{:.1f}"),
                  fmt(r["tuned_ms"] or r.get("estimated_ms"), "{:.2f}" if r["tuned_ms"] else "~{:.2f}"),
                  fmt(speed, "{:.1f}x"), fmt(r["onnxruntime_ms"]), r["layout"], str(r.get("threads") or "-"),
                  str(r.get("cpu") or "-"))
    con.print(t)
    con.print("tuned ms with ~ is the sum of per-kernel bests while tuning is incomplete; threads: "
              "the TVM runtime's while tuning and timing (onnxruntime used every core)")
    return 0


def _runner_spec(args, **kw):
    """The runner the flags ask for; a remote one is checked at once (tracker up, a device
    there within --device-wait, one CPU under the key)."""
    if getattr(args, "rpc_tracker", None):
        if not args.device_key:
            raise TTRankError("--rpc-tracker needs --device-key KEY")
        spec = RunnerSpec.from_tracker(args.rpc_tracker, args.device_key,
                                       device_wait_s=args.device_wait, **kw)
        spec.check()
        return spec
    return RunnerSpec(**kw)


def _make_target(args, runner):
    """--target, else over RPC what the devices report (their CPU, not the host's); another
    architecture's linker is checked for now, not after the first batch."""
    target = make_target(runner.target() if args.target is None and runner.kind == "rpc" else args.target)
    if cross_compiler(target) is not None and runner.kind == "local":
        raise TTRankError(f"the target is {target.attrs['mtriple']}, which this host cannot run: "
                          "measure on such a device with --rpc-tracker HOST:PORT --device-key KEY")
    return target


def _add_rpc_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rpc-tracker", metavar="HOST:PORT",
                   help="measure on every device under --device-key at this TVM RPC tracker, at once")
    p.add_argument("--device-key", help="the devices' key at the tracker (one kind of device)")
    p.add_argument("--device-wait", type=float, default=30.0, metavar="S",
                   help="how long to wait for a device under the key to register (default 30)")


def _check_output_space(model, library: Path, *more_folders: Path) -> None:
    """The library can be written: its path names no folder, its folder (and ``more_folders``)
    take files, and they and the temp folder (where LLVM writes object files) have room for a
    library of this model: about its weights, twice, plus a margin."""
    if library.is_dir():
        raise OutputError(f"{library} is a folder; -o takes a file name, e.g. {library / 'model.so'}")
    weights = sum(t.ByteSize() for t in model.onnx_model.graph.initializer)
    need = 2 * weights + (8 << 20)
    for folder in dict.fromkeys([library.resolve().parent, *more_folders]):
        why = util.writable_dir(folder) or util.free_space_problem(folder, need)
        if why:
            raise OutputError(f"cannot write into {folder}: {why}; nothing was changed")
    why = util.free_space_problem(tempfile.gettempdir(), need)
    if why:
        raise OutputError(f"cannot compile: the temp folder {tempfile.gettempdir()} has {why} "
                          "(set TMPDIR to a folder with room)")


@contextlib.contextmanager
def _exclusive(path: str | Path, doing: str):
    """Hold ``path``'s lock for the command, or say at once who holds it."""
    try:
        with util.file_lock(path, blocking=False):
            yield
    except util.LockedError:
        raise BusyError(f"another ttrank process is {doing}; wait for it to finish") from None


def cmd_recommend(args) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    con = _console()
    # a tracker that is down says so before any work
    runner = _runner_spec(args, **({} if args.warm_cache else COLD_CACHE))
    target = _make_target(args, runner)
    ranker = Ranker.load(args.ranker)
    # schedules tuned on another CPU still transfer (every candidate is re-measured here)
    store = donors.DonorStore.load(args.donors or None, target=target if args.same_target_only else None)
    if args.layout == "auto":
        excluded = set(args.exclude_network or []) | ({zoo.name_of(args.model)} if args.leave_one_out else set())
        model, why = choose_layout(load_model_arg(args, target, "nchw"), store, target, excluded)
        args.loaded_model = model
        con.print(f"layout: {model.layout} ({why})")
    else:
        model = load_model_arg(args, target)
    output = args.output or f"{model.name}.so"
    _check_output_space(model, Path(output), Path(args.database or output).resolve().parent)
    busy = machine_busy()
    if busy and (args.rpc_tracker is None):
        con.print(f"[yellow]warning: {busy}; measured latencies will be noisy, and a parallel "
                  f"kernel is slowed most (see --threads)[/yellow]")
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=con, transient=True,
                  disable=args.no_progress) as bar:
        jobs: dict[str, int] = {}

        def on_progress(phase: str, done: int, total: int, info: str) -> None:
            if phase not in jobs:
                jobs[phase] = bar.add_task(phase, total=total, info="")
            bar.update(jobs[phase], completed=done, total=total, info=info[:50])

        res = pipeline.recommend(
            model, target=target, store=store, ranker=ranker, top_k=args.top_k, output=output,
            database_dir=args.database, runner=runner, data_dir=args.data_dir,
            exclude_networks=set(args.exclude_network or []), leave_one_out=args.leave_one_out,
            tune_missing=pipeline.TUNE_MISSING_SECONDS if args.tune_missing is None else args.tune_missing,
            refine=not args.no_refine,
            minor_share=args.minor_share, adaptive=not args.fixed_k, time_untuned=args.time_untuned,
            measure_budget_s=args.measure_seconds if args.measure_seconds < float("inf") else None,
            on_progress=on_progress, on_note=con.print)
    _print_report(con, res)
    if args.json:
        atomic_write_json(args.json, res.to_json())
        con.print(f"report: {args.json}")
    return 0


def _print_report(con, res) -> None:
    from rich.table import Table

    t = Table(title=f"{res.model}: per-kernel choices")
    for col in ("kernel", "class", "shape", "w", "donor (network/kernel)", "rank", "score",
                "untuned ms", "ttrank ms", "speedup", "note"):
        t.add_column(col, overflow="fold")
    for k in sorted(res.kernels, key=lambda k: -(k.untuned_s or 0) * k.weight):
        ch = k.chosen or {}
        sp = (k.untuned_s / ch["latency_s"]) if ch and k.untuned_s and ch.get("latency_s") else None
        note = k.why or (f"the fastest of {k.sibling_of} (same anchor op)" if k.sibling_of else "")
        if k.rejections:
            note = (note + "; " if note else "") + f"{len(k.rejections)} rejected: " + \
                "; ".join(sorted({r[1].split(':')[0] for r in k.rejections}))
        t.add_row(k.name, k.workload_class, "x".join(map(str, k.extents)), str(k.weight),
                  f"{ch['donor_network']}/{ch['donor_kernel']}" if ch else "-",
                  str(ch.get("rank", "-")) if ch else "-",
                  f"{ch['score']:.2f}" if ch and ch.get("score") is not None else "-",
                  f"{k.untuned_s * 1e3:.3f}" if k.untuned_s else "-",
                  f"{ch['latency_s'] * 1e3:.3f}" if ch else "-",
                  f"{sp:.1f}x" if sp else "-", note[:120])
    con.print(t)
    lat, s = res.model_latency_ms, res.search_seconds
    tuned = sum(1 for k in res.kernels if k.status != "untuned")
    con.print(f"kernels tuned: {tuned}/{len(res.kernels)}")
    if lat:
        src = "" if lat.get("untuned_source") == "measured" else " (sum of kernels)"
        con.print(f"model latency: untuned {lat['untuned']:.1f} ms{src}, ttrank {lat['tuned']:.2f} ms "
                  f"({lat['untuned'] / lat['tuned']:.1f}x), onnxruntime {lat['onnxruntime']:.2f} ms "
                  f"({res.provenance.get('threads')} threads each)")
    native = "".join(f"{what} {s[key]:.1f} s, " for key, what in (("tuning_missing", "tuning what none covers"),
                                                                   ("refining", "searching further"))
                     if s.get(key))
    con.print(f"search time: ranking {s['ranking']:.1f} s, measuring {s['measuring']:.1f} s, {native}"
              f"compiling {s['compiling']:.1f} s, timing against onnxruntime {s.get('timing', 0):.1f} s, "
              f"total {s['total']:.1f} s")
    if refined := [k for k in res.kernels if k.status == "refined"]:
        con.print(f"searched further natively: {len(refined)} kernels faster than their transferred "
                  "schedules, " + ", ".join(f"{k.name} {1e3 * k.tuning['before_s']:.3f} -> "
                                             f"{1e3 * k.tuning['after_s']:.3f} ms" for k in refined))
    if res.anytime:  # the whole curve is in the JSON report
        first, last = res.anytime[0], res.anytime[-1]
        con.print(f"estimated model latency: {first['estimated_ms']:.2f} ms before measuring, "
                  f"{last['estimated_ms']:.2f} ms after {last['measured']} candidates (at {last['seconds']:.0f} s)")
    left = res.provenance.get("candidates_left_unmeasured")
    if left:
        con.print(f"the measuring budget left {left} lower-ranked candidates unmeasured")
    if res.max_abs_error_vs_onnxruntime is not None:
        con.print(f"outputs match onnxruntime: max abs error {res.max_abs_error_vs_onnxruntime:.3g}")
    con.print(f"database: {res.database}" + (f"\nlibrary: {res.library}" if res.library else ""))
    if tail := res.onnxruntime_tail:
        con.print(f"the graph from its first {'/'.join(tail['ops'])} on ({tail['nodes']} nodes) runs in "
                  f"onnxruntime after the library" + (f": {tail['file']}" if tail["file"] else ""))


def cmd_train(args) -> int:
    con = _console()
    out = Path(args.out) if args.out else None
    before = None
    if args.logs:
        try:
            before = Ranker.load(out).metadata.get("evaluation", {}).get("leave_one_network_out")
        except TTRankError:
            before = None
        training.learn_logs(args.logs, args.networks, make_target(args.target), 60 * args.budget_minutes,
                            args.max_per_kernel, on_note=con.print)
    report = training.train(out=out, n_estimators=args.trees)
    avg = report.get("leave_one_network_out")
    con.print(f"trained on {report['rows']} candidates in {report['groups']} kernel groups from "
              f"{len(report['networks'])} networks; ranker {report['config']}; saved {report['model']}")
    if avg:
        con.print("leave-one-network-out: " + ", ".join(f"{k} {avg[k]:.3f}" for k in KEYS if k in avg))
    st = report.get("stage2") or {}
    if st.get("enabled"):
        con.print(f"with the second stage (program cost model on the top {st['shortlist']}, weight "
                  f"{st['weight']}): " + ", ".join(f"{k} {st['average'][k]:.3f}" for k in KEYS
                                                    if k in st.get("average", {})))
    elif st:
        con.print(f"second stage (program cost model) left out: it gained {st.get('gain', 0):+.3f}")
    for cpu, a in ((report.get("own") or {}).get("per_cpu") or {}).items():
        if a.get("top1_pooled") is None:  # no kernel of it could be scored
            continue
        blend = " and ".join(n for n, on in (("its own ranker", a["own"]), ("its family's", a.get("family"))) if on)
        mine = f"with {blend} {a['top1']:.3f} / {a['top3']:.3f}" if blend else "the pooled ranker alone"
        con.print(f"  {cpu} ({a['rows']} rows): top-1 / top-3 pooled {a['top1_pooled']:.3f} / "
                  f"{a['top3_pooled']:.3f}, {mine}")
    if before:
        con.print("before: " + ", ".join(f"{k} {before[k]:.3f}" for k in KEYS if k in before))
    con.print(f"default top-k for recommend: {report['top_k']}")
    return 0


def cmd_adapt(args) -> int:
    con = _console()
    target = make_target(args.target)
    if (busy := machine_busy()):
        con.print(f"[yellow]warning: {busy}; tuning and measurements taken now will be noisy[/yellow]")
    rep = adapt.adapt(target, 60 * args.budget_minutes, networks=args.networks, trials=args.trials,
                      tune_share=args.tune_share, max_per_kernel=args.max_per_kernel,
                      retrain=not args.no_train, on_note=con.print, layout=args.layout, seeds=args.seeds,
                      plan_by=args.plan)
    if (vs := rep.native_vs_transferred()):
        won, n, ratio = vs
        con.print(f"native search beat the fastest transferred schedule measured here on {won} of {n} "
                  f"kernels (native / transferred, geometric mean: {ratio:.2f})")
    state = "complete" if rep.complete else "partial (rerun to continue)"
    con.print(f"adapted to {rep.mcpu} in {rep.seconds:.0f} s: {rep.tuned_kernels}/{rep.planned} kernels "
              f"tuned natively ({rep.tuned_trials} trials, {rep.tune_seconds:.0f} s), {rep.collected} "
              f"candidates measured ({rep.collect_seconds:.0f} s), ranker "
              f"{rep.ranker or 'not retrained'}; {state}")
    return 0


def cmd_collect(args) -> int:
    con = _console()
    runner = _runner_spec(args, repeat=max(1, args.repeat // args.rounds), rounds=args.rounds)
    target = _make_target(args, runner)
    # every donor, whatever CPU it was tuned on, as recommend ranks them: rows of only this CPU's
    # own donors would never teach the ranker how schedules from other CPUs fare here
    store = donors.DonorStore.load(args.donors or None, target=target if args.same_target_only else None)
    measurer = Measurer(target, runner)
    busy = machine_busy()
    # these latencies become training labels: say so, the rows record the load too (a fleet's
    # devices are not this machine)
    if busy and runner.kind == "local":
        con.print(f"[yellow]warning: {busy}; measurements taken now will be noisy[/yellow]")
    out = args.out or locations.shipped_measurements(required=True)
    done = 0
    try:  # (Ctrl-C: collect_networks stops at a batch's end and raises KeyboardInterrupt)
        for net, st in collect.collect_networks(
                args.networks, store, out, target, measurer,
                budget_s=60 * args.budget_minutes if args.budget_minutes else None,
                max_per_kernel=args.max_per_kernel, records_per_donor=args.records_per_donor,
                paper_donor_of=None if args.no_paper else PAPER_PAIRING, layout=args.layout,
                on_progress=None if args.quiet else lambda s, i: con.print(
                    f"  {s.network}: kernel {i + 1}/{s.kernels}, {s.measured} measured, "
                    f"{s.valid} valid, {s.wrong} wrong, {s.rejected} rejected")):
            done += 1
            con.print(f"{net}: {st.measured} measured ({st.valid} valid, {st.wrong} wrong result, "
                      f"{st.rejected} rejected), {st.skipped_existing} already present"
                      + (", stopped by budget" if st.stopped_by_budget else ""))
        if done < len(args.networks):
            con.print("budget spent")
    finally:
        measurer.close()
    return 0


def cmd_import_measurements(args) -> int:
    out = args.out or locations.shipped_measurements(required=True)
    added = collect.import_tables(args.source, out)
    for net, n in added.items():
        print(f"{net}: {n} rows added")
    print(f"{sum(added.values())} rows from {args.source} added to {out}; `ttrank train` learns them")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ttrank", description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("-v", "--verbose", action="count", default=0, help="show TVM logs (-vv: debug)")
    p.add_argument("--threads", type=int, default=None,
                   help="TVM runtime threads for measuring and timing (default: TVM_NUM_THREADS, "
                        "else one per core); onnxruntime gets the same")
    sub = p.add_subparsers(dest="cmd", required=True)

    z = sub.add_parser("zoo", help="the model zoo")
    zs = z.add_subparsers(dest="zoo_cmd", required=True)
    zs.add_parser("list", help="list zoo networks")
    ze = zs.add_parser("export", help="write a zoo network as ONNX")
    ze.add_argument("name")
    ze.add_argument("out")
    ze.add_argument("--dynamic", action="store_true", help="mark batch/spatial/sequence dims dynamic")
    z.set_defaults(func=cmd_zoo)

    k = sub.add_parser("kernels", help="list a model's kernels")
    _add_model_args(k)
    k.add_argument("--json", action="store_true", help="machine-readable output")
    k.add_argument("--tunable", action="store_true", help="omit kernels that do no arithmetic")
    k.add_argument("--coverage", action="store_true",
                   help="per kernel, the donor schedules that can be transferred onto it")
    k.add_argument("--donors", nargs="+", help="donor work_dirs (default: datasets/donors/* and added)")
    k.add_argument("--leave-one-out", action="store_true",
                   help="with --coverage: leave out the donors of the model's own name")
    k.set_defaults(func=cmd_kernels)

    c = sub.add_parser("compile", help="compile and export a model (untuned, or with a database)")
    _add_model_args(c, database_layout=True)
    c.add_argument("-o", "--output", required=True, help="output library (.so)")
    c.add_argument("--database", help="a MetaSchedule JSONDatabase work_dir to apply")
    c.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    c.add_argument("--time", action="store_true", help="also time TVM and onnxruntime")
    c.add_argument("--profile", action="store_true",
                   help="where the time goes inside the model: ttrank's kernels and onnxruntime's "
                        "nodes, by op class (conv 3x3, depthwise 3x3, matmul, ...), and the "
                        "heaviest kernels")
    c.add_argument("--profile-json", metavar="FILE", help="also write the profile as JSON")
    c.set_defaults(func=cmd_compile)

    t = sub.add_parser("tune", help="tune a model with MetaSchedule (resumable, budgeted)")
    _add_model_args(t)
    t.add_argument("--out", required=True, help="JSONDatabase work_dir (rerun to resume)")
    t.add_argument("--trials-per-task", type=int, default=64)
    t.add_argument("--injective-trials", type=int, default=None,
                   help="trials for kernels that do no arithmetic (default: trials/8, at least 4)")
    t.add_argument("--small-trials", type=int, default=None, metavar="N",
                   help="at most N trials for a kernel under 0.1%% of the model's FLOPs (a pool, "
                        "the classifier; default: --trials-per-task)")
    t.add_argument("--budget-minutes", type=float, default=None)
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--name", help="model name recorded in the manifest")
    t.add_argument("--only", nargs="+", metavar="SUBSTR",
                   help="tune only kernels whose name contains one of these")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--measure-model", action="store_true",
                   help="when tuning completes, time the whole model untuned/tuned/onnxruntime")
    _add_rpc_args(t)
    t.set_defaults(func=cmd_tune)

    d = sub.add_parser("donors", help="the donor schedule store")
    ds = d.add_subparsers(dest="donors_cmd", required=True)
    dl = ds.add_parser("list", help="donor networks: kernels, records, latency")
    dl.add_argument("dirs", nargs="*", help="work_dirs (default: datasets/donors/* and added ones)")
    dl.add_argument("--json", action="store_true")
    da = ds.add_parser("add", help="add a MetaSchedule work_dir (anyone's logs) to your store")
    da.add_argument("dir")
    da.add_argument("--name", help="donor network name (default: the folder name)")
    d.set_defaults(func=cmd_donors)

    r = sub.add_parser("recommend", help="transfer-tune a model: rank, measure top-k, compile, check")
    _add_model_args(r, auto_layout=True)
    r.add_argument("-o", "--output", help="compiled library (default: MODEL.so)")
    r.add_argument("--top-k", type=int, default=None,
                   help="the most candidates measured per kernel (default: chosen by the ranker's "
                        "evaluation); each kernel gets those the ranker cannot tell from its top-1, "
                        "fewer when its share of the model is small")
    r.add_argument("--fixed-k", action="store_true",
                   help="measure --top-k candidates for every kernel over --minor-share, whatever "
                        "the ranker's confidence")
    r.add_argument("--minor-share", type=float, default=0.002, metavar="FRACTION",
                   help="kernels under this share of the untuned model time get only their top-1 "
                        "candidate (default 0.002; 0 measures top-k everywhere)")
    r.add_argument("--measure-seconds", type=float, default=MEASURE_SECONDS, metavar="S",
                   help="stop measuring after S seconds (default 120, so that recommend stays near "
                        "3 minutes on 2 cores; 'inf' for no limit); candidates go by rank, every "
                        "kernel's first before any kernel's second, largest share of the model first")
    r.add_argument("--json", metavar="REPORT.json", help="write the report for machines")
    r.add_argument("--warm-cache", action="store_true",
                   help="time candidates with warm caches, repeated back to back, as MetaSchedule "
                        "tunes (default: each run starts with the kernel's weights and outputs "
                        "flushed from the caches, as they are inside the model)")
    r.add_argument("--time-untuned", action="store_true",
                   help="also compile and time the untuned model (a few seconds; by default its "
                        "latency is the sum of its measured kernels)")
    r.add_argument("--database", help="where to write the MetaSchedule database (default: beside -o)")
    r.add_argument("--ranker", help="ranker file (default: models/ranker.json)")
    r.add_argument("--donors", nargs="+", help="donor work_dirs (default: datasets/donors/* and added)")
    r.add_argument("--same-target-only", action="store_true",
                   help="use only donor records tuned for this exact target (default: any CPU)")
    r.add_argument("--exclude-network", action="append", help="ignore this donor network")
    r.add_argument("--leave-one-out", action="store_true",
                   help="ignore donors tuned on this same network (for evaluation)")
    r.add_argument("--tune-missing", type=float, default=None, metavar="S",
                   help="seconds (all kernels together) of native search with MetaSchedule: first for the "
                        "kernels that no transferred schedule covers (all of it when they hold half the model "
                        "time or more, a proportional part below that), then, with what is left, for the "
                        "transferred kernels that hold the most of the model's time, from their schedules; "
                        "0 turns it off (default: 120)")
    r.add_argument("--no-refine", action="store_true",
                   help="spend --tune-missing on uncovered kernels only, not on searching the heaviest "
                        "transferred ones further")
    _add_rpc_args(r)
    r.add_argument("--data-dir", help="where measurements accumulate (default: ~/.cache/ttrank/data)")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(func=cmd_recommend)

    tr = sub.add_parser("train", help="retrain the ranker (optionally on new tuning logs)")
    tr.add_argument("--logs", nargs="+", help="MetaSchedule work_dirs to ingest as donors first")
    tr.add_argument("--networks", nargs="+", default=["tiny_cnn", "tiny_resnet", "tiny_mobilenet"],
                    help="zoo networks to cross-measure the new donors on")
    tr.add_argument("--budget-minutes", type=float, default=10.0)
    tr.add_argument("--max-per-kernel", type=int, default=20)
    tr.add_argument("--trees", type=int, default=300)
    tr.add_argument("--out", help="ranker file (default: models/ranker.json)")
    tr.add_argument("--target", default=None)
    tr.set_defaults(func=cmd_train)

    ad = sub.add_parser("adapt", help="adapt to this CPU: native tuning of the common kernels, "
                                      "measurements for the ranker (bounded, resumable)")
    ad.add_argument("--budget-minutes", type=float, default=60.0)
    ad.add_argument("--networks", nargs="+", default=None,
                    help=f"zoo networks whose kernels to weigh (default: {' '.join(adapt.DEFAULT_NETWORKS)})")
    ad.add_argument("--trials", type=int, default=adapt.TRIALS, help="trials per natively tuned kernel")
    ad.add_argument("--tune-share", type=float, default=0.6, help="share of the budget for tuning")
    ad.add_argument("--max-per-kernel", type=int, default=6, help="candidates measured per kernel")
    ad.add_argument("--seeds", type=int, default=adapt.SEEDS,
                    help="transferred schedules measured per tuned kernel to start its search from (0: none)")
    ad.add_argument("--plan", choices=adapt.PLANS, default="kernels",
                    help="which kernels get the tuning time first: the most share per tuning second "
                         "(kernels), or one of each transfer family (same op, window, stride and "
                         "output size) before any family's second (families, for deep --trials)")
    ad.add_argument("--no-train", action="store_true", help="do not retrain the ranker")
    ad.add_argument("--layout", choices=list(LAYOUTS), default="nchwc",
                    help="tune and measure the networks with their convs in this layout (nchwc, the "
                         "default: what `recommend --layout auto` packs a CNN into; nchw: for "
                         "`recommend --layout nchw`)")
    ad.add_argument("--target", default=None)
    ad.set_defaults(func=cmd_adapt)

    co = sub.add_parser("collect", help="cross-measure donor schedules on zoo networks (resumable)")
    co.add_argument("networks", nargs="+")
    co.add_argument("--out", default=None,
                    help="measurement tables (default: datasets/measurements of the data home)")
    co.add_argument("--donors", nargs="+")
    co.add_argument("--budget-minutes", type=float, default=None)
    co.add_argument("--max-per-kernel", type=int, default=40)
    co.add_argument("--records-per-donor", type=int, default=2)
    co.add_argument("--repeat", type=int, default=10,
                    help="timed repeats per candidate in all, the minimum kept (default 10: these "
                         "are the ranker's labels)")
    co.add_argument("--rounds", type=int, default=5,
                    help="passes over each batch, in shuffled order, that the repeats are spread "
                         "over (default 5). On a shared machine a parallel kernel runs 2x slow for "
                         "stretches of seconds; back-to-back repeats of one candidate can all land "
                         "in one (bench/results/measure_noise.json)")
    co.add_argument("--target", default=None,
                    help="TVM target (JSON or command-line form; default: this host, or with "
                         "--rpc-tracker what the devices report)")
    co.add_argument("--same-target-only", action="store_true",
                    help="sample only donor records tuned for this exact target (default: any CPU's, "
                         "as recommend ranks them)")
    co.add_argument("--no-paper", action="store_true",
                    help="skip the paper baseline (the paired donor network's exact-class schedules)")
    co.add_argument("--layout", choices=list(LAYOUTS), default="nchw",
                    help="the networks' conv layout (nchwc: packed convs, measured with the "
                         "packed donors' schedules)")
    co.add_argument("--quiet", action="store_true")
    _add_rpc_args(co)
    co.set_defaults(func=cmd_collect)

    im = sub.add_parser("import-measurements",
                        help="add measurement tables taken on another machine (an `adapt` cache's "
                             "data/measurements, say) to the ranker's training data")
    im.add_argument("source", help="a folder of <network>.jsonl tables with their kernels/")
    im.add_argument("--out", default=None,
                    help="measurement tables (default: datasets/measurements of the data home)")
    im.set_defaults(func=cmd_import_measurements)
    _verbose_anywhere(p)
    return p


def _verbose_anywhere(parser: argparse.ArgumentParser) -> None:
    """``-v`` after the subcommand too (``ttrank recommend m.onnx -v``), as users type it: each
    subcommand takes it, and leaves the top-level count alone when it is not given."""
    for action in parser._actions:  # argparse has no public walk over its subcommands
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                sp.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                                help="show TVM logs (-vv: debug)")
                _verbose_anywhere(sp)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        # before TVM's thread pool starts here, and inherited by every measuring worker
        os.environ["TVM_NUM_THREADS"] = str(args.threads)
    interrupted = []
    util.STOP_REQUESTED.clear()  # a request belongs to one command (main may run many in a process)

    def handler(signum, frame):
        # TVM's FFI turns a KeyboardInterrupt raised inside a native call into a RuntimeError
        interrupted.append(True)
        on_sigint(signum, frame)

    old_handler = signal.signal(signal.SIGINT, handler) if _main_thread() else None
    try:
        with _native_stderr_captured(not args.verbose) as native:
            return _run(args, native, interrupted)
    finally:
        util.STOP_REQUESTED.clear()  # nor does it outlive it (a library call may follow)
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)


def _run(args, native: _NativeLog, interrupted: list[bool]) -> int:
    """Run the command; any failure ends as one line on the user's stderr, written while TVM's
    stderr is still captured (so what dies with the failure does not print after it).
    ``interrupted`` fills up when Ctrl-C arrives (TVM may turn it into another exception)."""
    try:
        rc = int(args.func(args) or 0)
        if interrupted:  # swallowed on the way (native code); the user still pressed Ctrl-C
            say("interrupted; finished work is kept, rerun to resume")
            return 130
        return rc
    except TTRankError as e:
        if e.native_log:
            native.explain()
        say(f"error: {_one_line(e)}")
        return e.exit_code
    except KeyboardInterrupt:
        say("interrupted; finished work is kept, rerun to resume")
        return 130
    except Exception as e:
        if interrupted:
            say("interrupted; finished work is kept, rerun to resume")
            return 130
        why = util.write_failure(e)
        if why:  # a full disk or a read-only folder is the user's to fix, wherever it bites
            where = getattr(e, "filename", None)
            say(f"error: cannot write{' ' + str(where) if where else ''}: {why}; finished work "
                "is kept (outputs are replaced only once complete)")
            return OutputError.exit_code
        model = getattr(args, "loaded_model", None)
        invalid = onnx_complaint(model.onnx_model) if model is not None else ""
        if invalid:  # not valid ONNX, and TVM tripped over it later: the file is the cause
            native.explain()
            say(f"error: {args.model} is not valid ONNX ({invalid}), and TVM failed on it: "
                f"{type(e).__name__}: {_last_line(e)}")
            return TTRankError.exit_code
        if args.verbose:  # a bug, not bad input: the traceback with -v
            raise
        native.explain()
        say(f"internal error: {type(e).__name__}: {_last_line(e)} (rerun with -v for the traceback)")
        return 1


def _one_line(e: BaseException) -> str:
    return " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())


def _last_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1][:400] if lines else ""


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
