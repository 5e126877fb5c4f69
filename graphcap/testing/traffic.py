"""Traffic histograms (token count -> steps) of a chunked-prefill scheduler, for choosing sizes.

`traffic_histogram(shape, seed)` replays a small model of vLLM's default scheduler: requests
arrive at a rate that swells and ebbs (a day of traffic in a few thousand steps), each step
first decodes one token for every running request, then spends what is left of the token
budget (512) on prompt chunks, oldest request first, admitting new requests while fewer than
`max_num_seqs` (256) run. A step's token count is decodes plus prefill chunks, so decode-only
steps spread over 1-256 and prefill steps pile up at the budget. Prompt and output lengths are
log-normal. Deterministic for a seed; no torch, no numpy.

`TRAFFIC_SHAPES` names the shapes `tests/test_size_choice.py` and `tools/bench_capture.py
--padding` share.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, deque
from dataclasses import dataclass

__all__ = ["TRAFFIC_SHAPES", "TrafficShape", "traffic_histogram"]


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
    mix = TRAFFIC_SHAPES[shape] if isinstance(shape, str) else shape
    rng = random.Random(seed)
    decoding: list[int] = []  # heap of the step at which each decoding request finishes
    prefilling: deque[list[int]] = deque()  # [prompt tokens left, output length], oldest first
    waiting: deque[list[int]] = deque()
    counts: Counter[int] = Counter()
    for step in range(num_steps):
        # Arrivals swell and ebb over the run, so the running batch sweeps its range.
        rate = mix.arrivals * (0.55 + 0.45 * math.sin(2 * math.pi * step / num_steps * 3))
        for _ in range(_poisson(rng, rate)):
            waiting.append([_length(rng, mix.prompt, mix.spread), _length(rng, mix.output, mix.spread)])
        while decoding and decoding[0] <= step:
            heapq.heappop(decoding)
        budget = mix.token_budget - min(len(decoding), mix.token_budget)
        for request in prefilling:
            chunk = min(request[0], budget)
            request[0] -= chunk
            budget -= chunk
        while waiting and budget and len(decoding) + len(prefilling) < mix.max_num_seqs:
            request = waiting.popleft()
            chunk = min(request[0], budget)
            request[0] -= chunk
            budget -= chunk
            prefilling.append(request)
        done = [r for r in prefilling if r[0] == 0]
        prefilling = deque(r for r in prefilling if r[0])
        for _, output in done:  # the last prompt chunk samples the first token
            heapq.heappush(decoding, step + output)
        tokens = mix.token_budget - budget
        if tokens:
            counts[tokens] += 1
    return counts


def _length(rng: random.Random, median: int, spread: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(median), spread)))


def _poisson(rng: random.Random, mean: float) -> int:
    # Knuth's product of uniforms: exact, and cheap for the small means used here.
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k
