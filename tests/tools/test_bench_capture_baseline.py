"""`tools/bench_capture_baseline.py`: a re-capture pass of this tree beside another revision's, in one process."""

from __future__ import annotations

import re

import pytest

from tests.tools import REPO, run_tool

pytestmark = pytest.mark.skipif(not (REPO / ".git").exists(), reason="reads a git revision; not a git checkout")


def test_a_pass_of_this_tree_and_of_a_revision_are_timed_side_by_side():
    result = run_tool("bench_capture_baseline.py", "HEAD", "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "re-capture pass, 8 keys, 1 torch thread, 2 rounds alternating" in result.stdout
    assert re.search(r"^this tree +[\d.]+ +[\d.]+-[\d.]+", result.stdout, re.MULTILINE)
    assert re.search(r"^HEAD +[\d.]+ +[\d.]+-[\d.]+", result.stdout, re.MULTILINE)
    assert re.search(r"^this tree / HEAD: median [\d.]+x \(min-max [\d.]+-[\d.]+x", result.stdout, re.MULTILINE)


def test_rounds_below_one_are_refused_naming_the_flag():
    result = run_tool("bench_capture_baseline.py", "HEAD", "--rounds", "0", timeout=300)
    assert result.returncode == 2
    assert "--rounds 0: give at least 1" in result.stderr
