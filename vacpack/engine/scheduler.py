"""Continuous batching: which requests run in the next step, and how many tokens each.

Every step has a token budget. Running requests go first, in the order they were admitted, each
taking what it still needs (one token for a decode, the rest of its prompt for a prefill, cut to
the budget: chunked prefill). Waiting requests are then admitted first-come first-served while
budget, sequence slots and KV pages last. When a running request needs a page and none is free,
the most recently admitted request is preempted: its pages are freed, and it goes back to the
front of the queue to be recomputed later. Earlier requests are never preempted for later ones, so
no request starves, and as the cache holds at least one whole sequence there is no deadlock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from vacpack.engine.request import Request, RequestStatus
from vacpack.kvcache.page_allocator import PageAllocator


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new one is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes (one new token) first, then prefill chunks
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._reserve_pages(request, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                index += 1

        # After a preemption memory is tight: admitting more would only preempt again.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_pages(request, request.num_computed_tokens + num_new):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # stable: decodes first
        return SchedulerOutput(scheduled, preempted)

    def finish(self, request: Request) -> None:
        """Removes a finished or aborted request and frees its pages."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.allocator.free(request.page_table)
        request.page_table = []
        request.status = RequestStatus.FINISHED

    def _reserve_pages(self, request: Request, num_tokens: int) -> bool:
        num_needed = -(-num_tokens // self.config.page_size) - len(request.page_table)
        if num_needed <= 0:
            return True
        if num_needed > self.allocator.num_free_pages:
            return False
        request.page_table.extend(self.allocator.allocate(num_needed))
        return True

    def _preempt(self, request: Request) -> None:
        self.allocator.free(request.page_table)
        request.page_table = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        self.waiting.appendleft(request)
