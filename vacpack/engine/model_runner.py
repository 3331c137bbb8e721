"""Turns a scheduled step into tensors, runs the model once, and samples.

The step's sequences are laid out as one packed stream (decodes first, then prefill chunks). The
LM head runs only on the rows that need logits: each sampling request's last row, and the prompt
rows of requests that asked for prompt logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from vacpack.attention.backend import AttentionBackend, BatchLayout
from vacpack.engine.request import Request
from vacpack.engine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    TokenLogprobs,
    gather_logprobs,
)
from vacpack.engine.scheduler import ScheduledRequest
from vacpack.kvcache.paged_cache import PagedKVCache
from vacpack.models.forward_context import ForwardContext

# Prompt-logprob rows go through the LM head and log-softmax this many at a time, so a long
# prompt chunk never materialises [chunk, vocab] float32 logits at once.
PROMPT_LOGPROB_ROWS_PER_PASS = 512


@dataclass(frozen=True)
class PromptLogprobSpan:
    """Rows [row_start, row_start + num_rows) score prompt tokens first_position + 1 ..."""

    request: Request
    row_start: int
    first_position: int
    num_rows: int


@dataclass(frozen=True)
class PromptLogprobResult:
    request: Request
    first_position: int  # the logprobs are of prompt tokens first_position + 1, ...
    logprobs: TokenLogprobs  # on the host


@dataclass(frozen=True)
class StepResult:
    sampled_requests: list[Request]
    sampled_token_ids: list[int]
    sampler_output: SamplerOutput | None  # host copies, for logprobs
    prompt_logprobs: list[PromptLogprobResult]
    num_tokens: int
    num_decode_tokens: int


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: PagedKVCache,
        attention: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.sampler = sampler
        self.device = device

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest]) -> StepResult:
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        page_tables: list[list[int]] = []
        sample_rows: list[int] = []
        sampled_requests: list[Request] = []
        prompt_spans: list[PromptLogprobSpan] = []
        for item in scheduled:
            request, num_new = item.request, item.num_new_tokens
            start = request.num_computed_tokens
            end = start + num_new
            row_start = len(token_ids)
            token_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(num_new)
            context_lens.append(end)
            page_tables.append(request.page_table)
            if request.wants_prompt_logprobs:
                # Row j predicts token j + 1; score only prompt tokens not scored before.
                first = max(start, len(request.prompt_logprobs) - 1)
                last = min(end, request.num_prompt_tokens - 1)
                if last > first:
                    prompt_spans.append(
                        PromptLogprobSpan(request, row_start + first - start, first, last - first)
                    )
            if item.samples and request.params.max_tokens != 0:
                sample_rows.append(row_start + num_new - 1)
                sampled_requests.append(request)

        layout = BatchLayout(query_lens, context_lens, page_tables, self.kv_cache.page_size)
        metadata = self.attention.build_metadata(layout, self.device)
        ctx = ForwardContext(self.attention, metadata, self.kv_cache)
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.int64).to(self.device, non_blocking=True),
            torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True),
            ctx,
        )

        sampled_ids: list[int] = []
        sampler_output = None
        if sampled_requests:
            rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            sampler_output = _to_host(
                self.sampler(logits, [_sampling_row(r) for r in sampled_requests])
            )
            sampled_ids = sampler_output.sampled_token_ids.tolist()
        prompt_results = [self._prompt_logprobs(hidden, span) for span in prompt_spans]
        return StepResult(
            sampled_requests=sampled_requests,
            sampled_token_ids=sampled_ids,
            sampler_output=sampler_output,
            prompt_logprobs=prompt_results,
            num_tokens=len(token_ids),
            num_decode_tokens=layout.num_decodes,
        )

    def _prompt_logprobs(
        self, hidden: torch.Tensor, span: PromptLogprobSpan
    ) -> PromptLogprobResult:
        request = span.request
        num_topk = request.params.prompt_logprobs
        next_tokens = request.prompt_token_ids[
            span.first_position + 1 : span.first_position + 1 + span.num_rows
        ]
        parts = []
        for offset in range(0, span.num_rows, PROMPT_LOGPROB_ROWS_PER_PASS):
            count = min(PROMPT_LOGPROB_ROWS_PER_PASS, span.num_rows - offset)
            rows = hidden[span.row_start + offset : span.row_start + offset + count]
            logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
            targets = torch.tensor(next_tokens[offset : offset + count], device=self.device)
            parts.append(gather_logprobs(logprobs, targets, num_topk))
        merged = TokenLogprobs(
            *(
                torch.cat([getattr(p, f) for p in parts]).cpu()
                for f in TokenLogprobs.__dataclass_fields__
            )
        )
        return PromptLogprobResult(request, span.first_position, merged)


def _sampling_row(request: Request) -> SamplingRow:
    params = request.params
    suppress = (
        request.stop_token_ids if request.num_output_tokens < params.min_tokens else frozenset()
    )
    return SamplingRow(
        params=params,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=request.output_token_ids,
        generator=request.generator,
        stop_token_ids_to_suppress=suppress,
    )


def _to_host(output: SamplerOutput) -> SamplerOutput:
    return SamplerOutput(
        *(
            None if t is None else t.cpu()
            for t in (getattr(output, f) for f in SamplerOutput.__dataclass_fields__)
        )
    )
