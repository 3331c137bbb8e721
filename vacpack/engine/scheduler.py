"""Continuous batching: which requests run in the next step, and how many tokens each.

Every step has a token budget. Running requests go first, in the order they were admitted, each
taking what it still needs (one token for a decode, the rest of its prompt for a prefill, cut to
the budget: chunked prefill). Waiting requests are then admitted first-come first-served while
budget, sequence slots and KV pages last. When a running request needs a page and none is free,
the most recently admitted request is preempted: its pages are freed, and it goes back to the
front of the queue to be recomputed later. Earlier requests are never preempted for later ones, so
no request starves, and as the cache holds at least one whole sequence there is no deadlock.

With prefix caching, a request admitted (or re-admitted after preemption) first takes the
cached pages of its longest cached prefix and computes only the rest; after each step the
pages it has filled are indexed for others. The samples of an n > 1 request wait for the first
sample's prompt pages, so the prompt is computed once for all of them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from vacpack.engine.request import Request, RequestStatus
from vacpack.kvcache.page_pool import PagePool, page_hashes


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
    def __init__(self, config: SchedulerConfig, pool: PagePool) -> None:
        self.config = config
        self.pool = pool
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
        position = 0
        while (
            not preempted
            and position < len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[position]
            if self._waits_for_leader(request):
                position += 1  # the only overtaking allowed: its leader is still prefilling
                continue
            self._take_cached_prefix(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_pages(request, request.num_computed_tokens + num_new):
                self._release(request)
                break  # first come, first served: nobody overtakes the head of the queue
            del self.waiting[position]
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
        self._release(request)
        request.status = RequestStatus.FINISHED

    def register_computed_pages(self, request: Request) -> None:
        """Indexes the pages the request has filled completely, for others to reuse."""
        if not self.pool.enable_prefix_caching:
            return
        num_full_pages = request.num_computed_tokens // self.config.page_size
        num_hashed = len(request.page_hashes)
        if num_full_pages <= num_hashed:
            return
        page_size = self.config.page_size
        parent = request.page_hashes[-1] if request.page_hashes else None
        new_tokens = request.token_ids[num_hashed * page_size : num_full_pages * page_size]
        for offset, page_hash in enumerate(page_hashes(new_tokens, page_size, parent)):
            self.pool.register(request.page_table[num_hashed + offset], page_hash)
            request.page_hashes.append(page_hash)

    def _take_cached_prefix(self, request: Request) -> None:
        if request.page_table or request.wants_prompt_logprobs:
            return  # prompt logprobs need every prompt position's logits: compute them all
        # At least the last token is computed, so that there are logits to sample from.
        max_pages = (request.num_tokens - 1) // self.config.page_size
        pages, hashes = self.pool.match_prefix(request.token_ids, max_pages)
        request.page_table = pages
        request.page_hashes = hashes
        request.num_computed_tokens = len(pages) * self.config.page_size
        if request.num_output_tokens == 0:
            request.num_cached_prompt_tokens = request.num_computed_tokens

    def _waits_for_leader(self, request: Request) -> bool:
        leader = request.prefix_leader
        if leader is None or not self.pool.enable_prefix_caching or leader.is_finished:
            return False
        full_prompt_tokens = (leader.num_prompt_tokens - 1) // self.config.page_size
        return leader.num_computed_tokens < full_prompt_tokens * self.config.page_size

    def _release(self, request: Request) -> None:
        self.pool.free(request.page_table)
        request.page_table = []
        request.page_hashes = []
        request.num_computed_tokens = 0

    def _reserve_pages(self, request: Request, num_tokens: int) -> bool:
        num_needed = -(-num_tokens // self.config.page_size) - len(request.page_table)
        if num_needed <= 0:
            return True
        if num_needed > self.pool.num_free_pages:
            return False
        request.page_table.extend(self.pool.allocate(num_needed))
        return True

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        self.waiting.appendleft(request)
