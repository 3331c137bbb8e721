"""The corpus bin budget: its search over doubling probe forwards, timed on a fake clock so
that each test states the rates it is about, and the memory per token the probes measure."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator

import pytest
import torch

from vacpack.corpus import budget as budget_module
from vacpack.corpus.budget import (
    FIRST_PROBE_TOKENS,
    NOISY_FORWARD_S,
    SHORT_FORWARD_S,
    THROUGHPUT_TOLERANCE,
    BinBudget,
    measure_bin_budget,
)
from vacpack.host_memory import PeakAllocation, can_measure

CPU = torch.device("cpu")


class FakeClock:
    """perf_counter for the budget module: a forward advances it by the seconds it is given."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self.forwards: list[int] = []

    def perf_counter(self) -> float:
        return self.now_s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeClock]:
    fake = FakeClock()
    fake_time = types.SimpleNamespace(perf_counter=fake.perf_counter)
    monkeypatch.setattr(budget_module, "time", fake_time)
    yield fake


def timed_forward(clock: FakeClock, seconds: Callable[[int, int], float]) -> Callable[[int], None]:
    """A forward of n tokens taking seconds(n, how many forwards of n ran before)."""

    def forward(num_tokens: int) -> None:
        clock.now_s += seconds(num_tokens, clock.forwards.count(num_tokens))
        clock.forwards.append(num_tokens)

    return forward


def probed_sizes(clock: FakeClock) -> list[int]:
    return sorted(set(clock.forwards))


def test_a_given_budget_bounds_every_forward() -> None:
    budget = BinBudget.given(512)
    assert budget.tokens == budget.max_forward_tokens == 512
    with pytest.raises(ValueError, match="max_forward_tokens"):
        BinBudget(512, "measured", 256)


def test_a_fast_short_probe_does_not_stop_the_search(clock: FakeClock) -> None:
    """256 tokens timed as fastest (as a noisy short probe can be) and 512 slower: the search
    goes on past forwards too short to time well and settles on the fastest long-enough bin,
    before a size measured slower than it."""
    seconds = {256: 0.002, 512: 0.02, 1024: 0.04, 2048: 0.11, 4096: 0.25, 8192: 0.5}
    assert seconds[2048] > NOISY_FORWARD_S and seconds[4096] / 2 > seconds[2048]
    forward = timed_forward(clock, lambda n, _: seconds[n])
    assert measure_bin_budget(forward, CPU, max_tokens=8192).tokens == 2048
    assert probed_sizes(clock) == [256, 512, 1024, 2048, 4096]


def test_small_gains_per_doubling_do_not_stop_the_search_while_forwards_are_short(
    clock: FakeClock,
) -> None:
    """Each doubling 3% faster, under the tolerance (a CPU's GEMMs with twice the rows): the
    search doubles on until a forward takes SHORT_FORWARD_S, and then stops."""
    gain_per_doubling = 0.03
    assert gain_per_doubling < THROUGHPUT_TOLERANCE
    first_rate = FIRST_PROBE_TOKENS / 0.05  # tokens/s; a 256-token forward takes 50 ms

    def seconds(num_tokens: int, _: int) -> float:
        doublings = (num_tokens // FIRST_PROBE_TOKENS).bit_length() - 1
        return num_tokens / (first_rate * (1 + gain_per_doubling) ** doublings)

    budget = measure_bin_budget(timed_forward(clock, seconds), CPU, max_tokens=1 << 20)
    # The first size whose forward reaches SHORT_FORWARD_S is the last probed.
    expected = FIRST_PROBE_TOKENS
    while seconds(expected, 0) < SHORT_FORWARD_S:
        expected *= 2
    assert budget.tokens == expected == max(probed_sizes(clock))
    assert expected >= 8 * FIRST_PROBE_TOKENS


def test_a_large_gain_goes_on_past_short_forwards(clock: FakeClock) -> None:
    """Throughput that keeps growing by 20% per doubling (a GPU filling up) is followed to the
    search's bound, whatever the forwards' length."""
    forward = timed_forward(clock, lambda n, _: 1.0 * (n / FIRST_PROBE_TOKENS) ** 0.7)
    assert measure_bin_budget(forward, CPU, max_tokens=4096).tokens == 4096


def test_one_slow_reading_is_timed_again_before_it_ends_the_search(clock: FakeClock) -> None:
    """2,048 tokens' first three forwards (warm-up and both timed runs) are slowed, as another
    process on the host can slow them; the second look, right after one more of the best size
    (1,024), reads its true rate and the search goes on."""
    rate = 10_000.0  # tokens/s at every size: the search ends where forwards grow long

    def seconds(num_tokens: int, runs_before: int) -> float:
        slowdown = 1.5 if num_tokens == 2048 and runs_before < 3 else 1.0
        return slowdown * num_tokens / rate

    budget = measure_bin_budget(timed_forward(clock, seconds), CPU, max_tokens=1 << 20)
    assert clock.forwards.count(2048) == 5  # warm-up, two timed, two timed again
    # The second look: the best size's two timed runs, then 2,048's.
    assert clock.forwards[12:16] == [1024, 1024, 2048, 2048]
    assert budget.tokens == 8192  # the first forward of SHORT_FORWARD_S or more
    assert 8192 / rate >= SHORT_FORWARD_S > 4096 / rate


def test_a_size_slower_on_both_looks_ends_the_search(clock: FakeClock) -> None:
    """4,096 tokens 20% slower than 2,048 each time: timed again after 2,048 was, still
    slower, it ends the search and 2,048 is the budget."""
    rate = 10_000.0

    def seconds(num_tokens: int, _: int) -> float:
        return num_tokens / (rate * (0.8 if num_tokens >= 4096 else 1.0))

    budget = measure_bin_budget(timed_forward(clock, seconds), CPU, max_tokens=1 << 20)
    assert budget.tokens == 2048
    assert max(probed_sizes(clock)) == 4096
    assert clock.forwards[-4:] == [2048, 2048, 4096, 4096]


@pytest.mark.skipif(not can_measure(), reason="needs glibc's mallinfo2")
def test_the_probe_measures_memory_per_token_and_bounds_long_forwards() -> None:
    bytes_per_token = 64 * 1024

    def forward(num_tokens: int) -> None:
        # Live long enough for the sampler to see it, as a model's activations are.
        activations = torch.ones(num_tokens * bytes_per_token // 4, dtype=torch.float32)
        for _ in range(20):
            activations.mul_(1.0)

    with PeakAllocation() as peak:
        forward(512)
    assert peak.bytes >= 512 * bytes_per_token * 0.9

    budget = measure_bin_budget(forward, CPU, max_tokens=1024)
    assert "KiB/token" in budget.source
    assert budget.max_forward_tokens > budget.tokens
