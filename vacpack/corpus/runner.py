"""CorpusRunner: a whole corpus through the model in padding-free packed bins, results in order.

    inputs -> encode (background thread) -> pack first-fit decreasing (same thread)
           -> bounded queue of ready bins -> stage (pinned, async copy on CUDA)
           -> one packed forward per bin -> the task's results, re-ordered to input order

Tokenizing and packing run ahead of the device in a producer thread, so the device only waits
when the producer cannot keep up; that wait is measured and reported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from tqdm.auto import tqdm

from vacpack.attention import PackedBinShape, SelectedBackend, select_backend
from vacpack.corpus.budget import FIRST_PROBE_TOKENS, BinBudget, measure_bin_budget
from vacpack.corpus.forward import PackedForward
from vacpack.corpus.packing import Document, DocumentError, FirstFitDecreasingPacker, PackedBin
from vacpack.corpus.pipeline import BackgroundBins
from vacpack.corpus.report import JobReport
from vacpack.corpus.tasks import CorpusTask
from vacpack.pinned_staging import PinnedStager
from vacpack.runtime import LoadedModel
from vacpack.tuning.allowance import spending

logger = logging.getLogger(__name__)

# Documents sorted and packed together: enough for first-fit decreasing to fill bins well,
# few enough that a corpus of any size streams through in bounded memory.
WINDOW_DOCS = 1024
READY_BINS = 4  # bins packed ahead of the device
# Inputs per tokenizer call: one batched call costs far less per text than a call each.
ENCODE_BATCH_INPUTS = 64
# The probe forwards hold sequences of this many tokens (or the context, if shorter), at most
# MAX_BIN_SEQUENCES of them: the search stops there if throughput still grows. As long as the
# first probe (FIRST_PROBE_TOKENS), so that every probe holds the same sequences and only the
# bin size changes: a longer sequence costs more attention per token, and with 512-token
# sequences the second probe read as slower than the first, ending every search at 256.
PROBE_SEQ_LEN = FIRST_PROBE_TOKENS
MAX_BIN_SEQUENCES = 128
# The bin that attention backends are timed on (attention/selection.py): a decoder's documents
# for scoring are long, an encoder's texts for embedding short; 2,048 tokens either way.
TIMED_BIN_TOKENS = 2048
TIMED_SEQ_LEN = {True: 512, False: 128}  # by whether the model is causal


def timed_bin_shape(causal: bool, max_model_len: int) -> PackedBinShape:
    seq_len = min(TIMED_SEQ_LEN[causal], max_model_len)
    return PackedBinShape(max(1, TIMED_BIN_TOKENS // seq_len), seq_len, causal)


def select_corpus_attention(loaded: LoadedModel) -> SelectedBackend:
    """The packed bins' attention backend. With tensor parallelism every rank calls this: the
    others after rank 0, reading its measured choice from the on-disk cache. Timed within what
    is left of the load's timing allowance."""
    with spending(loaded.timing_allowance):
        return select_backend(
            loaded.engine_config.attention_backend,
            loaded.device,
            loaded.attention_shapes,
            timed_bin_shape(bool(getattr(loaded.model, "is_causal", True)), loaded.max_model_len),
        )


class CorpusRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        budget_tokens: int | None = None,
        align_to: int | None = None,
    ) -> None:
        self.loaded = loaded
        selected = select_corpus_attention(loaded)
        # The model's choices and this runner's (its attention backend and the backend's
        # options), for every job's report.
        self.measured_choices = loaded.measured_choices + selected.choices
        self.forward = PackedForward(loaded, selected.backend)
        self.align_to = align_to
        self._budget = BinBudget.given(budget_tokens) if budget_tokens else None
        self.last_report: JobReport | None = None

    @property
    def budget(self) -> BinBudget:
        if self._budget is None:
            self._budget = measure_bin_budget(
                self._probe_forward, self.loaded.device, MAX_BIN_SEQUENCES * self._probe_seq_len
            )
        return self._budget

    @property
    def _probe_seq_len(self) -> int:
        # Never past the model's context.
        return min(self.loaded.max_model_len, PROBE_SEQ_LEN)

    def _probe_forward(self, num_tokens: int) -> None:
        seq_len = self._probe_seq_len
        seq_lens = [seq_len] * (num_tokens // seq_len) + (
            [num_tokens % seq_len] if num_tokens % seq_len else []
        )
        device = self.loaded.device
        token_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in seq_lens])
        self.forward.packed(token_ids, positions, seq_lens)

    def run(
        self,
        task: CorpusTask,
        inputs: Iterable[Any],
        total: int | None = None,
        use_tqdm: bool = True,
    ) -> Iterator[tuple[int, Any]]:
        """Yields (input index, result or DocumentError) in input order."""
        budget = self.budget
        report = JobReport(
            task.name,
            bin_budget_tokens=budget.tokens,
            budget_source=budget.source,
            measured_choices=self.measured_choices,
        )
        self.last_report = report
        packer = FirstFitDecreasingPacker(
            budget.tokens, WINDOW_DOCS, self.align_to, _pad_token_id(self.loaded)
        )
        # Bin N+1 is copied on a stream of its own while bin N runs.
        stager = PinnedStager(self.loaded.device, 2 * budget.tokens, copy_stream=True)
        progress = tqdm(total=total, desc=task.name, unit="doc", disable=not use_tqdm)
        finished: dict[int, Any] = {}
        next_index = 0
        try:
            with BackgroundBins(packer.pack(_documents(task, inputs)), READY_BINS) as bins:
                for item in bins:
                    results = self._results(task, item, stager, report)
                    for index, result in results:
                        finished[index] = result
                        if isinstance(result, DocumentError):
                            report.num_failed += 1
                            report.failures.append((result.index, result.message))
                    # Counted when their bin is done, not when they are yielded: first-fit
                    # decreasing reorders a window, so input order lags far behind the work.
                    report.num_documents += len(results)
                    progress.update(len(results))
                    progress.set_postfix_str(f"{report.tokens_per_s:,.0f} tok/s")
                    while next_index in finished:
                        yield next_index, finished.pop(next_index)
                        next_index += 1
                report.wait_for_bins_s = bins.wait_s
        finally:
            progress.close()
            report.finish(self.loaded.device)
        if finished:  # every index below the highest seen must have come back
            raise RuntimeError(f"documents {sorted(finished)[:5]} came back out of sequence")

    def _results(
        self,
        task: CorpusTask,
        item: PackedBin | DocumentError,
        stager: PinnedStager,
        report: JobReport,
    ) -> list[tuple[int, Any]]:
        if isinstance(item, DocumentError):
            return [(item.index, item)]
        start_s = _now(self.loaded.device)
        try:
            if item.oversize:
                (document,) = item.documents
                assert document is not None, "an oversize bin holds one document, no padding"
                token_ids = torch.as_tensor(document.token_ids, device=self.loaded.device)
                num_tokens = token_ids.numel()
                positions = torch.arange(num_tokens, device=token_ids.device)
                token_type_ids = task.token_type_ids([document], [num_tokens], positions)
                hidden = self.forward.long_document(
                    token_ids, self.budget.max_forward_tokens, token_type_ids
                )
                results = task.process([document], [num_tokens], hidden)
            else:
                token_ids, positions = stager.stage([item.token_ids, item.positions])
                token_type_ids = task.token_type_ids(item.documents, item.seq_lens, positions)
                hidden = self.forward.packed(token_ids, positions, item.seq_lens, token_type_ids)
                documents, seq_lens, hidden = _real_segments(item, hidden)
                results = task.process(documents, seq_lens, hidden)
        except (ValueError, torch.cuda.OutOfMemoryError) as error:
            # One bad bin must not end the job: its documents fail with the reason.
            logger.warning("a bin of %d documents failed: %s", len(item.documents), error)
            return [
                (doc.index, DocumentError(doc.index, str(error)))
                for doc in item.documents
                if doc is not None
            ]
        report.device_busy_s += _now(self.loaded.device) - start_s
        report.num_bins += 1
        report.num_real_tokens += item.num_tokens - item.num_padding_tokens
        report.num_padding_tokens += item.num_padding_tokens
        real_docs = [doc for doc in item.documents if doc is not None]
        return [(doc.index, result) for doc, result in zip(real_docs, results, strict=True)]


def _documents(task: CorpusTask, inputs: Iterable[Any]) -> Iterator[Document | DocumentError]:
    """Runs in the producer thread: a bad input becomes an error record, not an exception."""
    batch: list[tuple[int, Any]] = []
    for index, item in enumerate(inputs):
        if isinstance(item, DocumentError):  # the reader already found it unreadable
            yield item
            continue
        batch.append((index, item))
        if len(batch) == ENCODE_BATCH_INPUTS:
            yield from task.encode_batch(batch)
            batch = []
    if batch:
        yield from task.encode_batch(batch)


def _real_segments(
    packed: PackedBin, hidden: torch.Tensor
) -> tuple[list[Document], list[int], torch.Tensor]:
    """Drops alignment-padding segments (and their rows) from a bin's hidden states."""
    if not packed.num_padding_tokens:
        return [doc for doc in packed.documents if doc is not None], list(packed.seq_lens), hidden
    keep_rows: list[int] = []
    documents: list[Document] = []
    seq_lens: list[int] = []
    starts = packed.cu_seqlens.tolist()
    for segment, document in enumerate(packed.documents):
        if document is not None:
            keep_rows.extend(range(starts[segment], starts[segment + 1]))
            documents.append(document)
            seq_lens.append(packed.seq_lens[segment])
    rows = torch.tensor(keep_rows, dtype=torch.int64, device=hidden.device)
    return documents, seq_lens, hidden.index_select(0, rows)


def _pad_token_id(loaded: LoadedModel) -> int:
    tokenizer = loaded.tokenizer
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)
    return 0


def _now(device: torch.device) -> float:
    """Wall time after the device has finished its queued work (a sync point on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
