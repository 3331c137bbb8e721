"""A step's device inputs as plain integers: what every tensor-parallel rank needs to run it.

Rank 0 schedules; the other ranks only run steps. An ENGINE_STEP message carries one step's
StepInputs as a single run of integers (`encode`), and each rank rebuilds them (`decode`) and
builds its own attention metadata from the layout: the layout is a few integers per sequence,
while the metadata is backend-specific tensors (already on rank 0's device), so sending the
integers costs one host broadcast and every rank's metadata comes from the same code.

Positions are not sent: sequence i's tokens sit at positions context_lens[i] - query_lens[i]
onwards.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from vacpack.attention.backend import BatchLayout

# Rows of prompt logprobs that go through the LM head and log-softmax in one pass, so that a
# long prompt chunk never materialises [chunk, vocab] float32 logits at once.
PROMPT_LOGPROB_ROWS_PER_PASS = 512

# sequences, tokens, sampled rows, prompt passes, use_graph, shares_sampled, verify rows
_NUM_COUNTS = 8


@dataclass(frozen=True)
class StepInputs:
    # Token ids; a negative id -(slot + 1) is a token sampled by an earlier step that the host
    # has not read yet: the device takes it from slot `slot` of the future-token buffer.
    token_ids: list[int]
    positions: list[int]
    layout: BatchLayout
    use_graph: bool  # a decode-only step that replays a captured CUDA graph
    sample_rows: list[int]  # stream rows whose logits are sampled
    future_slots: list[int]  # where each sampled token goes in the future-token buffer
    # LM-head passes for prompt logprobs, in order: (first stream row, number of rows).
    prompt_passes: list[tuple[int, int]]
    # Tensor parallel with async scheduling: rank 0 broadcasts the sampled ids, so that every
    # rank can fill later steps' placeholders.
    shares_sampled_tokens: bool = False
    # Speculative decoding: stream rows whose greedy tokens verify draft tokens (each
    # speculating sequence's last token and its drafts), after the sampled rows' LM head.
    verify_rows: list[int] = field(default_factory=list)
    # LoRA: each sequence's adapter id (0: none), in stream order; empty when none runs one.
    lora_ids: list[int] = field(default_factory=list)

    @property
    def has_placeholders(self) -> bool:
        return any(t < 0 for t in self.token_ids[: self.layout.num_decodes])


def prompt_passes(row_start: int, num_rows: int) -> list[tuple[int, int]]:
    """The LM-head passes over rows [row_start, row_start + num_rows)."""
    return [
        (row_start + offset, min(PROMPT_LOGPROB_ROWS_PER_PASS, num_rows - offset))
        for offset in range(0, num_rows, PROMPT_LOGPROB_ROWS_PER_PASS)
    ]


def encode(inputs: StepInputs) -> list[int]:
    layout = inputs.layout
    return [
        len(layout.query_lens),
        len(inputs.token_ids),
        len(inputs.sample_rows),
        len(inputs.prompt_passes),
        int(inputs.use_graph),
        int(inputs.shares_sampled_tokens),
        len(inputs.verify_rows),
        len(inputs.lora_ids),
        *layout.query_lens,
        *layout.context_lens,
        *(len(table) for table in layout.page_tables),
        *itertools.chain.from_iterable(layout.page_tables),
        *inputs.token_ids,
        *inputs.sample_rows,
        *inputs.future_slots,
        *itertools.chain.from_iterable(inputs.prompt_passes),
        *inputs.verify_rows,
        *inputs.lora_ids,
    ]


def decode(
    values: list[int], page_size: int, attention_windows: tuple[int | None, ...]
) -> StepInputs:
    num_seqs, num_tokens, num_sampled, num_passes, use_graph, shares, num_verify, num_lora = values[
        :_NUM_COUNTS
    ]
    cursor = _NUM_COUNTS

    def take(count: int) -> list[int]:
        nonlocal cursor
        cursor += count
        return values[cursor - count : cursor]

    query_lens, context_lens, table_lens = take(num_seqs), take(num_seqs), take(num_seqs)
    pages = take(sum(table_lens))
    bounds = list(itertools.accumulate(table_lens, initial=0))
    page_tables = [pages[start:end] for start, end in itertools.pairwise(bounds)]
    token_ids = take(num_tokens)
    sample_rows, future_slots = take(num_sampled), take(num_sampled)
    flat_passes = take(2 * num_passes)
    verify_rows = take(num_verify)
    lora_ids = take(num_lora)
    assert cursor == len(values), "an ENGINE_STEP message of unexpected length"
    positions = [
        position
        for query_len, context_len in zip(query_lens, context_lens, strict=True)
        for position in range(context_len - query_len, context_len)
    ]
    return StepInputs(
        token_ids=token_ids,
        positions=positions,
        layout=BatchLayout(
            query_lens,
            context_lens,
            page_tables,
            page_size,
            attention_windows=attention_windows,
        ),
        use_graph=bool(use_graph),
        sample_rows=sample_rows,
        future_slots=future_slots,
        prompt_passes=list(zip(flat_passes[::2], flat_passes[1::2], strict=True)),
        shares_sampled_tokens=bool(shares),
        verify_rows=verify_rows,
        lora_ids=lora_ids,
    )
