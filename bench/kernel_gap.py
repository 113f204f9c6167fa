"""What closes the kernel gap to onnxruntime (issue #19, item 1): each lever, per kernel, with numbers.

The kernels, the levers and what each number means: :mod:`ttrank.kernelgap`. This driver parses
the arguments and runs the cells, lever by lever.

Resumable and budgeted: each cell tunes into ``<work>/<kernel>/<lever>`` (``--work``) with
ttrank's resumable ``tune``; the JSON and the Markdown table are rewritten after every cell, so a
killed run keeps what it finished and a rerun continues (finished cells are skipped; raising
``--max-trials`` extends them).

The real run (idle machine, nothing else on the cores; about 5 hours at 1,024 trials per
cell, 23 kernel cells and 4 network cells; ``--budget-minutes`` caps it, a rerun continues):

    python bench/kernel_gap.py --max-trials 1024 --budget-minutes 330

Results are per CPU: ``bench/results/kernel_gap_<mcpu>.json`` and ``.md`` (tuning work dirs
in ``bench/work/kernel_gap/<mcpu>``); a results file of another CPU is never extended.

A smoke run (a minute or two per cell on an idle machine; 8 to 13 minutes per cell were seen on
one core shared with other jobs):

    python bench/kernel_gap.py --kernels conv3x3 --levers depth,nchwc \\
        --max-trials 32 --out /tmp/kg/kernel_gap.json

Every CPU's results in one table, ``bench/results/kernel_gap.md`` (no measuring):

    python bench/kernel_gap.py --summary
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from ttrank.bench import results_dir
from ttrank.kernelgap import (CONV_ONLY, GAP_NETWORKS, KERNELS, LEVERS, NETWORK_LEVERS, kernel_info, load_results,
                              markdown, run_kernel_cell, run_network_cell, save, write_summary)
from ttrank.target import host_mcpu, machine_busy, make_target, provenance, use_host_threads

log = logging.getLogger("ttrank.kernel_gap")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"from {','.join(KERNELS)}")
    ap.add_argument("--levers", default=",".join(LEVERS), help=f"from {','.join(LEVERS)}")
    ap.add_argument("--networks", default=",".join(GAP_NETWORKS), help="for the gap levers")
    ap.add_argument("--max-trials", type=int, default=1024, help="trials per kernel cell")
    ap.add_argument("--gap-trials", type=int, default=64, help="trials per kernel, gap levers")
    ap.add_argument("--per-batch", type=int, default=64, help="candidates per MetaSchedule batch")
    ap.add_argument("--budget-minutes", type=float, default=None, help="stop starting work after this")
    ap.add_argument("--out", default=None, help="default: bench/results/kernel_gap_<mcpu>.json")
    ap.add_argument("--work", default=None, help="tuning work dirs (default: bench/work/kernel_gap "
                    "for an --out in bench/results, else kernel_gap_work beside --out)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-ort", action="store_true", help="skip onnxruntime's profiles")
    ap.add_argument("--summary", action="store_true",
                    help="only write kernel_gap.md, every CPU's results in one table (no measuring)")
    args = ap.parse_args(argv)
    if args.summary:
        where = Path(args.out).parent if args.out else results_dir()
        if (path := write_summary(where)) is None:
            ap.error(f"no kernel_gap_<cpu>.json in {where}")
        print(path)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    use_host_threads()
    mcpu = host_mcpu()
    out = Path(args.out or results_dir() / f"kernel_gap_{mcpu}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.work:  # the tuning databases stay out of bench/results (bench/work is ignored)
        in_results = out.parent.resolve() == results_dir().resolve()
        args.work = str(results_dir().parent / "work" / "kernel_gap" / mcpu if in_results
                        else out.parent / "kernel_gap_work")
    started = time.time()
    deadline = started + args.budget_minutes * 60 if args.budget_minutes else float("inf")
    target = make_target()
    res = load_results(out)
    measured_on = (res.get("provenance") or {}).get("mcpu")
    if measured_on not in (None, mcpu):  # its cells and onnxruntime's times are another CPU's
        ap.error(f"{out} holds results measured on {measured_on}; this is {mcpu}: another --out")
    res["provenance"] = provenance(target)
    res["command"] = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    busy = machine_busy()
    if busy:
        log.warning("%s: timings are not valid for the results table", busy)
        res.setdefault("warnings", []).append(f"{time.strftime('%Y-%m-%d %H:%M')}: {busy}")
    names = [k for k in args.kernels.split(",") if k]
    levers = [lv for lv in args.levers.split(",") if lv]
    for x in names:
        if x not in KERNELS:
            ap.error(f"unknown kernel {x!r}")
    for x in levers:
        if x not in LEVERS:
            ap.error(f"unknown lever {x!r}")
    ort_cache: dict = {}
    for name in names:  # the kernels, as the zoo has them, and onnxruntime's time for each
        info = res["kernels"].get(name)
        if info and (info.get("ort") or args.no_ort):
            continue
        info = res["kernels"][name] = kernel_info(name, target, ort_cache, with_ort=not args.no_ort)
        save(out, res)
        log.info("%s: %s", name, {k: info[k] for k in ("task", "same_kernel")} | info.get("ort", {}))
    tuning = dict(work_root=args.work, per_batch=args.per_batch, seed=args.seed, deadline=deadline)
    for lever in levers:  # lever-major: a budget that runs out leaves whole columns
        if lever in NETWORK_LEVERS:
            for net in [n for n in args.networks.split(",") if n]:
                key = f"{net}/{lever}"
                old = res["networks"].get(key)
                if old and old["complete"] and old["trials_per_kernel"] >= args.gap_trials \
                        and old.get("whole_model_ms") is not None:
                    continue
                if time.time() >= deadline:
                    log.info("budget spent before %s", key)
                    break
                log.info("network cell %s", key)
                res["networks"][key] = run_network_cell(net, lever, target, gap_trials=args.gap_trials, **tuning)
                save(out, res)
            continue
        for name in names:
            if lever in CONV_ONLY and KERNELS[name]["op"]["kind"] != "conv":
                continue
            key = f"{name}/{lever}"
            old = res["cells"].get(key)
            if old and old["complete"] and old["target_trials"] >= args.max_trials:
                continue
            if time.time() >= deadline:
                log.info("budget spent before %s", key)
                break
            log.info("kernel cell %s", key)
            res["cells"][key] = run_kernel_cell(name, lever, target, max_trials=args.max_trials, **tuning)
            save(out, res)
    res["wall_s_last_run"] = round(time.time() - started, 1)
    save(out, res)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
