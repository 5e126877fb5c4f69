"""Default samples of float and bool engine buffers (`BufferSpec` without `sample`): within a declared `domain`,
and in every verification batch unlike the batch the key was recorded with, so a host read is always seen."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap import BufferSpec, CaptureError, CaptureManager, StepBatch
from graphcap.config import ConfigError, config_from_text
from graphcap.models import build_model
from graphcap.staging.extras import default_sample
from graphcap.testing import make_config


class ProbabilityModel(torch.nn.Module):
    """The reference model plus each request's entropy term from `p`, a probability: NaN once `p` leaves [0, 1]."""

    def __init__(self, config) -> None:
        super().__init__()
        self.llama = build_model(config)

    def forward(self, inputs) -> torch.Tensor:
        p = torch.cat([inputs.extras["p"], inputs.extras["p"].new_full((1,), 0.5)])  # [R+1]: a sink request
        entropy = -(p * p.log() + (1 - p) * (1 - p).log())
        token = torch.arange(inputs.input_ids.shape[0], dtype=torch.int32)
        request = torch.searchsorted(inputs.query_start_loc[1:], token, right=True)  # [T] in [0, R]
        return self.llama(inputs) + entropy[request, None]


def _capture(model, spec: BufferSpec, **overrides):
    config = make_config({"capture.sizes": [2, 4], **overrides})
    manager = CaptureManager(model(config), config, progress=False, buffers=[spec])
    return manager, manager.capture()


def test_a_float_buffer_with_a_domain_is_sampled_within_it_and_every_key_verifies():
    spec = BufferSpec("p", "reqs", dtype="float32", pad=0.5, domain=(0.01, 0.99))
    manager, report = _capture(ProbabilityModel, spec)
    assert report.records and all(record.verified for record in report.captured)
    batch = StepBatch([1, 1, 1], [3, 4, 5], extras={"p": [0.2, 0.7, 0.4]})
    torch.testing.assert_close(manager.execute(batch).clone(), manager.eager(batch))


def test_without_a_domain_samples_leave_it_and_the_refusal_names_the_buffer_and_the_fix():
    spec = BufferSpec("p", "reqs", dtype="float32", pad=0.9)  # 0.9 * uniform(0.5, 2): above 1 in most rows
    with pytest.raises(
        CaptureError,
        match=r"replay and eager both hold NaN or inf at the same \d+ places: the values graphcap sampled for the "
        r"float engine buffer\(s\) 'p' \(within pad \* \[0\.5, 2\], no domain declared\).*"
        r"Declare BufferSpec\(domain=\(low, high\)\)",
    ):
        _capture(ProbabilityModel, spec)


@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 64), dtype=st.sampled_from(["float16", "float32"]))
@settings(max_examples=100, deadline=None)
def test_default_samples_stay_within_the_domain_as_stored(seed, rows, dtype):
    spec = BufferSpec("p", "reqs", dtype=dtype, pad=0.2, domain=(0.1, 0.3))
    for unlike in (False, True):
        out = default_sample(spec, np.random.default_rng(seed), (rows,), unlike_capture=unlike)
        assert out.dtype == np.dtype(dtype) and (out >= 0.1).all() and (out <= 0.3).all()


@pytest.mark.parametrize(
    "spec",
    [
        BufferSpec("x", "reqs", dtype="float16", pad=60000.0),  # pad * uniform(0.5, 2) clipped: one value once
        BufferSpec("x", "reqs", dtype="bool", pad=False),
        BufferSpec("x", "tokens", shape=(3,), dtype="float32", pad=0.0, row_dim=1),
        BufferSpec("x", "reqs", dtype="float64", pad=1.0, domain=(0.0, 1.0)),
    ],
    ids=["float16-60000", "bool", "float32-row_dim", "domain"],
)
def test_every_verification_sample_differs_from_the_recordings_in_its_first_real_value(spec):
    shape = (3, 1) if spec.row_dim else (1,)  # one real row: the batch with the least room to differ
    for seed in range(200):
        recording = default_sample(spec, np.random.default_rng([0, seed]), shape)
        verification = default_sample(spec, np.random.default_rng([1, seed]), shape, unlike_capture=True)
        assert recording.flat[0] != verification.flat[0], seed
    wide = default_sample(spec, np.random.default_rng(7), (1000,) if not spec.row_dim else (3, 1000))
    assert len(np.unique(wide)) > (1 if spec.dtype == "bool" else 100)  # no longer clipped to one value


class HostReader(torch.nn.Module):
    """The reference model scaled by the first request's value of `x`, read on the host: frozen at capture."""

    def __init__(self, config) -> None:
        super().__init__()
        self.llama = build_model(config)

    def forward(self, inputs) -> torch.Tensor:
        return self.llama(inputs) * (1 + float(inputs.host.extras["x"][0]))


@pytest.mark.parametrize(
    "spec", [BufferSpec("x", "reqs", dtype="float16", pad=60000.0), BufferSpec("x", "reqs", dtype="bool")]
)
def test_a_host_read_of_a_default_sampled_buffer_is_refused_at_every_key(spec):
    # Samples that matched the recording's (a float16 pad of 60000 clipped to one value, random bools) let the
    # frozen read pass 2 (float16) and 3 (bool) of these 8 keys.
    _, report = _capture(HostReader, spec, **{"capture.sizes": [1, 2, 4, 8], "capture.on_error": "skip"})
    assert len(report.records) == 8 and not report.captured
    assert all("replay differs from eager" in record.reason for record in report.records)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"domain": (1.0, 0.0)},
            r"domain: must be \[low, high\], two finite numbers with low < high; got \(1\.0, 0\.0\)",
        ),
        ({"domain": (0.0, float("inf"))}, r"domain: must be \[low, high\]"),
        ({"domain": (0.0,)}, r"domain: must be \[low, high\]"),
        ({"dtype": "int32", "pad": 0, "domain": (0, 1)}, r"domain: bounds the values graphcap samples for a float "),
        ({"pad": 2.0, "domain": (0.0, 1.0)}, r"pad: 2\.0 lies outside the buffer's domain \[0\.0, 1\.0\]"),
        ({"dtype": "float16", "domain": (0.0, 1e6)}, r"domain: \[0\.0, 1000000\.0\] holds values float16 cannot store"),
    ],
)
def test_a_bad_domain_is_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=rf"BufferSpec 'p': {match}"):
        BufferSpec("p", "reqs", **{"dtype": "float32", "pad": 0.5, **kwargs})


def test_a_domain_in_yaml_matches_the_buffer_spec_and_a_bad_one_names_the_key():
    config = config_from_text("buffers:\n  - {name: p, rows: reqs, dtype: float32, pad: 0.5, domain: [0, 1]}\n")
    assert BufferSpec.from_config(config.buffers[0]) == BufferSpec("p", "reqs", dtype="float32", pad=0.5, domain=(0, 1))
    assert config_from_text(__import__("yaml").safe_dump(config.to_dict())) == config  # round trip
    with pytest.raises(ConfigError, match=r"buffers\[0\]\.domain: must be \[low, high\]"):
        config_from_text("buffers:\n  - {name: p, rows: reqs, dtype: float32, pad: 0.5, domain: [1, 0]}\n")
    with pytest.raises(ConfigError, match=r"buffers\[0\]\.domain: expected a list of numbers or null; got 'x'"):
        config_from_text("buffers:\n  - {name: p, rows: reqs, dtype: float32, domain: x}\n")
