"""Reliability suite: faults during capture, hostile batches and configs, stale padding, threads.

The helpers live in `graphcap.testing` and `tools/campaign/` (shared with `tools/reliability.py`,
which runs the long campaign and writes docs/RELIABILITY.md); these tests run the same checks
with fewer repetitions.
"""
