"""Prometheus metrics of one server, in a registry of its own (nothing global to reset).

Gauges, and the counters of what the engine tallies itself (prefix-cache lookups and hits,
evictions, preemptions), are set by the engine thread after every step; the other counters and
histograms are observed there as outputs leave the engine, so the timings are the engine's, not
the event loop's. What was chosen by measurement at load is set once, at start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from vacpack.engine.state import EngineState
from vacpack.tuning import MeasuredChoice
from vacpack.tuning.timing import SETTLED_ROUNDS

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_ITL_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
_E2E_BUCKETS_S = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, list(labels), registry=registry, buckets=buckets).labels(
                **labels
            )

        self.num_requests_running = gauge(
            "vacpack:num_requests_running", "Sequences in the running batch."
        )
        self.num_requests_waiting = gauge(
            "vacpack:num_requests_waiting", "Sequences waiting for a slot or for KV pages."
        )
        self.kv_cache_used_pages = gauge("vacpack:kv_cache_used_pages", "KV pages in use.")
        self.kv_cache_total_pages = gauge("vacpack:kv_cache_total_pages", "KV pages in all.")
        self.kv_cache_usage = gauge(
            "vacpack:kv_cache_usage_perc", "Share of KV pages in use (1 = full)."
        )
        self.prefix_cache_queries = counter(
            "vacpack:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (again after a preemption).",
        )
        self.prefix_cache_hits = counter(
            "vacpack:prefix_cache_hits", "Of the prompt tokens looked up, those found cached."
        )
        self.prefix_cache_hit_rate = gauge(
            "vacpack:prefix_cache_hit_rate",
            "Share of looked-up prompt tokens found cached since the server started.",
        )
        self.prefix_cache_evictions = counter(
            "vacpack:prefix_cache_evictions",
            "Cached KV pages dropped from the prefix cache to make room for fresh ones.",
        )
        self.num_preemptions = counter(
            "vacpack:num_preemptions",
            "Running sequences that gave their KV pages back to be recomputed later.",
        )
        self.spec_decode_draft_tokens = counter(
            "vacpack:spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified.",
        )
        self.spec_decode_accepted_tokens = counter(
            "vacpack:spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted (the model would have chosen them).",
        )
        self._last_state: EngineState | None = None
        self.prompt_tokens = counter("vacpack:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("vacpack:generation_tokens", "Tokens generated.")
        self.time_to_first_token = histogram(
            "vacpack:time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            _TTFT_BUCKETS_S,
        )
        self.inter_token_latency = histogram(
            "vacpack:inter_token_latency_seconds",
            "Between successive outputs of a request, per token.",
            _ITL_BUCKETS_S,
        )
        self.e2e_request_latency = histogram(
            "vacpack:e2e_request_latency_seconds",
            "From a request's arrival to its last token.",
            _E2E_BUCKETS_S,
        )
        self._finished = Counter(
            "vacpack:request_success",
            "Requests that finished, by finish reason.",
            [*labels, "finished_reason"],
            registry=registry,
        )
        self._model_name = model_name
        self.requests_aborted = counter(
            "vacpack:request_aborted", "Requests aborted (client gone, or shutdown)."
        )
        # Info-style: one series (value 1) per phase chosen by measurement at load, naming the
        # choice, how it was made (measured, cached, forced) and the shapes it was timed at.
        self._measured_choice = Gauge(
            "vacpack:measured_choice",
            "Implementations chosen by measurement at load, one per phase (value 1).",
            [*labels, "phase", "chosen", "source", "shape"],
            registry=registry,
        )
        self._candidate_seconds = Gauge(
            "vacpack:measured_choice_candidate_seconds",
            "Best time of one call of each candidate timed for a measured choice.",
            [*labels, "phase", "shape", "candidate"],
            registry=registry,
        )
        self._choice_rounds = Gauge(
            "vacpack:measured_choice_rounds",
            "Timed rounds behind each measured choice, over every load that timed it (fewer "
            f"than {SETTLED_ROUNDS}: unsettled, timed again at the next load).",
            [*labels, "phase", "shape"],
            registry=registry,
        )
        self.requests_rejected = counter(
            "vacpack:request_rejected", "Requests refused with 503 because the queue was full."
        )

    def set_measured_choices(self, choices: Sequence[MeasuredChoice]) -> None:
        """What the model's load and the engine chose by measurement, set once at start."""
        for choice in choices:
            source, shape = choice.source.value, choice.shape_key
            self._measured_choice.labels(
                self._model_name, choice.phase, choice.chosen, source, shape
            ).set(1)
            if choice.best_time_s:
                self._choice_rounds.labels(self._model_name, choice.phase, shape).set(
                    choice.num_rounds
                )
            for candidate, best_s in choice.best_time_s.items():
                self._candidate_seconds.labels(
                    self._model_name, choice.phase, shape, candidate
                ).set(best_s)

    def count_finished(self, finish_reason: str) -> None:
        self._finished.labels(model_name=self._model_name, finished_reason=finish_reason).inc()

    def set_engine_state(self, state: EngineState) -> None:
        self.num_requests_running.set(state.num_running_sequences)
        self.num_requests_waiting.set(state.num_waiting_sequences)
        self.kv_cache_used_pages.set(state.kv_pages_used)
        self.kv_cache_total_pages.set(state.kv_pages_total)
        total_pages = state.kv_pages_total
        self.kv_cache_usage.set(state.kv_pages_used / total_pages if total_pages else 0.0)
        # The engine's totals only grow: each counter advances by the change since last time.
        last, self._last_state = self._last_state, state
        if last is None:
            last = dataclasses.replace(
                state,
                num_prefix_queried_tokens=0,
                num_prefix_hit_tokens=0,
                num_prefix_evictions=0,
                num_preemptions=0,
                num_draft_tokens=0,
                num_accepted_draft_tokens=0,
            )
        self.prefix_cache_queries.inc(
            state.num_prefix_queried_tokens - last.num_prefix_queried_tokens
        )
        self.prefix_cache_hits.inc(state.num_prefix_hit_tokens - last.num_prefix_hit_tokens)
        self.prefix_cache_evictions.inc(state.num_prefix_evictions - last.num_prefix_evictions)
        self.num_preemptions.inc(state.num_preemptions - last.num_preemptions)
        self.spec_decode_draft_tokens.inc(state.num_draft_tokens - last.num_draft_tokens)
        self.spec_decode_accepted_tokens.inc(
            state.num_accepted_draft_tokens - last.num_accepted_draft_tokens
        )
        self.prefix_cache_hit_rate.set(state.prefix_cache_hit_rate)

    def render(self) -> bytes:
        return generate_latest(self.registry)
