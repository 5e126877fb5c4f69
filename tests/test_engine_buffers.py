"""Engine-declared persistent buffers (`BufferSpec`): staged, padded, checked and uploaded like the built-ins.

The examples are engines' own buffers: mrope positions `[3, T]` int64 pad 0, a per-token LoRA index
pad -1, a per-request temperature float32 pad 1.0, a second KV-cache group with its own
`[R, blocks]` block table and `[T]` slot mapping (pad `PAD_SLOT_ID`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap import (
    PAD_SLOT_ID,
    BatchError,
    BufferSpec,
    CaptureError,
    CaptureManager,
    GraphKey,
    InvariantViolation,
    StepBatch,
)
from graphcap.checks.invariants import check_invariants
from graphcap.cli._common import parse_overrides
from graphcap.config import ConfigError, config_from_text
from graphcap.models import build_model
from graphcap.staging import PersistentBuffers
from graphcap.testing import TINY, make_config, nested

GROUP2_BLOCKS = 4
ENGINE_BUFFERS = [
    BufferSpec("mrope_positions", "tokens", shape=(3,), dtype="int64", pad=0, row_dim=1),
    BufferSpec("lora_index", "tokens", dtype="int32", pad=-1),
    BufferSpec("temperature", "reqs", dtype="float32", pad=1.0),
    BufferSpec("block_table_g2", "reqs", shape=(GROUP2_BLOCKS,), dtype="int32", pad=0),
    BufferSpec("slot_mapping_g2", "tokens", dtype="int32", pad=PAD_SLOT_ID),
]


def make_buffers(**kwargs) -> PersistentBuffers:
    return PersistentBuffers(
        4, 16, 3, block_size=4, num_blocks=32, vocab_size=64, max_model_len=12, extras=ENGINE_BUFFERS, **kwargs
    )


def extras_for(n: int, r: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "mrope_positions": rng.integers(0, 12, (3, n)),
        "lora_index": rng.integers(-1, 4, n),
        "temperature": rng.uniform(0.1, 2.0, r).astype(np.float32),
        "block_table_g2": rng.integers(1, 32, (r, GROUP2_BLOCKS)),
        "slot_mapping_g2": rng.integers(0, 128, n),
    }


def test_engine_buffers_hold_the_real_rows_then_their_pad():
    buffers = make_buffers()
    extras = extras_for(3, 2)
    inputs = buffers.stage(StepBatch([2, 1], [3, 4], extras=extras), GraphKey(8, 4, False))
    ex = inputs.extras
    assert ex["mrope_positions"].shape == (3, 8) and ex["mrope_positions"].dtype == torch.int64
    assert ex["mrope_positions"][:, :3].tolist() == extras["mrope_positions"].tolist()
    assert (ex["mrope_positions"][:, 3:] == 0).all()
    assert ex["lora_index"].tolist() == [*extras["lora_index"].tolist(), -1, -1, -1, -1, -1]
    assert ex["temperature"].tolist() == pytest.approx([*extras["temperature"].tolist(), 1.0, 1.0])
    assert ex["block_table_g2"].shape == (4, GROUP2_BLOCKS) and (ex["block_table_g2"][2:] == 0).all()
    assert ex["slot_mapping_g2"][3:].tolist() == [PAD_SLOT_ID] * 5
    check_invariants(inputs, "full", dummy=True)


def test_a_buffer_the_step_does_not_give_is_all_pad():
    inputs = make_buffers().stage(StepBatch([1], [1]), GraphKey(2, 2, False))
    assert inputs.extras["lora_index"].tolist() == [-1, -1]
    assert inputs.extras["temperature"].tolist() == [1.0, 1.0]


def test_engine_buffers_are_zero_copy_views_of_the_one_packed_buffer():
    buffers = make_buffers()
    inputs = buffers.stage(StepBatch([1], [1], extras=extras_for(1, 1)), GraphKey(2, 2, False))
    packed = buffers.storage()["packed"]
    start, end = packed.data_ptr(), packed.data_ptr() + packed.numel()
    for name, tensor in inputs.tensors().items():
        assert start <= tensor.data_ptr() < end, name
        assert tensor.data_ptr() % 64 == (4 if name == "num_reqs_device" else 0), name  # fields 64-byte aligned
    assert np.shares_memory(inputs.host.extras["temperature"], buffers.packed_host)


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        (
            "temperature",
            np.array([1.0, np.nan], np.float32),
            r"extras\['temperature'\]\[1\] is nan; values must be finite",
        ),
        ("temperature", np.ones(3, np.float32), r"extras\['temperature'\] has shape \(3,\); expected \(2,\)"),
        (
            "mrope_positions",
            np.zeros((3, 2), np.int64),
            r"extras\['mrope_positions'\] has shape \(3, 2\); expected \(3, 3\)",
        ),
        ("lora_index", np.array([0.5, 1, 2]), r"extras\['lora_index'\] must hold integers for dtype int32"),
        (
            "lora_index",
            np.array([0, 2**40, 1]),
            r"extras\['lora_index'\]\[1\] is 1099511627776, outside the range of int32",
        ),
        ("no_such", np.zeros(3), r"extras\['no_such'\]: no such buffer; declared buffers: mrope_positions"),
    ],
)
def test_bad_engine_rows_are_refused_before_any_write(name, value, match):
    buffers = make_buffers()
    buffers.stage(StepBatch([1, 1], [2, 2]), GraphKey(4, 4, False))
    before = buffers.packed_host.copy()
    extras = {k: v for k, v in extras_for(3, 2).items() if k == "temperature" or name != "temperature"}
    extras[name] = value
    with pytest.raises(BatchError, match=match):
        buffers.stage(StepBatch([2, 1], [3, 4], extras=extras), GraphKey(8, 4, False))
    assert buffers.packed_host.tobytes() == before.tobytes()


@pytest.mark.parametrize("value", [1e6, 70000.0, 65520.0, 100000])
def test_a_value_float16_stores_as_inf_is_refused_naming_buffer_index_and_value(value):
    buffers = PersistentBuffers(4, 16, 3, block_size=4, extras=[BufferSpec("scale", "reqs", dtype="float16", pad=1.0)])
    buffers.stage(StepBatch([1, 1], [2, 2]), GraphKey(4, 4, False))
    before = buffers.packed_host.copy()
    given = np.array([0.5, value])
    with pytest.raises(BatchError, match=rf"extras\['scale'\]\[1\] is {given[1]}, which float16 stores as inf"):
        buffers.stage(StepBatch([1, 1], [2, 2], extras={"scale": given}), GraphKey(4, 4, False))
    assert buffers.packed_host.tobytes() == before.tobytes()  # nothing half-written


def test_the_largest_finite_float16_value_stages_as_itself():
    buffers = PersistentBuffers(4, 16, 3, block_size=4, extras=[BufferSpec("scale", "reqs", dtype="float16", pad=1.0)])
    # 65519 rounds down to 65504, the largest finite float16: finite as stored, so it stages.
    inputs = buffers.stage(StepBatch([1, 1], [2, 2], extras={"scale": [65504.0, 65519.0]}), GraphKey(4, 4, False))
    assert inputs.extras["scale"][:2].tolist() == [65504.0, 65504.0]


def test_poison_reaches_engine_buffers_and_staging_clears_it():
    buffers = make_buffers(poison=True)
    inputs = buffers.stage(StepBatch([1], [1]), GraphKey(2, 2, False))
    assert np.isnan(buffers.host["temperature"][2:]).all()  # unstaged rows stay poisoned
    assert inputs.extras["temperature"].tolist() == [1.0, 1.0]


def test_a_buffers_own_check_runs_at_the_invariant_level():
    def non_negative(view: np.ndarray, num_real_rows: int) -> None:
        if (view[:num_real_rows] < 0).any():
            raise ValueError(f"negative adapter id in {view[:num_real_rows].tolist()}")

    spec = BufferSpec("adapter", "reqs", pad=0, check=non_negative)
    buffers = PersistentBuffers(4, 8, 2, block_size=4, extras=[spec])
    inputs = buffers.stage(StepBatch([1, 1], [2, 2], extras={"adapter": [3, -2]}), GraphKey(2, 2, False))
    with pytest.raises(
        InvariantViolation, match=r"adapter is refused \(ValueError: negative adapter id in \[3, -2\]\)"
    ):
        check_invariants(inputs, "basic", dummy=True)  # no block table: the null block, as graphcap's own batches
    check_invariants(inputs, "off")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "seq_lens", "rows": "reqs"}, r"'seq_lens' is a built-in field"),
        ({"name": "x y", "rows": "reqs"}, r"name: must be a Python identifier"),
        ({"name": "x", "rows": "blocks"}, r"rows: must be tokens, reqs, reqs\+1 or none"),
        ({"name": "x", "rows": "reqs", "dtype": "bfloat16"}, r"dtype: must be one of int8"),
        ({"name": "x", "rows": "reqs", "dtype": "uint8", "pad": -1}, r"pad: -1 is not a value of dtype uint8"),
        ({"name": "x", "rows": "reqs", "shape": (0,)}, r"shape: must be a list of up to 4 dimensions"),
        ({"name": "x", "rows": "reqs", "row_dim": 1}, r"row_dim: must be an integer in 0\.\.0"),
        ({"name": "x", "rows": "reqs", "check": 3}, r"check: must be callable"),
    ],
)
def test_bad_buffer_declarations_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BufferSpec(**kwargs)


def test_buffers_from_yaml_match_buffer_specs():
    text = """
buffers:
  - {name: mrope_positions, rows: tokens, shape: [3], dtype: int64, row_dim: 1}
  - {name: temperature, rows: reqs, dtype: float32, pad: 1.0}
"""
    config = config_from_text(text)
    assert tuple(map(BufferSpec.from_config, config.buffers)) == (ENGINE_BUFFERS[0], ENGINE_BUFFERS[2])
    assert config_from_text(__import__("yaml").safe_dump(config.to_dict())) == config  # round trip


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("buffers: {name: x}", r"buffers: must be a list of buffer mappings"),
        ("buffers:\n  - 3", r"buffers\[0\]: must be a mapping"),
        ("buffers:\n  - {rows: reqs}", r"buffers\[0\]\.name: is required"),
        ("buffers:\n  - {name: x, colour: red}", r"buffers\[0\]\.colour: unknown key"),
        ("buffers:\n  - {name: x, dtype: int4}", r"buffers\[0\]\.dtype: expected int8"),
        ("buffers:\n  - {name: x, dtype: uint8, pad: 300}", r"buffers\[0\]\.pad: 300 is not a value of dtype uint8"),
        ("buffers:\n  - {name: x}\n  - {name: x}", r"buffers\[1\]\.name: 'x' is declared twice"),
    ],
)
def test_bad_buffers_yaml_names_the_entry_and_key(text, match):
    with pytest.raises(ConfigError, match=match):
        config_from_text(text)


class ExtrasModel(torch.nn.Module):
    """The reference model whose logits depend on two engine buffers, as a sampler's inputs would."""

    def __init__(self, config) -> None:
        super().__init__()
        self.inner = build_model(config)
        self.lora_bias = torch.nn.Parameter(torch.randn(5, config.model.vocab_size), requires_grad=False)

    def forward(self, inputs) -> torch.Tensor:
        logits = self.inner(inputs)  # [T, vocab]
        lora = inputs.extras["lora_index"].long()  # [T], -1: no adapter
        bias = self.lora_bias.index_select(0, lora.clamp(min=0)) * (lora >= 0).unsqueeze(1)
        # per-request temperature, spread to the request's tokens (padded tokens: the sink request)
        qsl = inputs.query_start_loc
        T, R = inputs.input_ids.shape[0], inputs.seq_lens.shape[0]
        repeats = torch.cat((qsl.diff(), T - qsl[R:]))
        req = torch.repeat_interleave(torch.arange(R + 1), repeats, output_size=T)
        temperature = torch.cat((inputs.extras["temperature"], inputs.extras["temperature"].new_ones(1)))
        return (logits + bias) / temperature.index_select(0, req).unsqueeze(1)


@given(seed=st.integers(0, 50), num_reqs=st.integers(1, 6))
@settings(max_examples=15, deadline=None)
def test_engine_buffers_replay_equal_to_eager(seed, num_reqs):
    config = make_config()
    specs = [BufferSpec("lora_index", "tokens", pad=-1), BufferSpec("temperature", "reqs", dtype="float32", pad=1.0)]
    manager = _MANAGERS.get("extras") or _MANAGERS.setdefault("extras", _captured(config, specs))
    rng = np.random.default_rng(seed)
    q = rng.integers(1, 3, num_reqs)
    seq = q + rng.integers(0, 8, num_reqs)
    blocks = np.arange(1, 1 + num_reqs * 8).reshape(num_reqs, 8)
    extras = {"lora_index": rng.integers(-1, 5, int(q.sum())), "temperature": rng.uniform(0.2, 2, num_reqs)}
    batch = StepBatch(q, seq, rng.integers(0, 128, int(q.sum())), blocks, extras=extras)
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))


_MANAGERS: dict[str, CaptureManager] = {}


def _captured(config, specs) -> CaptureManager:
    manager = CaptureManager(ExtrasModel(config), config, progress=False, buffers=specs)
    manager.capture()
    return manager


def test_yaml_buffers_reach_the_manager():
    config = make_config()
    text = __import__("yaml").safe_dump(
        {**nested(TINY), "buffers": [{"name": "temperature", "rows": "reqs", "dtype": "float32", "pad": 1.0}]}
    )
    config = config_from_text(text)
    manager = CaptureManager(
        build_model(config), config, progress=False, buffers=[BufferSpec("lora_index", "tokens", pad=-1)]
    )
    assert [s.name for s in manager.buffers.extras] == ["temperature", "lora_index"]
    with pytest.raises(
        ConfigError,
        match=r"buffers\[0\]: 'temperature' is also passed in code as a BufferSpec, declared differently "
        r"\(dtype 'float32' vs 'int32', pad 1.0 vs 0; config vs code\)",
    ):
        CaptureManager(build_model(config), config, progress=False, buffers=[BufferSpec("temperature", "reqs")])


class WholeBufferModel(torch.nn.Module):
    """The reference model scaled by a `none` engine buffer: a scalar, or a (6,) vector read whole."""

    def __init__(self, config, shape: tuple[int, ...], frozen: bool = False) -> None:
        super().__init__()
        self.inner, self.frozen, self.seen = build_model(config), frozen, set()
        self.mix = torch.nn.Parameter(torch.randn(*shape, config.model.vocab_size), requires_grad=False)

    def forward(self, inputs) -> torch.Tensor:
        scale = inputs.extras["scale"]  # [] or [6]: the whole tensor every step
        self.seen.add(tuple(scale.shape))
        if self.frozen:  # a host value read as a Python number: the graph keeps the capture's
            scale = torch.tensor(inputs.host.extras["scale"].tolist(), dtype=scale.dtype)
        return self.inner(inputs) * (scale.unsqueeze(-1) * self.mix).reshape(-1, self.mix.shape[-1]).sum(0)


def _whole_spec(shape: tuple[int, ...]) -> BufferSpec:
    return BufferSpec(
        "scale", "none", shape=shape, dtype="float32", pad=1.0, sample=lambda rng, rows: rng.uniform(0.5, 2, shape)
    )


@pytest.mark.parametrize("shape", [(), (6,)])
def test_a_none_buffer_reaches_every_key_and_step_whole(shape):
    config = make_config(capture__sizes=[2, 4])  # keys of 2 and 4 request rows: neither may slice a (6,) buffer
    model = WholeBufferModel(config, shape)
    manager = CaptureManager(model, config, progress=False, buffers=[_whole_spec(shape)])
    report = manager.capture()  # a scalar buffer once crashed every capture with an IndexError
    assert report.records and all(r.verified for r in report.records)  # verified with sampled values
    assert model.seen == {shape}
    value = np.linspace(0.5, 1.5, 6)[: int(np.prod(shape))].reshape(shape).astype(np.float32)
    batch = StepBatch([2, 1], [3, 4], [5, 6, 7], [[1], [2]], extras={"scale": value})  # key (4 tokens, 4 reqs)
    got = manager.execute(batch).clone()
    assert manager.last_key.num_reqs < 6 and model.seen == {shape}
    torch.testing.assert_close(got, manager.eager(batch))
    assert manager.buffers.host["scale"].tolist() == value.tolist()


def test_verification_runs_a_none_buffer_with_sampled_values_and_names_a_frozen_read():
    config = make_config(capture__sizes=[4])
    model = WholeBufferModel(config, (6,), frozen=True)
    manager = CaptureManager(model, config, progress=False, buffers=[_whole_spec((6,))])
    with pytest.raises(CaptureError, match=r"replay differs from eager .*froze a host value at capture"):
        manager.capture()


def test_a_buffer_declared_alike_in_yaml_and_code_is_one_buffer_with_the_codes_sample_and_check():
    config = make_config({"buffers": [{"name": "temperature", "rows": "reqs", "dtype": "float32", "pad": 1.0}]})
    checked = []
    spec = BufferSpec(
        "temperature", "reqs", dtype="float32", pad=1.0, check=lambda view, rows: checked.append(rows),
        sample=lambda rng, rows: rng.uniform(0.5, 1.5, rows),
    )  # fmt: skip
    manager = CaptureManager(build_model(config), config, progress=False, buffers=[spec])
    assert manager.buffers.extras == (spec,) and manager.buffers.extras[0].check is spec.check
    manager.execute(StepBatch([1, 2], [3, 4], extras={"temperature": [0.7, 1.3]}))
    assert checked == [2]


def test_buffers_are_reachable_by_overrides_and_set():
    entry = {"name": "lora_index", "rows": "tokens", "pad": -1}
    assert [b.name for b in make_config({"buffers": [entry]}).buffers] == ["lora_index"]
    overrides = parse_overrides(["buffers=[{name: lora_index, rows: tokens, pad: -1}]"])  # --set
    assert make_config(overrides).buffers == make_config({"buffers": [entry]}).buffers
    with pytest.raises(ConfigError, match=r"override: buffers\[0\]\.rows: expected tokens \| reqs \| reqs\+1 \| none"):
        make_config({"buffers": [{"name": "lora_index", "rows": "token"}]})
