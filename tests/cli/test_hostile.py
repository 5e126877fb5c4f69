"""Hostile and careless uses of the command (`tools/campaign/cli_cases.py`), each checked once.

The same catalogue runs in `tools/reliability.py`, one row per area in docs/RELIABILITY.md.
"""

from __future__ import annotations

import sys

import pytest

from tests.tools import TOOLS

sys.path.insert(0, str(TOOLS))  # tools/campaign/: the reliability campaign's cases

from campaign.cli_cases import CLI_CASES, check_case


@pytest.mark.parametrize("case", CLI_CASES, ids=[f"{c.area}: {c.name}" for c in CLI_CASES])
def test_cli_case(case, tmp_path):
    if case.skip is not None and (reason := case.skip()):
        pytest.skip(reason)
    check_case(case, tmp_path)


def test_the_catalogue_covers_every_area():
    areas = {case.area for case in CLI_CASES}
    assert areas == {"files", "flags", "reports", "memory", "packaging"}
    assert len({(c.area, c.name) for c in CLI_CASES}) == len(CLI_CASES)
