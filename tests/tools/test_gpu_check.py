"""`tools/gpu_check.py` runs end to end on the CPU (emulated backend), so it never rots."""

import json

from tests.tools import run_tool


def test_gpu_check_quick_on_cpu_writes_json_and_passes(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = run_tool("gpu_check.py", "--device", "cpu", "--quick", "--out", str(out), OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpu_check: ok" in result.stdout
    assert "size  reqs capture ms  graph mem  eager ms replay ms  speedup" in result.stdout
    data = json.loads(out.read_text())
    assert data["tiny"]["all_verified"] and len(data["tiny"]["graphs"]) == 8
    assert data["llama3_8b"] == {"skipped": "no CUDA device"}
    assert data["safety"] == {"unsafe_named": True, "moved_refused": True, "ok": True}
