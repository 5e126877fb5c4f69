"""`graphcap sizes`: the schedule, the padding table, the keys and the expected waste."""

from __future__ import annotations

import pytest

from graphcap.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["sizes", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_sizes_of_the_default_config(capsys):
    code, out, err = run(capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "capture sizes from embedded default config (capture.mode full)"
    assert lines[1] == "  11 sizes: 1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64"
    assert "            3-4        4          25.0%" in lines
    assert "            >64    eager" in lines
    assert "  graph keys: 18 (7 uniform, 11 mixed)" in lines
    assert "    mixed   (tokens/reqs): 1/1 2/2 4/4 8/8 16/16 24/24 32/32 40/32 48/32 56/32 64/32" in lines
    assert lines[-1] == "  expected padded-token waste with token counts 1..64 equally likely: 8.9%"


def test_sizes_of_a_default_schedule_for_speculative_decoding(capsys):
    code, out, _ = run(capsys, "--max-size", "64", "--uniform-query-len", "4")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "capture sizes from default_capture_sizes(64, uniform_query_len=4)"
    assert lines[1] == "  9 sizes: 4, 8, 16, 24, 32, 40, 48, 56, 64"
    assert "            1-4        4          75.0%" in lines
    assert "graph keys" not in out  # no config, no registry


def test_sizes_with_set_overrides(capsys):
    code, out, _ = run(capsys, "--set", "capture.sizes=[1, 8, 32]", "--set", "capture.max_size=32")
    assert code == 0
    assert "  3 sizes: 1, 8, 32" in out.splitlines()


def test_sizes_over_a_histogram_file(capsys, tmp_path):
    histogram = tmp_path / "batches.txt"
    histogram.write_text("# observed steps\n3\n8 10\n\n100, 2   # above the max: eager\n")
    code, out, _ = run(capsys, "--histogram", str(histogram))
    assert code == 0
    lines = out.splitlines()
    # real 3 + 80 tokens replayed as 4 + 80; 2 of 13 steps above 64
    assert lines[-2] == f"  expected padded-token waste over the histogram in {histogram}: 1.2%"
    assert lines[-1] == "  steps above the max size (eager): 15.4%"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("4\nfour\n", r"{path}:2: expected TOKENS or TOKENS COUNT; got 'four'"),
        ("4\n0\n", r"{path}:2: expected a token count >= 1 and an optional count >= 0; got '0'"),
        ("2.5\n", r"{path}:1: expected a token count >= 1"),
        ("4 -1\n", r"{path}:1: expected a token count >= 1 and an optional count >= 0; got '4 -1'"),
        ("4 1 1\n", r"{path}:1: expected a token count >= 1"),
        ("inf\n", r"{path}:1: expected a token count >= 1"),  # used to raise OverflowError
        ("8 nan\n", r"{path}:1: expected a token count >= 1"),  # used to give a nan waste
        ("# nothing\n\n", r"{path}: no batch sizes in the histogram"),
        ("4 0\n", r"{path}: no batch sizes in the histogram"),
    ],
)
def test_bad_histogram_lines_exit_2_with_file_and_line(capsys, tmp_path, text, match):
    path = tmp_path / "h.txt"
    path.write_text(text)
    code, out, err = run(capsys, "--histogram", str(path))
    assert code == 2 and out == ""
    assert err.startswith("graphcap sizes: error: ") and match.format(path=path) in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_missing_histogram_file_exits_2(capsys, tmp_path):
    code, _, err = run(capsys, "--histogram", str(tmp_path / "none.txt"))
    assert code == 2 and "cannot read" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-size", "64", "--config", "x.yaml"], "give either --max-size or --config/--set, not both"),
        (["--max-size", "64", "--set", "capture.max_size=8"], "give either --max-size or --config/--set, not both"),
        (["--max-size", "0"], "--max-size: must be >= 1; got 0"),
        (["--max-size", "62", "--uniform-query-len", "4"], "--max-size: max_size 62 is not a multiple of uniform_query_len 4; use 60 or 64"),
        (["--max-size", "100000000"], "--max-size: must be <= 65536; got 100000000"),
        (["--max-size", "1000000000"], "--max-size: must be <= 65536; got 1000000000"),
        (["--max-size", "8", "--uniform-query-len", "0"], "--uniform-query-len: must be >= 1; got 0"),
        (["--set", "capture.max_size"], "--set 'capture.max_size': expected KEY=VALUE, e.g. --set capture.max_size=16"),
        (
            ["--config", "/no/such/config.yaml"],
            "--config config file not found: /no/such/config.yaml (configs shipped with graphcap, loadable by name: "
            "decode-only, default, llama3-8b-h200, spec-decode, tiny-cpu-ci)",
        ),
    ],
)  # fmt: skip
def test_usage_errors_exit_2_with_a_one_line_message(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err == f"graphcap sizes: error: {message}\n"


def test_invalid_set_value_reports_the_config_problem_and_exits_2(capsys):
    code, out, err = run(capsys, "--set", "capture.max_size=0")
    assert code == 2 and out == ""
    assert err.splitlines() == [
        "graphcap sizes: error: 1 problem in <embedded default.yaml>:",
        "  override: capture.max_size: must be >= 1; got 0",
    ]


def test_sizes_lists_the_request_rows_of_each_mixed_size(capsys):
    code, out, _ = run(
        capsys, "--set", "batching.max_num_seqs=1024", "--set", "batching.max_num_tokens=2304",
        "--set", "capture.sizes=[8, 256, 2304]", "--set", "capture.max_size=2304",
        "--set", "kv_cache.max_model_len=2048", "--set", "kv_cache.num_blocks=200000",
    )  # fmt: skip
    assert code == 0
    lines = out.splitlines()
    assert "    mixed   (tokens/reqs): 8/8 256/64,256 2304/64,256,1024" in lines
    assert any(line.startswith("    a mixed step pads its requests to the fewest rows") for line in lines)


def test_sizes_lists_piecewise_keys(capsys):
    flags = ("--set", "capture.mode=full_and_piecewise", "--set", "model.attention=per_request")
    code, out, _ = run(capsys, *flags, "--set", "capture.max_size=8")
    assert code == 0
    lines = out.splitlines()
    assert "  graph keys: 8 (4 uniform, 0 mixed, 4 piecewise)" in lines
    assert "    piecewise (tokens, any request count): 1 2 4 8" in lines
    assert "piecewise keys counted as full graphs of their size (an upper bound)" in out
