"""MetaSchedule's convergence curve, the baseline of every speed claim: read from a tuning log,
re-measured side by side, and 'how long until MetaSchedule matches this latency'."""

from __future__ import annotations

import json
import shutil

from ttrank import convergence, measure
from ttrank.cli import main
from ttrank.tune import count_trials


def _write_log(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_seconds_to_match_on_a_known_log(tmp_path):
    # task a (weight 2) tuned first: 10 s -> 4 ms, 20 s -> 1 ms; then b: 30 s -> 5 ms
    rows = [{"task": "a", "workload": "wa", "latency_s": 0.004, "search_s": 10.0},
            {"task": "a", "workload": "wa", "latency_s": 0.001, "search_s": 20.0},
            {"task": "a", "event": "task_complete", "search_s": 20.0},
            {"task": "b", "workload": "wb", "latency_s": 0.005, "search_s": 50.0},
            {"task": "b", "event": "task_complete", "search_s": 50.0}]
    _write_log(tmp_path / "trials.jsonl", rows)
    curves, order = convergence.task_curves(tmp_path)
    assert curves["a"].points == [(10.0, 0.004), (20.0, 0.001)]
    assert curves["b"].points == [(30.0, 0.005)]  # b's own seconds, not the run's
    weights, untuned = {"a": 2, "b": 1}, {"a": 0.010, "b": 0.010}
    curve = convergence.model_curve(curves, order, weights, untuned)
    assert curve[-1] == (50.0, 2 * 0.001 + 0.005)
    # 2*1 ms + 10 ms = 12 ms is reached at 20 s as run; nothing faster exists
    assert convergence.seconds_to_match(curves, order, weights, untuned, 0.012) == \
        {"as_run": 20.0, "oracle": 20.0}
    # 25 ms: as run it takes a's first step (2*4+10 = 18 ms at 10 s)
    assert convergence.seconds_to_match(curves, order, weights, untuned, 0.025)["as_run"] == 10.0
    # faster than the log ever got: None, never a made-up number
    assert convergence.seconds_to_match(curves, order, weights, untuned, 0.001) == \
        {"as_run": None, "oracle": None}


def test_tuning_log_steps_remeasure(donor_dir, target):
    log = convergence.read_log(donor_dir)
    assert set(log.kernels) == set(log.weights) and log.kernels
    assert all(log.steps[n] for n in log.kernels)  # every task found a valid schedule
    for n, steps in log.steps.items():
        logged = [s.logged_s for s in steps]
        assert logged == sorted(logged, reverse=True)  # each step is a new best
    m = measure.Measurer(target)
    try:
        sbs = convergence.remeasure(log, {}, m)
    finally:
        m.close()
    assert all(sbs.untuned[n] for n in log.kernels)
    assert all(any(x is not None for x in sbs.steps[n]) for n in log.kernels)
    assert sbs.kernel_sum(log.weights) < sum(log.weights[n] * sbs.untuned[n] for n in log.kernels)


def test_tune_extends_a_finished_run(donor_dir, tmp_path):
    """Asking a finished work_dir for more trials per task continues its tasks (the longer
    MetaSchedule baseline runs grow from the donor runs); asking again does nothing more."""
    work = tmp_path / "longer"
    shutil.copytree(donor_dir, work)
    kernel = "fused_matmul_add8"
    before = count_trials(work)[kernel]["done"]
    args = ["tune", "zoo:tiny_resnet", "--out", str(work), "--trials-per-task", str(before + 2),
            "--only", kernel, "--no-progress"]
    assert main(args) == 0
    after = count_trials(work)[kernel]["done"]
    assert after == before + 2
    assert main(args) == 0
    assert count_trials(work)[kernel]["done"] == after


def test_tuning_keeps_an_applications_own_log_handlers(tmp_path):
    """An application (or pytest >= 9.2's log capture) may attach handlers to MetaSchedule's
    logger; MetaSchedule's logging set-up must neither crash on them nor drop them."""
    import logging

    from tvm.s_tir.meta_schedule.logging import get_loggers_from_work_dir

    from ttrank.tune import MS_LOGGER, metaschedule_logging

    ms_logger = logging.getLogger(MS_LOGGER)
    unnamed, named = logging.NullHandler(), logging.NullHandler()
    named.set_name("my_service")
    ms_logger.addHandler(unnamed)
    ms_logger.addHandler(named)
    try:
        for run in range(2):  # a library process tunes more than once
            with metaschedule_logging():
                get_loggers_from_work_dir(str(tmp_path / f"run{run}"), ["fused_conv2d_add"])
            assert unnamed in ms_logger.handlers and named in ms_logger.handlers
    finally:
        ms_logger.removeHandler(unnamed)
        ms_logger.removeHandler(named)
