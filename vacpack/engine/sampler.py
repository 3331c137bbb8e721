"""Turns one step's logits into next tokens, for a whole batch of requests at once, on the device.

Order of operations, as in vLLM V1:

0. token masks (a grammar, allowed_token_ids, bad_words): forbidden tokens are set to -inf,
   before anything else, so that logprobs too are those of the tokens that may be sampled
   (see vacpack/structured/token_masks.py);
1. logprobs (when any row asks) from the (masked) logits, before any other processing;
2. ``logit_bias`` is added; ``min_tokens``: stop tokens are set to -inf while a request is
   still too short (except in a grammar's rows: the grammar decides where its output ends);
3. penalties: repetition (prompt + output tokens), frequency and presence (output tokens);
4. greedy rows take the argmax; the other rows get temperature, min_p, top_k, then top_p
   (over the distribution renormalised to what top_k kept, as vLLM does), and are sampled
   by placing one uniform draw per row on its cumulative distribution, which is exact
   categorical sampling with no host sync (``torch.multinomial`` syncs).

Every decision about which stage to run is made from the Python-side params, never from
tensor values, so nothing here waits on the device; the engine's ``.tolist()`` on the result
is the step's one sync. Per-row parameters reach the device in one copy per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vacpack.cpu_kernels.argmax import argmax_rows, argmax_supported
from vacpack.engine.logprob_gather import logprobs_of
from vacpack.engine.truncation import apply_min_p, apply_top_k_top_p
from vacpack.sampling import SamplingParams
from vacpack.structured.token_masks import StepTokenMasks, bit_table

# The sampler's float32 edges: the largest finite value (an overflowing logit is clamped to it)
# and the smallest normal one (a smaller top_p is raised to it), read once, not per row.
_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny

# Rows of the per-row parameter matrix that goes to the device in a single copy.
_TEMPERATURE, _TOP_P, _TOP_K, _MIN_P, _REPETITION, _FREQUENCY, _PRESENCE = range(7)


@dataclass(frozen=True)
class SamplingRow:
    """What the engine knows about one row of the logits this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # The request's own generator when params.seed is set (request_seeds.py), else None. It
    # must live on the logits' device and persist across the request's steps.
    generator: torch.Generator | None
    # EOS + stop_token_ids while len(output_token_ids) < min_tokens, else empty; see
    # SamplingParams.stop_token_ids_to_suppress.
    stop_token_ids_to_suppress: frozenset[int]


@dataclass(frozen=True)
class SamplerOutput:
    """One step's result; every tensor is on the logits' device.

    The logprob fields are set when any row asked for logprobs (``params.logprobs`` not None),
    for every row; the top-k columns number the largest ``params.logprobs`` in the batch, so
    row ``i`` keeps the first ``rows[i].params.logprobs`` of them. The rank of top-k column
    ``j`` is ``j + 1``. All logprobs are of the raw model distribution (log_softmax of the
    logits as given), as in vLLM V1, not of the penalised / tempered one that was sampled.
    """

    sampled_token_ids: torch.Tensor  # [num_rows] int64
    sampled_logprobs: torch.Tensor | None  # [num_rows] float32
    sampled_ranks: torch.Tensor | None  # [num_rows] int64, 1 = most likely
    topk_token_ids: torch.Tensor | None  # [num_rows, max_num_logprobs] int64
    topk_logprobs: torch.Tensor | None  # [num_rows, max_num_logprobs] float32


# Tokens per block of the two-level inverse CDF (Sampler.draw): a 151,936-token
# vocabulary is 149 blocks, and a row's second level reads one block.
CDF_BLOCK = 1024


def _keep_a_token(processed: torch.Tensor, unprocessed: torch.Tensor) -> torch.Tensor:
    """The processed logits, but where a row has no token left (a mask that allows only stop
    tokens, e.g. allowed_token_ids, while min_tokens holds them back) that row as it was before
    processing: the request then ends short of min_tokens instead of sampling from nothing
    (an all -inf row's softmax is nan, and the inverse CDF then returns an id past the
    vocabulary, which fails the next step for every request in it)."""
    emptied = torch.isneginf(processed).all(dim=-1, keepdim=True)
    return torch.where(emptied, unprocessed, processed)


def _just_below(values: torch.Tensor) -> torch.Tensor:
    """The largest float below each value (of a positive total)."""
    return torch.nextafter(values, torch.zeros_like(values))


def _plain_greedy(row: SamplingRow) -> bool:
    """A row whose token is the argmax of the raw logits: greedy, no logprobs, no penalties,
    no stop tokens held back by min_tokens."""
    p = row.params
    return (
        p.is_greedy
        and p.logprobs is None
        and not p.has_penalties
        and not row.stop_token_ids_to_suppress
    )


def greedy_token_ids(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax in the logits' own dtype: widening bf16 or fp16 to float32 is exact, so
    the winner is the same, and the float32 copy of a [rows, vocab] block is skipped (on a CPU
    it cost 37 ms of a 190 ms G1 decode step, 64 rows of a 151,936-token vocabulary)."""
    if argmax_supported(logits):
        # PyTorch's own CPU argmax is scalar: on G1's 64 rows, 25 ms in bf16 (Zen 4), 9.8 ms in
        # float32 (Zen 3) against 2 ms for the float32 kernel.
        return argmax_rows(logits)
    # Still faster than widening first: 23 against 30 ms for G1's 64 bf16 rows on an AVX2-only
    # AMD EPYC (Zen 3), where the bf16 kernel does not build.
    return logits.argmax(dim=-1)


class Sampler:
    """Samples one token per row of a [num_rows, vocab_size] logits tensor, in any float dtype
    (computed in float32 wherever more than an argmax is needed)."""

    def __init__(self, vocab_size: int, device: torch.device, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # Shared by every unseeded row: their draws may depend on the batch, which is fine
        # because nobody asked them to be reproducible.
        self._shared_generator = torch.Generator(device=self.device)
        if seed is None:
            self._shared_generator.seed()
        else:
            self._shared_generator.manual_seed(seed)
        self._bit_table = bit_table(self.device)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        masks: StepTokenMasks | None = None,
    ) -> SamplerOutput:
        """With masks (see StepTokenMasks), waits until the host has filled them; on a CPU the
        masks set forbidden logits to -inf in these logits, in place."""
        self._check_shape(logits, rows)
        if masks is not None:
            masks.wait()
            logits = masks.apply_mask(logits, self._bit_table)
        has_bias = masks is not None and masks.bias is not None
        if not has_bias and all(_plain_greedy(row) for row in rows):
            return SamplerOutput(greedy_token_ids(logits), None, None, None, None)
        logits = logits.float()
        params = [row.params for row in rows]
        wants_logprobs = any(p.logprobs is not None for p in params)
        # Logprobs are of the raw distribution: the logits before bias, penalties and
        # suppression (all applied out of place below).
        raw_logits = logits

        row_params = self.row_param_matrix(params)
        if masks is not None:
            logits = masks.apply_bias(logits)
        unprocessed = logits
        logits = self._process_logits(logits, rows, row_params)
        # Only a mask can leave nothing but the stop tokens that min_tokens holds back.
        if masks is not None and any(row.stop_token_ids_to_suppress for row in rows):
            logits = _keep_a_token(logits, unprocessed)

        greedy_row_indices = [i for i, p in enumerate(params) if p.is_greedy]
        random_row_indices = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_row_indices:
            sampled = logits.argmax(dim=-1)
        elif not greedy_row_indices:
            sampled = self._sample_random(logits, rows, row_params)
        else:
            sampled = logits.argmax(dim=-1)
            random_index = self._to_device(random_row_indices, torch.int64)
            random_rows = [rows[i] for i in random_row_indices]
            random_sampled = self._sample_random(
                logits.index_select(0, random_index),
                random_rows,
                row_params.index_select(1, random_index),
            )
            sampled = sampled.index_copy(0, random_index, random_sampled)

        if not wants_logprobs:
            return SamplerOutput(sampled, None, None, None, None)
        max_num_logprobs = max(p.logprobs or 0 for p in params)
        gathered = logprobs_of(raw_logits, sampled, max_num_logprobs)
        return SamplerOutput(
            sampled_token_ids=sampled,
            sampled_logprobs=gathered.token_logprobs,
            sampled_ranks=gathered.token_ranks,
            topk_token_ids=gathered.topk_token_ids,
            topk_logprobs=gathered.topk_logprobs,
        )

    def processed_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits after min_tokens suppression and penalties: what greedy rows argmax.

        Temperature, min_p, top_k and top_p are not applied; they only shape random sampling.
        """
        self._check_shape(logits, rows)
        params = [row.params for row in rows]
        return self._process_logits(logits.float(), rows, self.row_param_matrix(params))

    def _check_shape(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        expected_shape = (len(rows), self.vocab_size)
        if tuple(logits.shape) != expected_shape:
            raise ValueError(
                f"logits must be [num_rows, vocab_size] = {list(expected_shape)}, "
                f"got {list(logits.shape)}"
            )

    def _process_logits(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], row_params: torch.Tensor
    ) -> torch.Tensor:
        # Out-of-place ops only: the caller's logits are never modified.
        logits = self._suppress_stop_tokens(logits, rows)
        return self._apply_penalties(logits, rows, row_params)

    def _to_device(self, values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        # A copy from pinned memory with non_blocking=True does not wait for the device to
        # drain; torch's pinned-memory cache keeps the buffer alive until the copy is done.
        pin = self.device.type == "cuda"
        host = torch.tensor(values, dtype=dtype, pin_memory=pin)
        return host.to(self.device, non_blocking=pin)

    def _top_k(self, params: SamplingParams) -> int:
        """The tokens top_k keeps: top_k 0 means the whole vocabulary."""
        return min(params.top_k, self.vocab_size) or self.vocab_size

    def row_param_matrix(self, params: Sequence[SamplingParams]) -> torch.Tensor:
        """[7, num_rows] float32 of per-row parameters, in one host-to-device copy."""
        # float32 holds any vocab index exactly (< 2**24).
        top_k = [float(self._top_k(p)) for p in params]
        matrix = [
            [p.temperature if not p.is_greedy else 1.0 for p in params],
            # A top_p below float32's smallest normal value would round to 0 there, and drop
            # every token on the sorted path (which always keeps the first of a positive one).
            [max(p.top_p, _FLOAT32_TINY) for p in params],
            top_k,
            [p.min_p for p in params],
            [p.repetition_penalty for p in params],
            [p.frequency_penalty for p in params],
            [p.presence_penalty for p in params],
        ]
        return self._to_device(matrix, torch.float32)

    def _suppress_stop_tokens(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> torch.Tensor:
        row_indices: list[int] = []
        token_ids: list[int] = []
        for row_index, row in enumerate(rows):
            for token_id in row.stop_token_ids_to_suppress:
                # An id the model cannot emit needs no suppression.
                if token_id < self.vocab_size:
                    row_indices.append(row_index)
                    token_ids.append(token_id)
        if not row_indices:
            return logits
        index = self._to_device([row_indices, token_ids], torch.int64)
        minus_inf = torch.tensor(float("-inf"), device=logits.device)
        return logits.index_put((index[0], index[1]), minus_inf)

    def _apply_penalties(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], row_params: torch.Tensor
    ) -> torch.Tensor:
        params = [row.params for row in rows]
        needs_repetition = any(p.repetition_penalty != 1.0 for p in params)
        needs_output_counts = needs_repetition or any(
            p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params
        )
        if not needs_output_counts:
            return logits
        output_counts = self._token_counts([row.output_token_ids for row in rows])
        output_seen = output_counts > 0

        if needs_repetition:
            # Only rows that use the penalty pay for turning their prompt into a mask.
            prompts = [
                row.prompt_token_ids if row.params.repetition_penalty != 1.0 else () for row in rows
            ]
            seen = output_seen | (self._token_counts(prompts) > 0)
            penalty = torch.where(seen, row_params[_REPETITION].unsqueeze(1), 1.0)
            # Dividing a positive logit and multiplying a negative one both make the token
            # less likely, whatever the sign (CTRL's definition, as in vLLM and HF).
            logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        if any(p.frequency_penalty != 0.0 for p in params):
            logits = logits - row_params[_FREQUENCY].unsqueeze(1) * output_counts
        if any(p.presence_penalty != 0.0 for p in params):
            logits = logits - row_params[_PRESENCE].unsqueeze(1) * output_seen
        return logits

    def _token_counts(self, token_id_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """[num_rows, vocab_size] float32: how often each token id occurs in each row's list."""
        num_rows = len(token_id_lists)
        max_len = max((len(ids) for ids in token_id_lists), default=0)
        counts = torch.zeros(num_rows, self.vocab_size + 1, device=self.device)
        if max_len == 0:
            return counts[:, : self.vocab_size]
        # Padding points at an extra column that is dropped afterwards.
        padded = [list(ids) + [self.vocab_size] * (max_len - len(ids)) for ids in token_id_lists]
        index = self._to_device(padded, torch.int64)
        counts.scatter_add_(1, index, torch.ones_like(index, dtype=counts.dtype))
        return counts[:, : self.vocab_size]

    def _sample_random(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], row_params: torch.Tensor
    ) -> torch.Tensor:
        return self.draw(self.probabilities(logits, rows, row_params), rows)

    def probabilities(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], row_params: torch.Tensor
    ) -> torch.Tensor:
        """The distributions random rows sample from: float32 logits (after penalties) with
        temperature, min_p, top_k and top_p applied, softmaxed."""
        params = [row.params for row in rows]
        if any(p.temperature != 1.0 for p in params):
            logits = logits / row_params[_TEMPERATURE].unsqueeze(1)
        if any(p.repetition_penalty < 1.0 for p in params):
            # A penalty below 1 divides a seen token's positive logit by it, and a small one
            # (then the temperature) can overflow float32: +inf would make the softmax nan.
            # The largest finite value keeps the token the likeliest, as it was meant to be.
            logits = logits.clamp(max=_FLOAT32_MAX)
        if any(p.min_p > 0.0 for p in params):
            logits = apply_min_p(logits, row_params[_MIN_P])
        if any(p.top_k != 0 or p.top_p < 1.0 for p in params):
            logits = apply_top_k_top_p(
                logits,
                row_params[_TOP_K],
                row_params[_TOP_P],
                [self._top_k(p) for p in params],
                [p.top_p for p in params],
            )
        return torch.softmax(logits, dim=-1)

    def uniforms(self, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """[num_rows, 1] float64 uniform draws in [0, 1): a seeded row's from its request's
        own generator, so that it gets the same draws whatever else shares its batch."""
        uniform = torch.empty(len(rows), 1, dtype=torch.float64, device=self.device)
        if any(row.generator is None for row in rows):
            uniform.uniform_(generator=self._shared_generator)
        for row_index, row in enumerate(rows):
            if row.generator is not None:
                uniform[row_index].uniform_(generator=row.generator)
        return uniform

    def draw(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """One uniform draw per row, placed on the row's cumulative distribution: exact
        categorical sampling from one random number per row. The exponential race (argmax of
        probs / Exp(1) noise, what GPU engines use) needs one draw per vocabulary entry, and a
        CPU generator makes those one at a time: 52 ms per step for 16 rows of a
        151,936-token vocabulary on a 2-core Zen 3, against 4 ms for this.

        In two levels, so that no pass over the whole vocabulary is serial: the draw first
        picks a block of CDF_BLOCK tokens by the blocks' cumulative mass, then a token by the
        cumulative mass within that block alone. A float64 cumsum over all 151,936 entries of
        64 rows took 38 ms a step there, plus 28 ms to widen them."""
        num_rows, vocab_size = probs.shape
        num_full_blocks = vocab_size // CDF_BLOCK
        full_blocks = probs[:, : num_full_blocks * CDF_BLOCK].view(
            num_rows, num_full_blocks, CDF_BLOCK
        )
        # Each block summed in float32 (pairwise, exact to ~1e-7 of its mass), the blocks'
        # running total in float64: 151,936 terms summed one after another in float32 could
        # drift by a percent of the mass. The last block may be short.
        block_sums = full_blocks.sum(dim=-1)
        if num_full_blocks * CDF_BLOCK < vocab_size:
            tail = probs[:, num_full_blocks * CDF_BLOCK :].sum(dim=-1, keepdim=True)
            block_sums = torch.cat([block_sums, tail], dim=1)
        block_cdf = block_sums.cumsum(dim=-1, dtype=torch.float64)
        total = block_cdf[:, -1:]
        uniform = self.uniforms(rows)
        # Kept strictly below each total: the first entry whose cumulative mass exceeds the
        # target then always has a probability above zero, so a forbidden token never wins.
        target = torch.minimum(uniform * total, _just_below(total))
        block = torch.searchsorted(block_cdf, target, right=True)
        before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
        columns = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)
        past_end = columns >= vocab_size  # of a short last block
        block_probs = probs.gather(1, columns.clamp(max=vocab_size - 1)).masked_fill(past_end, 0)
        local_cdf = block_probs.cumsum(dim=-1, dtype=torch.float64)
        local_target = torch.minimum(target - before, _just_below(local_cdf[:, -1:]))
        within = torch.searchsorted(local_cdf, local_target, right=True)
        # A nan row (which the checks above should leave none of) would land one past its
        # block; kept inside the vocabulary, it costs that request a wrong token, where an id
        # past the end would fail the next step for every request in the batch.
        return (block * CDF_BLOCK + within).squeeze(1).clamp_(max=vocab_size - 1)
