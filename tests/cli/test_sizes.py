"""`graphcap sizes`: the schedule, the padding table, the keys and the expected waste."""

from __future__ import annotations

from pathlib import Path

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


# Choosing sizes for traffic: --max-graphs, --memory-budget, --out.

TRAFFIC = "# steps by token count\n1 40\n2 20\n3 10\n8 20\n20 8\n64 2\n"


def histogram_file(tmp_path, text: str = TRAFFIC):
    path = tmp_path / "traffic.txt"
    path.write_text(text)
    return path


def test_max_graphs_prints_the_chosen_sizes_first_then_the_table(capsys, tmp_path):
    path = histogram_file(tmp_path)
    code, out, err = run(capsys, "--histogram", str(path), "--max-graphs", "3")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "sizes: [3, 20, 64]"
    assert lines[1] == f"chosen for 100 steps in {path} (at most 3 graphs; capture.max_size 64)"
    assert lines[3:7] == [
        "    size       tokens   steps  pad/step   waste",
        "       3          1-3   70.0%      1.43   47.6%",
        "      20         4-20   28.0%      8.57   42.9%",
        "      64        21-64    2.0%      0.00    0.0%",
    ]
    # padded 3*70 + 20*28 + 64*2 = 898 tokens for 558 real ones
    assert "  expected padded-token waste: 37.9% with 3 graphs (in sample)" in lines
    assert (
        "  held-out waste: 37.5% (chosen on half the steps, scored on the other, both ways; traffic 37.5%, "
        "ladder 48.1%: sizes chosen by traffic)"
    ) in lines
    assert "  the config's 11 sizes: 7.0% (eager 0.0% of steps)" in lines
    assert "  steps that run eagerly: none (the largest size holds the largest observed step)" in lines
    assert any(
        line.startswith("  graph memory estimate: emulated ") for line in lines
    )  # the backend device auto picks here


def test_out_writes_a_fragment_that_load_config_accepts_merged_into_the_config(capsys, tmp_path):
    import yaml

    from graphcap import load_config

    path = histogram_file(tmp_path, "1 50\n7 30\n100 20\n300 1\n")
    out_file = tmp_path / "sizes.yaml"
    config = "capture_configs/llama3-8b-h200.yaml"  # capture.max_size: 512 given explicitly
    code, out, _ = run(
        capsys, "--config", config, "--histogram", str(path), "--max-graphs", "3", "--out", str(out_file)
    )
    assert code == 0
    assert out.splitlines()[0] == "sizes: [7, 100, 300]"
    assert out.splitlines()[-1] == f"  wrote capture.sizes and capture.max_size to {out_file}"
    fragment = yaml.safe_load(out_file.read_text())
    assert fragment == {"capture": {"sizes": [7, 100, 300], "max_size": 300}}
    merged = yaml.safe_load(Path(config).read_text())
    merged["capture"].update(fragment["capture"])
    (tmp_path / "merged.yaml").write_text(yaml.safe_dump(merged))
    assert load_config(tmp_path / "merged.yaml").capture_sizes.sizes == (7, 100, 300)
    overrides = {f"capture.{key}": value for key, value in fragment["capture"].items()}
    assert load_config(config, overrides).capture_sizes.sizes == (7, 100, 300)


def test_steps_above_max_size_run_eagerly_and_are_named(capsys, tmp_path):
    path = histogram_file(tmp_path, "1 50\n8 30\n100 15\n200 5\n")
    code, out, _ = run(capsys, "--histogram", str(path), "--max-graphs", "4")
    assert code == 0
    assert out.splitlines()[0] == "sizes: [1, 8]"
    assert "  steps that run eagerly: 20.0% (token counts 100-200: above capture.max_size 64)" in out.splitlines()


def test_max_size_flag_bounds_the_choice_and_uniform_query_len_rounds_it(capsys, tmp_path):
    path = histogram_file(tmp_path, "4 50\n5 10\n8 30\n12 10\n")
    code, out, _ = run(
        capsys, "--histogram", str(path), "--max-graphs", "2", "--max-size", "16", "--uniform-query-len", "4"
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "sizes: [4, 12]"
    assert lines[1].endswith("(at most 2 graphs; --max-size 16)")
    assert "  the default schedule's 3 sizes: 10.3% (eager 0.0% of steps)" in lines
    assert "  expected padded-token waste: 23.8% with 2 graphs (in sample)" in lines  # 5, 8 and 12 pad to 12


def test_memory_budget_keeps_the_graphs_within_it(capsys, tmp_path):
    import dataclasses

    from graphcap import load_config
    from graphcap.memory.estimate import estimate_memory

    path = histogram_file(tmp_path, "1 40\n16 30\n200 20\n512 10\n")
    config = "llama3-8b-h200"
    code, out, _ = run(
        capsys, "--config", config, "--histogram", str(path), "--max-graphs", "4", "--memory-budget", "1GiB"
    )
    assert code == 0
    lines = out.splitlines()
    sizes = tuple(int(s) for s in lines[0].removeprefix("sizes: [").removesuffix("]").split(", "))
    base = load_config(config)
    capture = dataclasses.replace(base.capture, sizes=sizes, max_size=sizes[-1])
    graphs = estimate_memory(dataclasses.replace(base, capture=capture), backend="cuda").parts["graphs"]
    assert graphs <= 1 << 30 and sizes[-1] < 512
    assert "memory budget 1.0 GiB" in lines[1]
    assert any(line.startswith("  steps that run eagerly: ") and "over the memory budget" in line for line in lines)
    assert any(
        line.startswith("  graph memory estimate: cuda ") and line.endswith("(budget 1.0 GiB)") for line in lines
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-graphs", "0"], "--max-graphs: expected a whole number >= 1; got '0'"),
        (["--max-graphs", "-3"], "--max-graphs: expected a whole number >= 1; got '-3'"),
        (["--max-graphs", "thirty"], "--max-graphs: expected a whole number >= 1; got 'thirty'"),
        (["--max-graphs", "2.5"], "--max-graphs: expected a whole number >= 1; got '2.5'"),
        (["--max-graphs", "4", "--memory-budget", "lots"], "--memory-budget: expected bytes or a size such as 4GiB, 512MiB or 8GB (at least 1 byte); got 'lots'"),
        (["--max-graphs", "4", "--memory-budget", "0"], "--memory-budget: expected bytes or a size such as 4GiB, 512MiB or 8GB (at least 1 byte); got '0'"),
        (["--max-graphs", "4", "--memory-budget=-4GiB"], "--memory-budget: expected bytes or a size such as 4GiB, 512MiB or 8GB (at least 1 byte); got '-4GiB'"),
        (["--max-graphs", "4", "--memory-budget", "4 GiX"], "--memory-budget: expected bytes or a size such as 4GiB, 512MiB or 8GB (at least 1 byte); got '4 GiX'"),
        (["--max-graphs", "4", "--memory-budget", "9" * 30], "--memory-budget: expected bytes or a size such as 4GiB"),
        (["--max-graphs", "4", "--memory-budget", "100"], "memory budget 100 bytes is below the smallest graph's"),
        (["--max-graphs", "4", "--max-size", "64", "--memory-budget", "1GiB"], "--memory-budget needs a config's model for its memory estimate: use --config, not --max-size"),
        (["--max-graphs", "4", "--set", "capture.mode=none"], "capture.mode is none: no graph is captured, so there are no sizes to choose"),
        (["--max-graphs", "4", "--set", "batching.max_num_tokens=48", "--set", "capture.max_size=32"], "token count 64 is above batching.max_num_tokens 48, which no step of this config exceeds"),
    ],
)  # fmt: skip
def test_bad_choice_flags_exit_2_with_a_one_line_message(capsys, tmp_path, argv, message):
    path = histogram_file(tmp_path)
    code, out, err = run(capsys, "--histogram", str(path), *argv)
    assert code == 2 and out == ""
    assert err.startswith("graphcap sizes: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("4\nfour\n", r"{path}:2: expected TOKENS or TOKENS COUNT; got 'four'"),
        ("4 -1\n", r"{path}:1: expected a token count >= 1 and an optional count >= 0; got '4 -1'"),
        ("4 0\n", r"{path}: no batch sizes in the histogram"),
    ],
)
def test_bad_histograms_exit_2_when_choosing_too(capsys, tmp_path, text, match):
    path = histogram_file(tmp_path, text)
    code, out, err = run(capsys, "--histogram", str(path), "--max-graphs", "4")
    assert code == 2 and out == ""
    assert err == f"graphcap sizes: error: {match.format(path=path)}\n"


def test_choice_flags_need_a_histogram_and_out_needs_a_choice(capsys, tmp_path):
    code, out, err = run(capsys, "--max-graphs", "4")
    assert (code, out) == (2, "")
    assert (
        err
        == "graphcap sizes: error: --max-graphs and --memory-budget choose sizes for traffic: give --histogram FILE\n"
    )
    code, out, err = run(capsys, "--histogram", str(histogram_file(tmp_path)), "--out", str(tmp_path / "x.yaml"))
    assert (code, out) == (2, "")
    assert (
        err == "graphcap sizes: error: --out writes chosen sizes: give --max-graphs N (and --histogram FILE) with it\n"
    )
    code, _, err = run(capsys, "--histogram", str(tmp_path / "none.txt"), "--max-graphs", "4")
    assert code == 2 and "cannot read" in err and err.count("\n") == 1


def test_out_refuses_a_directory_and_the_histogram_itself_and_writes_nothing_on_error(capsys, tmp_path):
    path = histogram_file(tmp_path)
    code, _, err = run(capsys, "--histogram", str(path), "--max-graphs", "4", "--out", str(tmp_path))
    assert (
        code == 2
        and err
        == f"graphcap sizes: error: --out {tmp_path}: is a directory; give a file name, e.g. {tmp_path / 'sizes.yaml'}\n"
    )
    code, _, err = run(capsys, "--histogram", str(path), "--max-graphs", "4", "--out", str(path))
    assert code == 2 and "is the input file" in err and path.read_text() == TRAFFIC
    out_file = tmp_path / "sizes.yaml"
    code, _, _ = run(
        capsys, "--histogram", str(path), "--max-graphs", "4", "--memory-budget", "100", "--out", str(out_file)
    )
    assert code == 2 and not out_file.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["traffic.txt"]


def test_each_eager_reason_is_named_with_its_token_counts(capsys, tmp_path):
    path = histogram_file(tmp_path, "2 5\n3 4\n8 2\n100 1\n")
    config = ("--config", "decode-only", "--set", "capture.uniform_query_len=2")
    code, out, _ = run(capsys, *config, "--histogram", str(path), "--max-graphs", "2")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "sizes: [2, 8]"
    assert (
        "  steps that run eagerly: 41.7% (token count 3: not whole uniform requests, under full_decode_only; "
        "token count 100: above capture.max_size 64)"
    ) in lines


def test_a_memory_budget_alone_chooses_as_many_sizes_as_fit(capsys, tmp_path):
    path = histogram_file(tmp_path)
    out_file = tmp_path / "sizes.yaml"
    flags = ("--histogram", str(path), "--memory-budget", "2MiB", "--out", str(out_file), "--set", "device=cuda")
    code, out, _ = run(capsys, *flags)  # the CUDA estimate: a pool sized by the largest key
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "sizes: [1, 2, 3]"
    assert lines[1] == f"chosen for 100 steps in {path} (memory budget 2.0 MiB; capture.max_size 64)"
    assert "  steps that run eagerly: 30.0% (token counts 8-64: over the memory budget)" in lines
    assert out_file.read_text().splitlines()[0] == f"# graphcap sizes --histogram {path} --memory-budget 2MiB"


def test_under_full_decode_only_the_largest_uniform_key_bounds_the_choice(capsys, tmp_path):
    path = histogram_file(tmp_path, "2 5\n4 3\n40 1\n600 0\n")  # a count with no step is no step
    flags = ("--config", "decode-only", "--set", "batching.max_num_seqs=16")
    code, out, _ = run(capsys, *flags, "--histogram", str(path), "--max-graphs", "2")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "sizes: [2, 4]"
    assert lines[1].endswith("(at most 2 graphs; batching.max_num_seqs 16 x uniform_query_len 1)")
    assert (
        "  steps that run eagerly: 11.1% (token count 40: above batching.max_num_seqs 16 x uniform_query_len 1)"
        in lines
    )


@pytest.mark.parametrize(
    ("argv", "limit"),
    [((), "capture.max_size 64"), (("--max-size", "16"), "--max-size 16")],
)
def test_a_histogram_whose_every_step_is_above_the_largest_size_exits_2_naming_the_limit(capsys, tmp_path, argv, limit):
    path = histogram_file(tmp_path, "100 5\n120 3\n")
    code, out, err = run(capsys, "--histogram", str(path), "--max-graphs", "3", *argv)
    assert (code, out) == (2, "")
    assert err == (
        f"graphcap sizes: error: --histogram {path}: no observed step can replay: the smallest token count 100 is "
        f"above {limit}, so no size can be chosen; raise that limit or give a histogram of this config's traffic\n"
    )


def test_out_creates_missing_directories_as_capture_report_does_and_says_so(capsys, tmp_path):
    path = histogram_file(tmp_path)
    out_file = tmp_path / "new" / "deeper" / "sizes.yaml"
    code, out, _ = run(capsys, "--histogram", str(path), "--max-graphs", "3", "--out", str(out_file))
    assert code == 0 and out_file.is_file()
    assert out.splitlines()[-1] == (
        f"  wrote capture.sizes and capture.max_size to {out_file} (created {tmp_path / 'new'})"
    )
    code, out, _ = run(capsys, "--histogram", str(path), "--max-graphs", "3", "--out", str(out_file))
    assert code == 0 and out.splitlines()[-1] == f"  wrote capture.sizes and capture.max_size to {out_file}"


def test_out_under_a_file_is_refused_before_any_work_naming_the_file(capsys, tmp_path):
    path = histogram_file(tmp_path)
    code, out, err = run(capsys, "--histogram", str(path), "--max-graphs", "3", "--out", str(path / "x" / "s.yaml"))
    assert (code, out) == (2, "")
    assert (
        err == f"graphcap sizes: error: --out {path / 'x' / 's.yaml'}: cannot be created: {path} is not a directory\n"
    )


@pytest.mark.parametrize(
    ("counts", "shown"),
    [("1 1e300\n2 5\n", "1e+300"), ("1 123456789012345\n", "1.235e+14"), ("1 2.5\n2 1\n", "3.5"), ("1 70\n", "70")],
)
def test_the_step_count_a_choice_is_made_for_is_printed_in_a_few_digits(capsys, tmp_path, counts, shown):
    path = histogram_file(tmp_path, counts)
    code, out, _ = run(capsys, "--histogram", str(path), "--max-graphs", "3")
    assert code == 0
    assert out.splitlines()[1].startswith(f"chosen for {shown} steps in {path} (")
