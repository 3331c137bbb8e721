"""The scheduler on its own: token budget, running cap, FIFO admission, preemption, and the
priority policy's order."""

from __future__ import annotations

import pytest
from scheduler_helpers import add_sequence, finish, run_step

from vacpack.engine.request import SequenceStatus
from vacpack.engine.scheduler import Scheduler, SchedulerConfig
from vacpack.kvcache.page_pool import PagePool

PAGE_SIZE = 4


def test_budget_chunks_prefill_and_mixes_decodes() -> None:
    scheduler = Scheduler(
        SchedulerConfig(8, 10, PAGE_SIZE), PagePool(100, PAGE_SIZE, enable_prefix_caching=False)
    )
    add_sequence(scheduler, "a", list(range(3)))
    add_sequence(scheduler, "b", list(range(25)))
    assert run_step(scheduler) == {"a": 3, "b": 7}
    # a decodes (1 token) while b's prompt continues in chunks under the budget of 10.
    assert run_step(scheduler) == {"a": 1, "b": 9}
    assert run_step(scheduler) == {"a": 1, "b": 9}
    step = scheduler.schedule()
    assert [c.sequence.request.request_id for c in step.chunks] == ["a", "b"]  # decodes first
    assert sum(c.num_new_tokens for c in step.chunks) <= 10


def test_running_cap_and_fifo_admission() -> None:
    scheduler = Scheduler(
        SchedulerConfig(2, 100, PAGE_SIZE), PagePool(100, PAGE_SIZE, enable_prefix_caching=False)
    )
    for name in "abcd":
        add_sequence(scheduler, name, list(range(5)))
    assert set(run_step(scheduler)) == {"a", "b"}
    finish(scheduler, scheduler.running[0])
    assert set(run_step(scheduler)) == {"b", "c"}


def test_head_of_queue_is_not_overtaken_when_pages_run_short() -> None:
    scheduler = Scheduler(
        SchedulerConfig(8, 100, PAGE_SIZE), PagePool(6, PAGE_SIZE, enable_prefix_caching=False)
    )
    add_sequence(scheduler, "big", list(range(20)))  # 5 pages
    add_sequence(scheduler, "huge", list(range(40)))  # 10 pages: does not fit while big runs
    add_sequence(scheduler, "small", list(range(2)))  # would fit, but must wait its turn
    assert run_step(scheduler) == {"big": 20}
    assert run_step(scheduler) == {"big": 1}
    assert [s.request.request_id for s in scheduler.waiting] == ["huge", "small"]


def test_preemption_takes_the_latest_admitted_and_requeues_it_first() -> None:
    allocator = PagePool(4, PAGE_SIZE, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(8, 100, PAGE_SIZE), allocator)
    first = add_sequence(scheduler, "first", list(range(8)))
    second = add_sequence(scheduler, "second", list(range(8)))
    assert run_step(scheduler) == {"first": 8, "second": 8}  # all 4 pages used
    output = scheduler.schedule()  # first needs a 3rd page for its next token
    assert output.preempted == [second]
    assert [c.sequence for c in output.chunks] == [first]
    assert second.status is SequenceStatus.WAITING and second.num_computed_tokens == 0
    assert scheduler.waiting[0] is second
    assert allocator.num_free_pages == 4 - len(first.page_table)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_policy_picks_whom_to_admit_and_whom_to_preempt(policy: str) -> None:
    allocator = PagePool(4, PAGE_SIZE, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(8, 100, PAGE_SIZE, policy=policy), allocator)
    low = add_sequence(scheduler, "low", list(range(7)), priority=5)  # 2 pages, room for 1
    assert run_step(scheduler) == {"low": 7}
    urgent = add_sequence(scheduler, "urgent", list(range(7)), priority=0)
    add_sequence(scheduler, "later", list(range(3)), priority=5)
    assert run_step(scheduler) == {"low": 1, "urgent": 7}  # all 4 pages used; later waits
    output = scheduler.schedule()  # low's next token needs a 5th page
    # fcfs: the latest admitted yields; priority: the least urgent, the earlier one here.
    assert output.preempted == ([urgent] if policy == "fcfs" else [low])
    waiting = [s.request.request_id for s in scheduler.waiting]
    # A preempted sequence goes first (fcfs), or ahead of later arrivals of its priority.
    assert waiting == (["urgent", "later"] if policy == "fcfs" else ["low", "later"])


def test_priority_orders_the_waiting_queue_and_the_running_share() -> None:
    scheduler = Scheduler(
        SchedulerConfig(8, 10, PAGE_SIZE, policy="priority"),
        PagePool(100, PAGE_SIZE, enable_prefix_caching=False),
    )
    for name, priority in (("a", 2), ("b", -1), ("c", 2), ("d", 0)):
        add_sequence(scheduler, name, list(range(6)), priority=priority)
    assert [s.request.request_id for s in scheduler.waiting] == ["b", "d", "a", "c"]
    assert run_step(scheduler) == {"b": 6, "d": 4}  # the budget of 10 goes by urgency
    assert [s.request.request_id for s in scheduler.running] == ["b", "d"]
    assert run_step(scheduler) == {"b": 1, "d": 2, "a": 6, "c": 1}


@pytest.mark.parametrize("num_pages", [3, 5, 8])
def test_pages_are_all_returned(num_pages: int) -> None:
    allocator = PagePool(num_pages, PAGE_SIZE, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(4, 16, PAGE_SIZE), allocator)
    for i in range(5):
        add_sequence(scheduler, str(i), list(range(3 + i)))
    for _ in range(200):
        run_step(scheduler)
        for sequence in list(scheduler.running):
            if sequence.num_output_tokens >= 3:
                finish(scheduler, sequence)
        if not scheduler.num_unfinished_sequences:
            break
    assert scheduler.num_unfinished_sequences == 0
    assert allocator.num_free_pages == num_pages
