"""`graphcap sizes --max-graphs` with key axes: graphs counted per (size, combination), histogram lines with
axis values, the waste per axis value, the eager steps named by axis."""

from __future__ import annotations

import pytest

from graphcap.cli import main
from graphcap.testing.traffic import adapter_steps

LORA = ["--set", "capture.axes={lora: [0, 1, 2, 4, 8]}"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["sizes", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def histogram_file(tmp_path, text: str):
    path = tmp_path / "steps.txt"
    path.write_text(text)
    return path


def test_max_graphs_counts_sizes_times_combinations_and_the_output_says_so(capsys, tmp_path):
    path = histogram_file(tmp_path, "1 30 lora=0\n1 20 lora=1\n3 10 lora=3\n8 15 lora=4\n8 5\n20 10 lora=2\n")
    code, out, err = run(capsys, *LORA, "--histogram", str(path), "--max-graphs", "16")
    assert code == 0 and err == ""
    lines = out.splitlines()
    sizes = lines[0].removeprefix("sizes: [").partition("]")[0].split(", ")
    assert len(sizes) == 3  # 16 graphs // 5 combinations
    assert lines[0].endswith("]  # 15 graphs: 3 sizes x 5 combinations")
    assert lines[1] == f"chosen for 90 steps in {path} (at most 16 graphs; capture.max_size 64)"
    assert any(
        line.startswith("  expected padded-token waste: ") and "with 15 graphs: 3 sizes x 5" in line for line in lines
    )
    table = lines[
        lines.index("  per key-axis value: steps replayed at it, their padded tokens and padded axis slots") :
    ]
    assert table[1].split() == [
        "axis",
        "value",
        "steps",
        "tokens",
        "slots",
        "|",
        "held",
        "out:",
        "steps",
        "tokens",
        "slots",
    ]
    rows = {int(row.split()[1]): row.split() for row in table[2:7]}
    assert sorted(rows) == [0, 1, 2, 4, 8] and all(row[0] == "lora" for row in rows.values())
    # lora=4 holds the 15 steps at 4 and the 10 at 3 (that pad one of 4 slots): 10 / (25 x 4) slots padded
    assert rows[4][2:5:2] == ["27.8%", "10.0%"]
    assert rows[8][2:5] == ["0.0%", "-", "-"]  # no step replays at 8
    assert rows[0][4] == "-"  # a value of 0 has no slots


def test_steps_above_an_axiss_largest_value_run_eagerly_named_by_the_axis(capsys, tmp_path):
    path = histogram_file(tmp_path, "4 50 lora=2\n8 30 lora=9\n8 10 lora=12\n60 10 lora=1\n")
    code, out, _ = run(capsys, *LORA, "--histogram", str(path), "--max-graphs", "10")
    assert code == 0
    assert out.splitlines()[0] == "sizes: [4, 60]  # 10 graphs: 2 sizes x 5 combinations"
    assert (
        "  steps that run eagerly: 40.0% (lora=9-12: above capture.axes.lora's largest value 8 (above_max_axis.lora))"
        in out.splitlines()
    )
    assert "  the config's 11 sizes (55 graphs): 4.8% (eager 40.0% of steps)" in out.splitlines()


def test_a_step_no_listed_combination_holds_is_named_with_its_values(capsys, tmp_path):
    axes = ["--set", "capture.axes={lora: [0, 4], ubatch: [1, 2]}"]
    listed = ["--set", "capture.axis_combinations=[{lora: 0, ubatch: 1}, {lora: 4, ubatch: 1}]"]
    path = histogram_file(tmp_path, "4 50 lora=3\n4 30 lora=1 ubatch=2\n")
    code, out, _ = run(capsys, *axes, *listed, "--histogram", str(path), "--max-graphs", "5")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "sizes: [4]  # 2 graphs: 1 size x 2 combinations"
    assert (
        "  steps that run eagerly: 37.5% (lora=1 ubatch=2: no combination of capture.axis_combinations holds them "
        "(no_axis_combination))"
    ) in lines


def test_the_memory_budget_prices_every_combination_so_fewer_sizes_fit(capsys, tmp_path):
    path = histogram_file(tmp_path, "1 40\n3 30\n8 20\n16 10\n40 5\n64 5\n")  # no axis value: lora=0
    budget = ["--histogram", str(path), "--max-graphs", "100", "--memory-budget", "2MiB"]
    code, plain, _ = run(capsys, *budget)
    assert code == 0
    code, lora, _ = run(capsys, *LORA, *budget)
    assert code == 0
    plain_sizes = plain.splitlines()[0].removeprefix("sizes: [").partition("]")[0].split(", ")
    lora_sizes = lora.splitlines()[0].removeprefix("sizes: [").partition("]")[0].split(", ")
    assert plain_sizes == ["1", "3", "8", "64"] and lora_sizes == ["1", "3", "8"]  # five graphs a size: fewer fit
    assert "token counts 16-64: over the memory budget" in lora and "(budget 2.0 MiB)" in lora


def test_out_writes_the_sizes_and_says_how_many_graphs_they_make(capsys, tmp_path):
    import yaml

    path = histogram_file(tmp_path, "1 50 lora=1\n7 30 lora=4\n60 20\n")
    out_file = tmp_path / "sizes.yaml"
    code, out, _ = run(capsys, *LORA, "--histogram", str(path), "--max-graphs", "15", "--out", str(out_file))
    assert code == 0 and out.splitlines()[0] == "sizes: [1, 7, 60]  # 15 graphs: 3 sizes x 5 combinations"
    assert yaml.safe_load(out.splitlines()[0]) == {"sizes": [1, 7, 60]}  # the comment keeps the line YAML
    text = out_file.read_text()
    assert "; 15 graphs (3 sizes x 5 combinations);" in text.splitlines()[1]
    assert yaml.safe_load(text) == {"capture": {"sizes": [1, 7, 60], "max_size": 60}}


def test_on_traffic_with_adapters_the_chosen_graphs_stay_within_max_graphs(capsys, tmp_path):
    steps = adapter_steps("chat-chunked", seed=2, num_steps=1500)
    text = "".join(f"{n} {w} lora={axes[0][1]}\n" for (n, axes), w in steps.items())
    path = histogram_file(tmp_path, text)
    sets = ["--set", "capture.max_size=512", "--set", "capture.sizes=[8, 512]", "--set", "batching.max_num_tokens=8192"]
    code, out, _ = run(capsys, *LORA, *sets, "--histogram", str(path), "--max-graphs", "51")
    assert code == 0
    head = out.splitlines()[0]
    num_sizes = len(head.removeprefix("sizes: [").partition("]")[0].split(", "))
    assert num_sizes == 10 and head.endswith("# 50 graphs: 10 sizes x 5 combinations")
    assert "above capture.axes.lora's largest value 8 (above_max_axis.lora)" in out


def test_max_graphs_below_the_combinations_is_refused_naming_both_and_the_fix(capsys, tmp_path):
    path = histogram_file(tmp_path, "4 10\n")
    code, out, err = run(capsys, *LORA, "--histogram", str(path), "--max-graphs", "4")
    assert code == 2 and out == ""
    assert err == (
        "graphcap sizes: error: --max-graphs 4 is below the 5 combinations of key axes (capture.axes.lora "
        "[0, 1, 2, 4, 8]): every size is captured at each combination, so --max-graphs counts sizes x 5; give "
        "--max-graphs 5 or more (a multiple of 5 uses every graph), or plan fewer combinations "
        "(capture.axis_combinations)\n"
    )


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("4 10 adapters=2\n", "{path}:1: adapters=2: 'adapters' is not an axis of capture.axes (its axes: lora); name one of them or drop adapters=2"),
        ("4\n4 10 lora=-1\n", "{path}:2: lora=-1: an axis value is a whole number >= 0, e.g. lora=3"),
        ("4 10 lora=2.5\n", "{path}:1: lora=2.5: an axis value is a whole number >= 0, e.g. lora=3"),
        ("4 10 lora=two\n", "{path}:1: lora=two: an axis value is a whole number >= 0, e.g. lora=3"),
        ("4 10 lora=\n", "{path}:1: lora=: an axis value is a whole number >= 0, e.g. lora=3"),
        ("4 10 lora=2 lora=3\n", "{path}:1: lora=3: lora is given twice (lora=2 first); give it once"),
        ("4 10 =3\n", "{path}:1: '=3': after TOKENS [COUNT] a line holds AXIS=VALUE fields only, e.g. lora=3"),
        ("4 lora=3 10\n", "{path}:1: '10': after TOKENS [COUNT] a line holds AXIS=VALUE fields only, e.g. lora=3"),
        ("lora=3\n", "{path}:1: expected TOKENS [COUNT] before the axis values; got 'lora=3'"),
        ("4 10 lora=9\n", "no observed step can replay: every step's axis values are above the largest of capture.axes"),
    ],
)  # fmt: skip
def test_bad_axis_fields_exit_2_naming_file_line_value_and_fix(capsys, tmp_path, text, match):
    path = histogram_file(tmp_path, text)
    code, out, err = run(capsys, *LORA, "--histogram", str(path), "--max-graphs", "10")
    assert code == 2 and out == ""
    assert err.startswith("graphcap sizes: error: ") and match.format(path=path) in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_axis_values_in_a_config_without_axes_are_refused_with_the_fix(capsys, tmp_path):
    path = histogram_file(tmp_path, "4 10 lora=1\n")
    code, _, err = run(capsys, "--histogram", str(path), "--max-graphs", "3")
    assert code == 2
    assert (
        f"{path}:1: lora=1: 'lora' is not an axis of capture.axes (its axes: none); drop lora=1 or add lora to" in err
    )


def test_without_max_graphs_the_waste_is_over_the_steps_whose_axis_values_replay(capsys, tmp_path):
    path = histogram_file(tmp_path, "3 10 lora=1\n8 10 lora=9\n")
    code, out, _ = run(capsys, *LORA, "--histogram", str(path))
    assert code == 0
    lines = out.splitlines()
    assert lines[-3] == f"  expected padded-token waste over the histogram in {path}: 25.0%"  # 3 pads to 4
    assert lines[-2] == "  steps above the max size (eager): 0.0%"
    assert lines[-1] == "  steps whose key-axis values no planned combination holds (eager): 50.0%"


def test_choose_axes_chooses_the_values_too_and_out_writes_a_fragment_load_config_accepts(capsys, tmp_path):
    import yaml

    from graphcap import load_config

    path = histogram_file(tmp_path, "1 30 lora=0\n4 20 lora=3\n8 20 lora=3\n16 10 lora=6\n8 5 lora=7\n")
    out_file = tmp_path / "sizes.yaml"
    argv = [*LORA, "--histogram", str(path), "--max-graphs", "15", "--choose-axes", "--out", str(out_file)]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "sizes: [1, 8, 16]  # 12 graphs: 3 sizes x 4 combinations"  # 15 // 4 combinations
    assert lines[1] == "axes: {lora: [0, 3, 6, 7]}  # chosen from the histogram; the config's: {lora: [0, 1, 2, 4, 8]}"
    # the config's values pad 3 -> 4 (40 steps), 6 -> 8 (10), 7 -> 8 (5): 65 of 280 slots
    assert (
        "  lora values chosen from the histogram: padded slots 0.0% in sample, 0.0% held out (values chosen on half "
        "the steps, scored on the other, both ways); the config's [0, 1, 2, 4, 8]: 23.2%"
    ) in lines
    fragment = yaml.safe_load(out_file.read_text())
    assert fragment == {"capture": {"sizes": [1, 8, 16], "max_size": 16, "axes": {"lora": [0, 3, 6, 7]}}}
    overrides = {f"capture.{key}": value for key, value in fragment["capture"].items()}
    config = load_config("default", overrides)
    assert config.capture.axes == {"lora": (0, 3, 6, 7)} and config.capture_sizes.sizes == (1, 8, 16)
    assert lines[-1] == f"  wrote capture.sizes, capture.max_size and capture.axes to {out_file}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-graphs", "8", "--choose-axes"], "--choose-axes chooses the values of capture.axes, and the config plans no key axis"),
        ([*LORA, "--set", "capture.axis_combinations=[{lora: 4}]", "--max-graphs", "8", "--choose-axes"], "--choose-axes chooses the values of capture.axes, and the config lists combinations by value (drop the list)"),
        ([*LORA, "--choose-axes"], "--choose-axes chooses axis values with the sizes: give --max-graphs N and --histogram FILE"),
        ([*LORA, "--set", "capture.axes={lora: [0, 2]}", "--max-graphs", "8", "--choose-axes"], "--choose-axes: no observed step has a lora value within capture.axes.lora's largest 2"),
    ],
)  # fmt: skip
def test_choose_axes_refuses_what_it_cannot_choose(capsys, tmp_path, argv, message):
    path = histogram_file(tmp_path, "4 10 lora=5\n")
    code, out, err = run(capsys, "--histogram", str(path), *argv)
    assert code == 2 and out == ""
    assert err.startswith("graphcap sizes: error: ") and message in err and err.count("\n") == 1


def test_relative_weights_are_not_split_so_the_per_value_table_has_no_held_out_columns(capsys, tmp_path):
    path = histogram_file(tmp_path, "1 0.5 lora=1\n4 0.25 lora=3\n9 1.5\n")
    code, out, _ = run(capsys, *LORA, "--histogram", str(path), "--max-graphs", "10")
    assert code == 0
    lines = out.splitlines()
    assert "  held-out waste: not scored (the histogram's counts are not whole steps, or a half replays none)" in lines
    header = lines.index("  per key-axis value: steps replayed at it, their padded tokens and padded axis slots") + 1
    assert lines[header].split() == ["axis", "value", "steps", "tokens", "slots"]
    assert lines[header + 4].split() == ["lora", "4", "11.1%", "55.6%", "25.0%"]  # 4 tokens, lora=3: size 9, lora=4
