"""The scheduler on its own: token budget, running cap, FIFO admission, preemption."""

from __future__ import annotations

import pytest

from vacpack.engine.request import Request, RequestStatus
from vacpack.engine.scheduler import Scheduler, SchedulerConfig
from vacpack.kvcache.page_pool import PagePool
from vacpack.outputs import RequestMetrics
from vacpack.sampling import SamplingParams

PAGE_SIZE = 4


def _request(name: str, prompt_len: int) -> Request:
    return Request(
        request_id=name,
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(max_tokens=100),
        stop_token_ids=frozenset(),
        max_total_tokens=1000,
        generator=None,
        detokenizer=None,
        metrics=RequestMetrics(0.0),
    )


def _run_step(scheduler: Scheduler) -> dict[str, int]:
    """Schedules one step and applies it as the engine would (a sampled token is appended)."""
    output = scheduler.schedule()
    for item in output.scheduled:
        samples = item.samples
        item.request.num_computed_tokens += item.num_new_tokens
        if samples:
            item.request.token_ids.append(7)
    return {item.request.request_id: item.num_new_tokens for item in output.scheduled}


def test_budget_chunks_prefill_and_mixes_decodes() -> None:
    scheduler = Scheduler(
        SchedulerConfig(8, 10, PAGE_SIZE), PagePool(100, PAGE_SIZE, enable_prefix_caching=False)
    )
    scheduler.add(_request("a", 3))
    scheduler.add(_request("b", 25))
    assert _run_step(scheduler) == {"a": 3, "b": 7}
    # a decodes (1 token) while b's prompt continues in chunks under the budget of 10.
    assert _run_step(scheduler) == {"a": 1, "b": 9}
    assert _run_step(scheduler) == {"a": 1, "b": 9}
    step = scheduler.schedule()
    assert [s.request.request_id for s in step.scheduled] == ["a", "b"]  # decodes first
    assert sum(s.num_new_tokens for s in step.scheduled) <= 10


def test_running_cap_and_fifo_admission() -> None:
    scheduler = Scheduler(
        SchedulerConfig(2, 100, PAGE_SIZE), PagePool(100, PAGE_SIZE, enable_prefix_caching=False)
    )
    for name in "abcd":
        scheduler.add(_request(name, 5))
    assert set(_run_step(scheduler)) == {"a", "b"}
    scheduler.finish(scheduler.running[0])
    assert set(_run_step(scheduler)) == {"b", "c"}


def test_head_of_queue_is_not_overtaken_when_pages_run_short() -> None:
    scheduler = Scheduler(
        SchedulerConfig(8, 100, PAGE_SIZE), PagePool(6, PAGE_SIZE, enable_prefix_caching=False)
    )
    scheduler.add(_request("big", 20))  # 5 pages
    scheduler.add(_request("huge", 40))  # 10 pages: does not fit while big runs
    scheduler.add(_request("small", 2))  # would fit, but must wait its turn
    assert _run_step(scheduler) == {"big": 20}
    assert _run_step(scheduler) == {"big": 1}
    assert [r.request_id for r in scheduler.waiting] == ["huge", "small"]


def test_preemption_takes_the_latest_admitted_and_requeues_it_first() -> None:
    allocator = PagePool(4, PAGE_SIZE, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(8, 100, PAGE_SIZE), allocator)
    first, second = _request("first", 8), _request("second", 8)
    scheduler.add(first)
    scheduler.add(second)
    assert _run_step(scheduler) == {"first": 8, "second": 8}  # all 4 pages used
    output = scheduler.schedule()  # first needs a 3rd page for its next token
    assert output.preempted == [second]
    assert [s.request for s in output.scheduled] == [first]
    assert second.status is RequestStatus.WAITING and second.num_computed_tokens == 0
    assert scheduler.waiting[0] is second
    assert allocator.num_free_pages == 4 - len(first.page_table)


@pytest.mark.parametrize("num_pages", [3, 5, 8])
def test_pages_are_all_returned(num_pages: int) -> None:
    allocator = PagePool(num_pages, PAGE_SIZE, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(4, 16, PAGE_SIZE), allocator)
    requests = [_request(str(i), 3 + i) for i in range(5)]
    for request in requests:
        scheduler.add(request)
    for _ in range(200):
        _run_step(scheduler)
        for request in list(scheduler.running):
            if request.num_output_tokens >= 3:
                scheduler.finish(request)
        if not scheduler.num_unfinished:
            break
    assert scheduler.num_unfinished == 0
    assert allocator.num_free_pages == num_pages
