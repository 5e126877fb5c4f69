"""The `graphcap` command: the hostile cases of `cli_cases.py` by area, and Ctrl-C at each stage
of a running `graphcap verify`.
"""

from __future__ import annotations

from pathlib import Path

from .cli_cases import CLI_CASES, check_case
from .interrupts import STAGES, interrupt_at, interrupted_cleanly
from .trials import Row, Scale, Tally

CLI_AREAS = {
    "files": (
        "config files: missing, unreadable (ELOOP, ENOTDIR, ENAMETOOLONG, EISDIR, EIO, EACCES), endless or huge "
        "(`/dev/zero`, 3 MB, 20 MB, 350k nodes), not UTF-8, 5000-digit integers; a bundled config by name, a "
        "factory module beside its config run from another directory"
    ),
    "flags": (
        "flags and values: `--set` long integers and quotes, sizes that cannot run, a failing model build or "
        "factory, `sizes --max-size 10**9`, bad histograms, stdout on a full disk or closed (`>&-`), "
        "`verify --seed -1`, `--device cuda:<huge>`, `--backend cuda` without CUDA, every key skipped"
    ),
    "reports": (
        "reports and plots: `--report` onto the config, file modes, a failed write, what a report records, "
        "a report path over a file graphcap did not write (a CI workflow), a config's report path outside its "
        "directory and the working directory, a path too long, `--plot` into a directory or with a suffix "
        "matplotlib cannot write, a PDF plot"
    ),
    "memory": (
        "memory: an 8B-shaped config with a huge cache on the CPU, a T x 2**40 float64 engine buffer, the "
        "estimate in `capture` and `sizes`"
    ),
    "packaging": "names: a factory override on the embedded default, vLLM mode spellings",
}


def cli_rows(scale: Scale, workdir: Path) -> list[Row]:
    rows = []
    for area, what in CLI_AREAS.items():
        cases = [c for c in CLI_CASES if c.area == area][: scale.cli_cases_per_area]
        tally, skipped = Tally(), []
        for i, case in enumerate(cases):
            reason = case.skip() if case.skip is not None else None
            if reason:
                skipped.append(f"{case.name}: {reason}")
                continue
            with tally.trial(case.name):
                check_case(case, workdir / f"cli-{area}-{i}")
        note = f" (not run on this machine: {'; '.join(skipped)})" if skipped else ""
        outcome = "the documented exit code, one line naming the file, key or flag, no traceback"
        rows.append(tally.row("command line", what + note, outcome))
    tally = Tally()
    for i in range(scale.interrupts):
        stage = STAGES[i % len(STAGES)]  # sent when the process logs the stage, never after a sleep
        with tally.trial(f"Ctrl-C at {stage}"):
            code, err = interrupt_at(stage, workdir / f"interrupt-{i}")
            if not interrupted_cleanly(code, err):
                raise AssertionError(f"exit {code}: {err.strip()[-300:]!r}")
    rows.append(
        tally.row(
            "command line",
            f"Ctrl-C at each of the {len(STAGES)} stages of `python -m graphcap verify` "
            f"({', '.join(STAGES)}; {scale.interrupts} trials), sent when the process logs the stage",
            "one line, no traceback, the process ends by SIGINT (a shell sees 130)",
        )
    )
    return rows
