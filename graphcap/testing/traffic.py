"""Traffic histograms (token count -> steps) of a chunked-prefill scheduler, for choosing sizes.

`traffic_histogram(shape, seed)` replays a small model of vLLM's default scheduler: requests
arrive at a rate that swells and ebbs (a day of traffic in a few thousand steps), each step
first decodes one token for every running request, then spends what is left of the token
budget (512) on prompt chunks, oldest request first, admitting new requests while fewer than
`max_num_seqs` (256) run. A step's token count is decodes plus prefill chunks, so decode-only
steps spread over 1-256 and prefill steps pile up at the budget. Prompt and output lengths are
log-normal. Deterministic for a seed; no torch, no numpy.

`adapter_steps(shape, seed)` runs the same steps with a LoRA adapter per request, and counts the
distinct adapters each step runs (a key axis, `capture.axes.lora`).

`TRAFFIC_SHAPES` names the shapes `tests/test_size_choice.py` and `tools/bench_capture.py
--padding` share.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["TRAFFIC_SHAPES", "TrafficShape", "adapter_steps", "traffic_histogram"]


@dataclass(frozen=True, slots=True)
class TrafficShape:
    """Request mix of one traffic shape (lengths are medians of log-normal draws, in tokens)."""

    arrivals: float
    """Mean new requests per step at the peak of the day."""
    prompt: int
    """Median prompt length."""
    output: int
    """Median output length."""
    spread: float = 0.8
    """Sigma of the log-normal lengths."""
    token_budget: int = 512
    """Most tokens per step (vLLM's `max_num_batched_tokens`)."""
    max_num_seqs: int = 256
    """Most running requests."""


TRAFFIC_SHAPES: dict[str, TrafficShape] = {
    "decode-heavy": TrafficShape(arrivals=0.4, prompt=96, output=400),
    "light-decode": TrafficShape(arrivals=0.12, prompt=200, output=300),
    "chat-chunked": TrafficShape(arrivals=0.3, prompt=900, output=250),
    "prefill-heavy": TrafficShape(arrivals=0.15, prompt=2000, output=80, spread=1.0),
    "long-context": TrafficShape(arrivals=0.05, prompt=6000, output=300, spread=0.6),
}
"""Decode-heavy and mixed chunked-prefill traffic up to 512 tokens per step."""


def traffic_histogram(shape: str | TrafficShape, seed: int, num_steps: int = 6000) -> Counter[int]:
    """Steps by token count over `num_steps` scheduler steps (idle steps, with nothing to run, are
    not steps). `shape` is a `TrafficShape` or a name in `TRAFFIC_SHAPES`."""
    counts: Counter[int] = Counter()
    for tokens, _ in _steps(shape, seed, num_steps, None):
        counts[tokens] += 1
    return counts


def adapter_steps(
    shape: str | TrafficShape, seed: int, num_steps: int = 6000, *, adapters: int = 16, base_share: float = 0.5
) -> Counter[tuple[int, tuple[tuple[str, int], ...]]]:
    """The steps of `traffic_histogram` (the same token counts) with the LoRA adapters they use: each request
    gets, on arrival, no adapter (the base model, with odds `base_share`) or one of `adapters` adapters by a
    Zipf law (the k-th as likely as 1 / k); a step's `lora` value is the distinct adapters among the requests
    it runs (decodes and prefill chunks). Keyed `(tokens, (("lora", value),))`, as `graphcap.sizing.axes`
    takes steps. The adapters draw from a generator of their own, so the token counts are the histogram's."""
    weights = [1 / k for k in range(1, adapters + 1)]
    picks = random.Random(f"adapters-{seed}")

    def adapter() -> int:
        if picks.random() < base_share:
            return 0
        return picks.choices(range(1, adapters + 1), weights)[0]

    counts: Counter[tuple[int, tuple[tuple[str, int], ...]]] = Counter()
    for tokens, used in _steps(shape, seed, num_steps, adapter):
        counts[tokens, (("lora", len(used - {0})),)] += 1
    return counts


def _steps(shape: str | TrafficShape, seed: int, num_steps: int, adapter: Any) -> Iterator[tuple[int, set[int]]]:
    """`(tokens, adapters of the requests run)` per step that runs any; `adapter()` draws a request's (None:
    every request 0, and no draw)."""
    mix = TRAFFIC_SHAPES[shape] if isinstance(shape, str) else shape
    rng = random.Random(seed)
    decoding: list[tuple[int, int]] = []  # heap of (the step at which each decoding request finishes, its adapter)
    prefilling: deque[list[int]] = deque()  # [prompt tokens left, output length, adapter], oldest first
    waiting: deque[list[int]] = deque()
    for step in range(num_steps):
        # Arrivals swell and ebb over the run, so the running batch sweeps its range.
        rate = mix.arrivals * (0.55 + 0.45 * math.sin(2 * math.pi * step / num_steps * 3))
        for _ in range(_poisson(rng, rate)):
            lengths = [_length(rng, mix.prompt, mix.spread), _length(rng, mix.output, mix.spread)]
            waiting.append([*lengths, adapter() if adapter else 0])
        while decoding and decoding[0][0] <= step:
            heapq.heappop(decoding)
        budget = mix.token_budget - min(len(decoding), mix.token_budget)
        used = {a for _, a in decoding[: mix.token_budget]} if adapter else set()
        for request in prefilling:
            chunk = min(request[0], budget)
            request[0] -= chunk
            budget -= chunk
            if chunk and adapter:
                used.add(request[2])
        while waiting and budget and len(decoding) + len(prefilling) < mix.max_num_seqs:
            request = waiting.popleft()
            chunk = min(request[0], budget)
            request[0] -= chunk
            budget -= chunk
            prefilling.append(request)
            if chunk and adapter:
                used.add(request[2])
        done = [r for r in prefilling if r[0] == 0]
        prefilling = deque(r for r in prefilling if r[0])
        for _, output, lora in done:  # the last prompt chunk samples the first token
            heapq.heappush(decoding, (step + output, lora))
        tokens = mix.token_budget - budget
        if tokens:
            yield tokens, used


def _length(rng: random.Random, median: int, spread: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(median), spread)))


def _poisson(rng: random.Random, mean: float) -> int:
    # Knuth's product of uniforms: exact, and cheap for the small means used here.
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k
