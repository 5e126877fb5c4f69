"""Long runs: poisoned random streams (graph == eager on every real row) and threads on one
manager, with the lock removed as the control.
"""

from __future__ import annotations

from graphcap.testing import EventLog, NoLock, expected_outputs, make_config, make_manager, run_threads, stress

from .trials import Row, Scale, Tally

SPEC = {"capture.uniform_query_len": 4, "capture.sizes": [4, 8]}


def stress_rows(scale: Scale) -> list[Row]:
    rows = []
    piecewise = {"capture.mode": "full_and_piecewise", "model.attention": "per_request", "model.num_layers": 2}
    cases = (
        ("decode (q=1)", {}, 1),
        ("speculative decode (q=4)", SPEC, 4),
        ("full_and_piecewise, per-request .item() attention", piecewise, 1),
    )
    for name, overrides, q in cases:
        manager = make_manager(make_config({"checks.poison_padding": True, **overrides}))
        manager.capture()
        tally = Tally()
        done = dict.fromkeys(("steps", "rows", "uniform", "mixed", "eager", "piecewise"), 0)
        for seed in range(scale.stress_seeds):
            manager.model.reset_kv_cache()
            with tally.trial(f"{name} seed {seed}"):
                result = stress(manager, scale.stress_steps, seed, spec_len=q)
                for field, value in zip(
                    done,
                    (
                        result.steps,
                        result.real_rows,
                        result.uniform_steps,
                        result.mixed_steps,
                        result.eager_steps,
                        result.piecewise_steps,
                    ),
                ):
                    done[field] += value
        total = scale.stress_seeds * scale.stress_steps
        detail = (
            f"{done['uniform']} uniform and {done['mixed']} mixed replays"
            + (f" ({done['piecewise']} piecewise)" if done["piecewise"] else "")
            + f", {done['eager']} eager; "
            f"{done['rows']} real rows"
        )
        what = f"poisoned random streams, {name}: {scale.stress_seeds} streams x {scale.stress_steps} steps"
        outcome = f"graph == eager on every real row: {done['steps']}/{total} steps ({detail})"
        rows.append(Row("stale data", what, total, outcome, done["steps"], tally.failures[:5]))
    return rows


def thread_rows(scale: Scale) -> list[Row]:
    manager = make_manager(make_config())
    manager.capture()
    expected = expected_outputs(manager)
    tally = Tally()
    for round_ in range(scale.thread_rounds):
        recapture = round_ % 4 == 3
        with tally.trial(f"round {round_}"):
            with EventLog(manager) as events:
                mismatches, errors = run_threads(
                    manager, expected, seed=round_, extra=manager.capture if recapture else None
                )
            if errors or mismatches or (not recapture and events.interleavings()):
                raise AssertionError(
                    f"{len(errors)} errors, {mismatches} wrong outputs, {events.interleavings()} interleavings"
                )
    rows = [
        tally.row(
            "threads",
            f"3 threads x 40 `execute` steps, {scale.thread_rounds} rounds "
            "(every 4th with a recapture in a 4th thread)",
            "no interleaving, outputs bit-exact",
        )
    ]
    control = Tally()
    lock = manager._scope.lock
    for round_ in range(scale.control_rounds):
        manager._scope.lock = NoLock()
        with control.trial(f"control {round_}"):
            with EventLog(manager) as events:
                mismatches, errors = run_threads(manager, expected, seed=100 + round_)
            if not (events.interleavings() or mismatches or errors):
                raise AssertionError("nothing detected without the lock")
        manager._scope.lock = lock
    rows.append(
        control.row(
            "threads", "control: the same rounds with the lock removed", "interleaving or wrong output detected"
        )
    )
    return rows
