"""`graphcap inspect FILE`: the steps of a post-mortem, re-checked; the first step and field that break a rule."""

from __future__ import annotations

import argparse

from graphcap.cli._common import CommandFailed, UserError, add_logging

EPILOG = """example:
  graphcap inspect graphcap-postmortem.json
  graphcap inspect postmortems/graphcap-postmortem.rank1.json   # one rank's file

Re-checks every recorded step at the `full` invariant level with the KV-write rules, on numpy
alone (no torch). Exit 0 when every recorded step holds, 1 when one does not (the first step
and field are named), 2 when the file is not a post-mortem graphcap can read.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "inspect",
        help="re-check the steps of a post-mortem file and name the first that breaks an invariant",
        description="Print the steps a post-mortem recorded (written when an error left execute, capture or "
        "capture_pending), re-check each at the full invariant level with the KV-write rules, and name the "
        "first step and field that break one; where none does, print the failing phase, key and real counts.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", metavar="FILE", help="a post-mortem file (graphcap-postmortem.json)")
    add_logging(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from graphcap.postmortem.recheck import PostmortemFileError, load_postmortem, recheck

    try:
        document = load_postmortem(args.file)
        checks = recheck(document, args.file)
    except PostmortemFileError as exc:
        raise UserError(str(exc)) from None
    error = document["error"]
    rank = document.get("rank")
    where = f" on rank {rank} of {document.get('world_size')}" if rank is not None else ""
    what = f"{error.get('type')} left {error.get('call')}() in phase {error.get('phase')}{where}"
    print(f"{what}: {_first_line(error.get('message'))}")
    total = document.get("num_recorded", len(checks))
    print(f"the last {len(checks)} of {total} stagings (real steps and capture batches), oldest first; staged under "
          f"invariants {document.get('invariants')}, re-checked here at full with the KV-write rules")  # fmt: skip
    print(f"{'#':>3} {'step':>5}  {'key':<30} {'mode':<16} {'phase':<7} {'tokens':>6} {'reqs':>5}  re-check")
    for check in checks:
        s = check.step
        mode = s["mode"] + (f" ({s['reason']})" if s["reason"] else "")
        verdict = "ok" if check.violation is None else f"BROKEN {check.violation.field}"
        step = "-" if s["step"] is None else s["step"]
        print(f"{check.position:>3} {step:>5}  {s['key_text']:<30} {mode:<16} {s['phase']:<7} {s['num_tokens']:>6} "
              f"{s['num_reqs']:>5}  {verdict}")  # fmt: skip
    broken = next((c for c in checks if c.violation is not None), None)
    if broken is not None:
        s, v = broken.step, broken.violation
        assert v is not None  # `broken` was chosen for it
        step = f"step {s['step']}" if s["step"] is not None else f"the capture batch #{broken.position}"
        print(f"first broken: {step} ({s['key_text']}, {s['phase']}): {v}")
        rows = broken.rows.get(v.field)
        if rows is not None and rows.size <= 64:
            print(f"  its staged {v.field}: {rows.tolist()}")
        raise CommandFailed(f"{step} breaks an invariant: {v.field}" + (f"[{v.index}]" if v.index is not None else ""))
    last = checks[-1].step if checks else None
    print("every recorded step holds its invariants: the staged rows are not what failed")
    if last is not None:
        print(f"the last staged step: {last['key_text']} ({last['mode']}, phase {last['phase']}), "
              f"{last['num_tokens']} real tokens, {last['num_reqs']} real requests")  # fmt: skip
    print(f"next: `graphcap verify --config YOUR_CONFIG` stages every key (this one: "
          f"{last['key_text'] if last else 'none recorded'}) with every request count and compares replays with "
          "eager; `checks.sample_every: N` compares every Nth live step with an eager run")  # fmt: skip
    return 0


def _first_line(message: object) -> str:
    return str(message or "").splitlines()[0] if message else ""
