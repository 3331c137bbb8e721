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
pages it has filled are indexed for others. A waiting request whose next uncached page is being
computed right now by a running request waits for it (an exception to first come, first
served), so requests that share a prefix and arrive together (n > 1 samples, a common system
prompt, few-shot contexts) compute it once. The other exception: a request whose grammar is
still being compiled (structured outputs) waits, and the requests behind it go first.

With async scheduling, the next step is scheduled while the previous one still runs: request
lengths already count the tokens being sampled (see Request.num_pending_tokens), and a request
whose launched steps produce its last token (max_tokens, context limit) is not scheduled again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from vacpack.engine.request import Request, RequestStatus
from vacpack.kvcache.page_pool import PagePool


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
        # Hashes of the full pages running requests are computing and have not indexed yet.
        self._pages_in_flight: dict[int, int] = {}

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
            if request.all_tokens_scheduled:
                index += 1  # finishes by length once its launched steps are read
                continue
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
            if request.num_pending_tokens:
                break  # preempted with a token still being sampled: readmitted once it is read
            if request.constraints is not None and not request.constraints.is_ready:
                position += 1  # its grammar is being compiled: the requests behind it go first
                continue
            if self._next_page_in_flight(request):
                position += 1  # the one overtaking allowed: its prefix is being computed
                continue
            self._take_cached_prefix(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_pages(request, request.num_computed_tokens + num_new):
                self._release(request)
                break  # first come, first served: nobody overtakes the head of the queue
            del self.waiting[position]
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._announce_in_flight(request)
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
        new_hashes = request.full_page_hashes(self.config.page_size)[num_hashed:num_full_pages]
        for offset, page_hash in enumerate(new_hashes):
            self.pool.register(request.page_table[num_hashed + offset], page_hash)
            request.page_hashes.append(page_hash)
            self._landed(request, page_hash)

    def _take_cached_prefix(self, request: Request) -> None:
        if request.page_table:
            return
        max_pages = request.max_cached_tokens // self.config.page_size
        hashes = request.full_page_hashes(self.config.page_size)[:max_pages]
        pages = self.pool.match_prefix(hashes, request.num_tokens)
        request.page_table = pages
        request.page_hashes = hashes[: len(pages)]
        request.num_computed_tokens = len(pages) * self.config.page_size
        if request.num_output_tokens == 0:
            request.num_cached_prompt_tokens = request.num_computed_tokens

    def _next_page_in_flight(self, request: Request) -> bool:
        """True when the first page the request would compute is being computed by another."""
        if not self.pool.enable_prefix_caching or not self._pages_in_flight:
            return False
        max_pages = request.max_cached_tokens // self.config.page_size
        hashes = request.full_page_hashes(self.config.page_size)[:max_pages]
        num_cached = self.pool.num_cached_prefix_pages(hashes)
        return num_cached < len(hashes) and hashes[num_cached] in self._pages_in_flight

    def _announce_in_flight(self, request: Request) -> None:
        """Marks the full pages the request is about to compute, so others wait for them."""
        if not self.pool.enable_prefix_caching:
            return
        hashes = request.full_page_hashes(self.config.page_size)[len(request.page_hashes) :]
        request.in_flight_hashes = set(hashes)
        for page_hash in request.in_flight_hashes:
            self._pages_in_flight[page_hash] = self._pages_in_flight.get(page_hash, 0) + 1

    def _landed(self, request: Request, page_hash: int) -> None:
        """The request has indexed (or given up) a page it announced."""
        if page_hash not in request.in_flight_hashes:
            return
        request.in_flight_hashes.discard(page_hash)
        count = self._pages_in_flight.pop(page_hash)
        if count > 1:
            self._pages_in_flight[page_hash] = count - 1

    def _release(self, request: Request) -> None:
        for page_hash in list(request.in_flight_hashes):
            self._landed(request, page_hash)
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
