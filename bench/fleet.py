"""Does measuring scale over a fleet? `collect` on one zoo network through 1 vs 2 RPC servers.

    python bench/fleet.py [--network resnet18] [--servers 1 2] [--cores 0 1] [--max-per-kernel 8]

For each server count N, a TVM RPC tracker and N servers start on this machine under one key,
server i pinned to core ``cores[i]`` (taskset) with one runtime thread, and `ttrank collect`
measures the network's donor candidates through them into a fresh folder (so every run measures
the same candidates). Recorded per N: the measuring wall time (`measure_seconds`), the most
servers that measured at the same moment (`servers_used`), the host's build time and the part of
it the runs did not hide, and the sessions each server's log shows. From the 1-server run's
build/run split, a projection for N devices: builds run on the host ahead of the runs, so the
wall time tends to max(build, run / N) plus what is neither.

Needs an idle machine: the host's builds share the cores with the servers here, so on 2 cores
the gain is bounded by that (the JSON says so). Writes bench/results/fleet.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from ttrank import fleet
from ttrank.bench import results_dir
from ttrank.collect import collect
from ttrank.donors import DonorStore
from ttrank.frontend import load
from ttrank.measure import Measurer, RunnerSpec
from ttrank.target import make_target, provenance
from ttrank.util import atomic_write_json
from ttrank.zoo import cached


def run_once(network: str, servers: int, cores: list[str], max_per_kernel: int, repeat: int,
             rounds: int) -> dict:
    """One collect of ``network`` through a local fleet of ``servers`` pinned servers."""
    target = make_target()
    model = load(str(cached(network)))
    store = DonorStore.load()
    env = {**os.environ, "TVM_NUM_THREADS": "1"}  # one core per server
    with tempfile.TemporaryDirectory(prefix="ttrank-fleet-bench-") as work, \
            fleet.local_fleet(servers, key=f"bench{servers}", cores=cores[:servers],
                              log_dir=Path(work) / "logs", env=env) as f:
        spec = RunnerSpec.from_tracker(f.address, f.tracker.key, repeat=max(1, repeat // rounds),
                                       rounds=rounds)
        m = Measurer(target, spec)
        t0 = time.time()
        try:
            stats = collect(network, model, store, Path(work) / "out", target, m,
                            max_per_kernel=max_per_kernel)
            wall = time.time() - t0
            usage = m.fleet_usage()
        finally:
            m.close()
        served = f.sessions_served()
    secs = dict(m.seconds)
    return {"servers": servers, "cores": cores[:servers], "measure_seconds": round(wall, 2),
            "servers_used": usage["servers_used"], "runs": usage["runs"], "sessions_per_server": served,
            "candidates": stats.measured, "valid": stats.valid,
            "build_seconds": round(secs["build"], 2), "build_wait_seconds": round(secs["build_wait"], 2),
            "run_seconds": round(secs["run"], 2),
            "build_share": round(secs["build"] / wall, 3) if wall else None,
            "device": spec.device}


def projection(one: dict, counts: list[int]) -> dict[str, float]:
    """Wall time for N devices from the 1-server run: builds hidden behind runs up to the point
    where the host's builds are the bottleneck."""
    build, run = one["build_seconds"], one["run_seconds"]
    other = max(0.0, one["measure_seconds"] - run - one["build_wait_seconds"])
    return {str(n): round(other + max(build, run / n), 1) for n in counts}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--network", default="resnet18")
    ap.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cores", nargs="+", default=["0", "1"], help="server i runs on cores[i]")
    ap.add_argument("--max-per-kernel", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(results_dir() / "fleet.json"))
    args = ap.parse_args()

    runs = {}
    for n in args.servers:
        print(f"{args.network}: collect through {n} server(s) ...", flush=True)
        runs[str(n)] = r = run_once(args.network, n, args.cores, args.max_per_kernel, args.repeat,
                                    args.rounds)
        print(f"  {r['measure_seconds']:.1f} s, {r['candidates']} candidates, {r['servers_used']} "
              f"server(s) at once, host builds {r['build_seconds']:.1f} s", flush=True)
    base = runs.get("1")
    out = {
        "network": args.network, "max_per_kernel": args.max_per_kernel,
        "servers_used": {n: r["servers_used"] for n, r in runs.items()},
        "measure_seconds": {n: r["measure_seconds"] for n, r in runs.items()},
        "speedup": {n: round(base["measure_seconds"] / r["measure_seconds"], 2)
                    for n, r in runs.items()} if base else None,
        "build_share": {n: r["build_share"] for n, r in runs.items()},
        "projection_seconds": projection(base, [1, 2, 4, 8, 16, 32]) if base else None,
        "runs": runs,
        "note": ("servers and the host's builds share this machine's cores: with as many servers "
                 "as cores, builds compete with runs, so the measured gain is a lower bound; "
                 "projection_seconds assumes each device has its own CPU and the host builds ahead"),
        "provenance": provenance(),
    }
    atomic_write_json(args.out, out)
    print(json.dumps({k: out[k] for k in ("measure_seconds", "servers_used", "speedup",
                                          "projection_seconds")}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
