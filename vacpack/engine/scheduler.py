"""Continuous batching, and the life of every request from arrival to its last token.

Every step has a token budget. Running sequences go first, in the order they were admitted,
each taking what it still needs (one token for a decode, the rest of its prompt for a prefill,
cut to the budget: chunked prefill). Waiting sequences are then admitted first-come first-served
while budget, sequence slots and KV pages last. When a running sequence needs a page and none is
free, the most recently admitted sequence is preempted: its pages are freed, and it goes back to
the front of the queue to be recomputed later. Earlier sequences are never preempted for later
ones, so none starves, and as the cache holds at least one whole sequence there is no deadlock.

With the priority policy both queues are kept in priority order (a request's `priority`, lower
first, then arrival): the waiting queue's head is the most urgent request, running sequences
take their share of a step in that order, and the one preempted is the least urgent (so a
request may wait as long as more urgent ones keep coming, as under vLLM's policy).

A waiting sequence whose next uncached page is being computed right now by a running one waits
for it (an exception to first come, first served; see PageManager), so sequences that share
a prefix and arrive together (n > 1 samples, a common system prompt, few-shot contexts) compute
it once. The other exception: a sequence whose grammar is still being compiled (structured
outputs) waits, and the sequences behind it go first.

Lengths advance when a step is launched, before its tokens are known (`on_launch`): with async
scheduling the next step is scheduled while this one still runs, its sampled tokens stand in the
sequences as placeholders (Sequence.num_pending_tokens), and a sequence whose launched steps
produce its last token (max_tokens, context limit) is not scheduled again. `update_from_output`
then applies a finished step: it resolves the placeholders, indexes the filled pages, records
logprobs, runs the stop checks and finishes what has stopped.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass

from vacpack.engine.logprob_gather import TokenLogprobs
from vacpack.engine.logprobs import position_logprobs
from vacpack.engine.page_manager import PageManager
from vacpack.engine.request import Request, Sequence, SequenceStatus
from vacpack.engine.speculation import SpeculationConfig, accepted_tokens
from vacpack.engine.step import ScheduledChunk, StepResult, VerifiedDrafts
from vacpack.engine.stop_checks import check_stop
from vacpack.kvcache.page_pool import PagePool


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    # When every layer has a sliding window, the largest: pages behind it are freed as
    # sequences advance. None keeps every page until the sequence finishes.
    kv_window: int | None = None
    speculation: SpeculationConfig | None = None  # n-gram drafts for decodes (speculation.py)
    max_loras: int | None = None  # LoRA: the most distinct adapters running at once
    policy: str = "fcfs"  # or "priority" (EngineConfig.scheduling_policy)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # decodes (one new token) first, then prefill chunks
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.chunks)

    def reads_known_outputs(self, masks_may_wait: bool) -> bool:
        """True when a scheduled sequence's sampling reads its earlier output tokens on the
        host and one of them is still being sampled, so the running step must be read first:
        penalties count them; a grammar's (or a multi-token bad word's) mask depends on them,
        unless the device work may wait for the host to fill the masks after launch."""
        for chunk in self.chunks:
            sequence = chunk.sequence
            if not sequence.num_pending_tokens:
                continue
            constraints = sequence.constraints
            if sequence.params.has_penalties or (
                not masks_may_wait and constraints is not None and constraints.needs_known_outputs
            ):
                return True
        return False

    def without_finished(self) -> SchedulerOutput:
        """The chunks of sequences still unfinished (a step read since may have ended some)."""
        chunks = [chunk for chunk in self.chunks if not chunk.sequence.is_finished]
        return SchedulerOutput(chunks, self.preempted)


@dataclass(frozen=True)
class StepUpdate:
    """What applying a step's results changed."""

    requests: list[Request]  # requests that progressed, finished ones included
    num_generated_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: PagePool) -> None:
        self.config = config
        self.pool = pool
        self.pages = PageManager(pool, config.page_size, config.kv_window)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = itertools.count()  # the order requests came in
        # Speculative decoding's totals: draft tokens verified, and of those accepted.
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0

    @property
    def num_unfinished_sequences(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def waits_for_grammar(self) -> bool:
        """True while a waiting sequence's grammar is still being compiled (it cannot start)."""
        return any(
            sequence.constraints is not None and not sequence.constraints.is_ready
            for sequence in self.waiting
        )

    # ------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.arrival_index = next(self._arrivals)
        if self.config.policy == "priority":
            for sequence in request.sequences:
                _insert_in_order(self.waiting, sequence)
        else:
            self.waiting.extend(request.sequences)

    def abort_request(self, request_id: str) -> None:
        """Ends a request's unfinished sequences and frees their pages; unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for sequence in request.sequences:
            if not sequence.is_finished:
                sequence.drop_pending_tokens()
                self._remove(sequence)

    # ------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []

        index = 0
        while index < len(self.running) and budget > 0:
            sequence = self.running[index]
            # Finishes once its launched steps are read: by length, or a prompt-only request
            # (max_tokens 0) whose last prompt chunk is in flight, with nothing left to compute.
            if sequence.all_tokens_scheduled or sequence.num_tokens == sequence.num_computed_tokens:
                index += 1
                continue
            num_new = min(sequence.num_tokens - sequence.num_computed_tokens, budget)
            self.pages.release_dead_pages(sequence)
            drafts = self._drafts(sequence, num_new, budget)
            while not self.pages.reserve(sequence, sequence.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is sequence:
                    break
            else:
                chunks.append(self._chunk(sequence, num_new, drafts))
                budget -= num_new + len(drafts)
                index += 1

        # After a preemption memory is tight: admitting more would only preempt again.
        position = 0
        while (
            not preempted
            and position < len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            sequence = self.waiting[position]
            if sequence.num_pending_tokens:
                break  # preempted with a token still being sampled: readmitted once it is read
            if sequence.constraints is not None and not sequence.constraints.is_ready:
                position += 1  # its grammar is being compiled: the sequences behind it go first
                continue
            if self.pages.next_page_in_flight(sequence):
                position += 1  # the one overtaking allowed: its prefix is being computed
                continue
            if not self._adapter_fits(sequence):
                position += 1  # every adapter slot is taken: it waits for one to free up
                continue
            self.pages.take_cached_prefix(sequence)
            self.pages.release_dead_pages(sequence)
            num_new = min(sequence.num_tokens - sequence.num_computed_tokens, budget)
            if not self.pages.reserve(sequence, sequence.num_computed_tokens + num_new):
                self.pages.release(sequence)
                break  # first come, first served: nobody overtakes the head of the queue
            del self.waiting[position]
            sequence.status = SequenceStatus.RUNNING
            if self.config.policy == "priority":
                _insert_in_order(self.running, sequence)
            else:
                self.running.append(sequence)
            self.pages.announce_in_flight(sequence)
            chunks.append(self._chunk(sequence, num_new))
            budget -= num_new

        chunks.sort(key=lambda chunk: chunk.num_new_tokens != 1)  # stable: decodes first
        return SchedulerOutput(chunks, preempted)

    def _adapter_fits(self, sequence: Sequence) -> bool:
        """Whether the sequence's LoRA adapter may run beside the running sequences'."""
        if not sequence.lora_id or self.config.max_loras is None:
            return True
        running = {other.lora_id for other in self.running if other.lora_id}
        return sequence.lora_id in running or len(running) < self.config.max_loras

    def on_launch(
        self, chunks: list[ScheduledChunk], sampled: list[Sequence], placeholders: list[int]
    ) -> None:
        """The step is on the device: lengths advance now, before its tokens are known, so the
        next step can be scheduled as if this one had finished. Each sampled sequence holds a
        placeholder for its token until the step is read; later steps' inputs resolve it on
        the device."""
        for chunk in chunks:
            chunk.sequence.num_computed_tokens += chunk.num_new_tokens
        for sequence, placeholder in zip(sampled, placeholders, strict=True):
            sequence.add_pending_token(placeholder)

    def update_from_output(self, chunks: list[ScheduledChunk], result: StepResult) -> StepUpdate:
        """Applies a finished step's results to its sequences and their requests."""
        now = time.perf_counter()
        # Sequences finished (stopped, aborted) after this step was launched: their rows are
        # computed but mean nothing now.
        live = [chunk for chunk in chunks if not chunk.sequence.is_finished]
        for prompt_result in result.prompt_logprobs:
            sequence = prompt_result.sequence
            if sequence.is_finished:
                continue
            lp = prompt_result.logprobs
            num_topk = sequence.params.prompt_logprobs or 0
            for i in range(lp.token_logprobs.shape[0]):
                token_id = sequence.prompt_token_ids[prompt_result.first_position + 1 + i]
                sequence.prompt_logprobs.append(  # type: ignore[union-attr]
                    position_logprobs(
                        sequence.detokenizer.token_text,
                        token_id,
                        float(lp.token_logprobs[i]),
                        int(lp.token_ranks[i]),
                        lp.topk_token_ids[i, :num_topk].tolist(),
                        lp.topk_logprobs[i, :num_topk].tolist(),
                    )
                )
        sampled = [
            (row, sequence, token_id)
            for row, (sequence, token_id) in enumerate(
                zip(result.sampled_sequences, result.sampled_token_ids, strict=True)
            )
            if not sequence.is_finished
        ]
        for _, sequence, token_id in sampled:
            sequence.resolve_pending_token(token_id)
        num_generated = len(sampled)
        for verified in result.verified:
            if not verified.sequence.is_finished:
                num_generated += self._apply_verified(verified)
        # Index the pages filled so far before stop checks free a finishing sequence's pages.
        for chunk in live:
            self.pages.register_computed_pages(chunk.sequence)
        for row, sequence, token_id in sampled:
            if sequence.metrics.first_token_time is None:
                sequence.metrics.first_token_time = now
            if sequence.logprobs is not None:
                _record_logprobs(sequence, token_id, row, result)
            constraints = sequence.constraints
            advance = "continue" if constraints is None else constraints.advance(token_id)
            stop = check_stop(sequence, token_id, output_complete=advance == "complete")
            if stop is None and advance == "refused":
                stop = ("abort", None)
            if stop is not None:
                self._finish(sequence, *stop)
        requests: dict[str, Request] = {}
        for chunk in live:
            sequence = chunk.sequence
            if sequence.params.max_tokens == 0 and chunk.samples:
                self._finish(sequence, "length", None)  # prompt logprobs only: done
            if sequence.is_finished:
                sequence.metrics.finished_time = now
            requests[sequence.request.request_id] = sequence.request
        return StepUpdate(list(requests.values()), num_generated)

    # ------------------------------------------------------------ internals
    def _drafts(self, sequence: Sequence, num_new: int, budget: int) -> tuple[int, ...]:
        """A decode's draft tokens (speculative decoding), with pages reserved for them; none
        where no page is free for them: drafts never preempt another sequence."""
        speculation = self.config.speculation
        if speculation is None or num_new != 1:
            return ()
        drafts = speculation.drafts(sequence, budget)
        end = sequence.num_computed_tokens + 1 + len(drafts)
        if drafts and not self.pages.reserve(sequence, end):
            return ()
        return drafts

    def _chunk(
        self, sequence: Sequence, num_new: int, drafts: tuple[int, ...] = ()
    ) -> ScheduledChunk:
        if sequence.metrics.first_scheduled_time is None:
            sequence.metrics.first_scheduled_time = time.perf_counter()
        start = sequence.num_computed_tokens
        samples = start + num_new == sequence.num_tokens
        return ScheduledChunk(sequence, start, num_new + len(drafts), samples, drafts)

    def _apply_verified(self, verified: VerifiedDrafts) -> int:
        """Appends a speculating sequence's accepted drafts and the model's token after them,
        one at a time through the stop checks; returns how many it kept. Its computed length
        is all its tokens but the newest, as after any decode: the keys and values of the
        rejected drafts lie past it."""
        sequence = verified.sequence
        new_tokens = accepted_tokens(verified.draft_token_ids, verified.target_token_ids)
        self.num_draft_tokens += len(verified.draft_token_ids)
        self.num_accepted_draft_tokens += len(new_tokens) - 1
        sequence.draft_state.record(len(new_tokens) - 1)
        for count, token_id in enumerate(new_tokens, start=1):
            sequence.token_ids.append(token_id)
            sequence.num_computed_tokens = sequence.num_tokens - 1
            if verified.logprobs is not None:
                _record_row_logprobs(sequence, token_id, count - 1, verified.logprobs)
            stop = check_stop(sequence, token_id)
            if stop is not None:
                self.pages.register_computed_pages(sequence)  # cached before they are freed
                self._finish(sequence, *stop)
                return count
        return len(new_tokens)

    def _finish(self, sequence: Sequence, reason: str, stop_reason: int | str | None) -> None:
        # The text held back (an incomplete character) is flushed now; should it complete a
        # stop string, the text is cut there and the sequence stopped on that string.
        flushed_stop = sequence.detokenizer.finish()
        if flushed_stop is not None and reason != "abort":
            reason, stop_reason = "stop", flushed_stop
        sequence.finish_reason = reason
        sequence.stop_reason = stop_reason
        # Its pages may still be written by a launched step; a later step that reuses them
        # runs after it on the device (see step_executor).
        sequence.drop_pending_tokens()
        self._remove(sequence)
        request = sequence.request
        request.num_unfinished -= 1
        if request.is_finished:
            self.requests.pop(request.request_id, None)

    def _remove(self, sequence: Sequence) -> None:
        """Takes a finished or aborted sequence out of the queues and frees its pages."""
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self.pages.release(sequence)
        sequence.status = SequenceStatus.FINISHED

    def _preempt(self, sequence: Sequence) -> None:
        self.pages.release(sequence)
        sequence.status = SequenceStatus.WAITING
        sequence.metrics.num_preemptions += 1
        if self.config.policy == "priority":
            _insert_in_order(self.waiting, sequence)
        else:
            self.waiting.appendleft(sequence)


def _urgency(sequence: Sequence) -> tuple[int, int, int]:
    """Priority order: the request's priority (lower first), its arrival, the sample."""
    return (sequence.request.priority, sequence.request.arrival_index, sequence.index)


def _insert_in_order(queue: deque[Sequence] | list[Sequence], sequence: Sequence) -> None:
    """Puts the sequence after every sequence at least as urgent (the queue is in order)."""
    queue.insert(bisect.bisect_right(queue, _urgency(sequence), key=_urgency), sequence)


def _record_logprobs(sequence: Sequence, token_id: int, row: int, result: StepResult) -> None:
    out = result.sampler_output
    assert out is not None
    assert out.sampled_logprobs is not None and out.sampled_ranks is not None
    assert out.topk_token_ids is not None and out.topk_logprobs is not None
    _record_row_logprobs(
        sequence,
        token_id,
        row,
        TokenLogprobs(
            out.sampled_logprobs, out.sampled_ranks, out.topk_token_ids, out.topk_logprobs
        ),
    )


def _record_row_logprobs(
    sequence: Sequence, token_id: int, row: int, logprobs: TokenLogprobs
) -> None:
    """Appends the sequence's logprobs of `token_id`, from row `row` of `logprobs`."""
    assert sequence.logprobs is not None
    num_topk = sequence.params.logprobs or 0
    logprob = float(logprobs.token_logprobs[row])
    sequence.cumulative_logprob += logprob
    sequence.logprobs.append(
        position_logprobs(
            sequence.detokenizer.token_text,
            token_id,
            logprob,
            int(logprobs.token_ranks[row]),
            logprobs.topk_token_ids[row, :num_topk].tolist(),
            logprobs.topk_logprobs[row, :num_topk].tolist(),
        )
    )
