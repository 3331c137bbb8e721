"""One engine step's forward on this rank, the part every tensor-parallel rank runs alike.

Inputs go onto the device through the pinned stager, placeholders are filled from the tokens
earlier steps sampled (still on the device), and the model runs eagerly or replays a captured
decode graph. Rank 0's ModelRunner then samples and computes logprobs; the other ranks run
`run_as_worker`, which takes part in the same collectives (the LM-head gathers, the broadcast
of sampled tokens) in the same order, and keeps nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vacpack.attention.backend import AttentionBackend
from vacpack.engine.cuda_graphs import DecodeGraphRunner
from vacpack.engine.step_inputs import StepInputs
from vacpack.kvcache.paged_cache import PagedKVCache
from vacpack.lora.manager import LoraManager
from vacpack.models.base import PackedModel
from vacpack.models.forward_context import ForwardContext, attention_windows
from vacpack.models.parallel import SINGLE_RANK, TensorParallel
from vacpack.pinned_staging import PinnedStager


@dataclass(frozen=True)
class ForwardOutput:
    """A step's forward, on the device."""

    # [rows, hidden_size]: one row per token of the step, or (sampled_only) per sampled row.
    hidden: torch.Tensor
    num_padded_slots: int  # slots a replayed decode graph ran beyond the step's tokens
    sample_rows: torch.Tensor  # [sampled] int64: the stream rows whose logits are sampled
    future_slots: torch.Tensor  # [sampled] int64: where the sampled ids are kept on the device
    sampled_only: bool
    verify_rows: torch.Tensor  # [rows] int64: rows whose greedy tokens verify drafts

    def sampled_hidden(self) -> torch.Tensor:
        """The sampled rows' hidden states, in sampling order."""
        return self.hidden if self.sampled_only else self.hidden.index_select(0, self.sample_rows)

    def verify_hidden(self) -> torch.Tensor:
        """The hidden states of the rows that verify drafts (speculative decoding)."""
        return self.hidden.index_select(0, self.verify_rows)


class StepForward:
    def __init__(
        self,
        model: PackedModel,
        kv_cache: PagedKVCache,
        attention: AttentionBackend,
        device: torch.device,
        max_num_seqs: int,
        graph_runner: DecodeGraphRunner | None = None,
        tp: TensorParallel = SINGLE_RANK,
    ) -> None:
        self.model = model
        self.attention_windows = attention_windows(model)
        self.kv_cache = kv_cache
        self.attention = attention
        self.device = device
        self.graph_runner = graph_runner
        self.tp = tp
        self.lora: LoraManager | None = None  # the engine's adapters, where LoRA is enabled
        self.stager = PinnedStager(device)
        # Sampled token ids stay on the device here so that the next step can read them
        # before the host has. A placeholder lives at most two steps (launched with one step,
        # read back after the next is launched), and a step samples at most max_num_seqs rows,
        # so three steps' worth of slots used round-robin never overwrite a live one.
        self.future_tokens = torch.zeros(3 * max_num_seqs, dtype=torch.int64, device=device)

    def build_metadata(self, inputs: StepInputs) -> Any:
        """The attention backend's metadata for the step; None for a graph replay, whose
        metadata lives in the graph runner's static buffers."""
        return (
            None if inputs.use_graph else self.attention.build_metadata(inputs.layout, self.device)
        )

    def forward(self, inputs: StepInputs, metadata: Any) -> ForwardOutput:
        """The step's hidden states, and where its sampled rows are. Nothing here waits for
        the device."""
        token_ids, positions, sample_rows, future_slots, verify_rows = self.stager.stage(
            [
                inputs.token_ids,
                inputs.positions,
                inputs.sample_rows,
                inputs.future_slots,
                inputs.verify_rows,
            ]
        )
        if inputs.has_placeholders:
            from_future = self.future_tokens[(-token_ids - 1).clamp_(min=0)]
            token_ids = torch.where(token_ids < 0, from_future, token_ids)
        if inputs.use_graph:
            assert self.graph_runner is not None
            replayed = self.graph_runner.run(token_ids, positions, inputs.layout)
            assert replayed is not None, "prepare checked that the graph runner can run it"
            hidden, num_padded_slots = replayed
            return ForwardOutput(
                hidden, num_padded_slots, sample_rows, future_slots, False, verify_rows
            )
        # Where nothing reads the other rows' hidden states (no prompt logprobs, no drafts to
        # verify), the model returns the sampled rows alone: a prefill's last layer runs its
        # MLP for them only.
        # LoRA rows are laid out by the step's whole stream: no row is dropped inside the model.
        sampled_only = (
            self.model.prunes_output_rows
            and not inputs.prompt_passes
            and not inputs.verify_rows
            and not inputs.lora_ids
            and len(inputs.sample_rows) < len(inputs.token_ids)
        )
        ctx = ForwardContext(
            self.attention,
            metadata,
            self.kv_cache,
            output_rows=sample_rows if sampled_only else None,
        )
        if not inputs.lora_ids:
            hidden = self.model(token_ids, positions, ctx)
        else:
            assert self.lora is not None, "a step with adapters runs on an engine with LoRA"
            self.lora.set_batch(inputs.layout.query_lens, inputs.lora_ids)
            try:
                hidden = self.model(token_ids, positions, ctx)
            finally:
                self.lora.clear_batch()
        return ForwardOutput(hidden, 0, sample_rows, future_slots, sampled_only, verify_rows)

    def store_sampled(self, sampled_token_ids: torch.Tensor, future_slots: torch.Tensor) -> None:
        """Keeps the sampled ids for later steps' placeholders."""
        self.future_tokens.index_copy_(0, future_slots, sampled_token_ids)

    def share_sampled(self, sampled_token_ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled ids, on every rank (rank 0 passes its own, the others a buffer of
        the same size)."""
        assert self.tp.collectives is not None
        self.tp.collectives.broadcast(sampled_token_ids)
        return sampled_token_ids

    @torch.inference_mode()
    def run_as_worker(self, inputs: StepInputs) -> None:
        """A rank other than 0: the step's forward and rank 0's LM-head passes (whose gathers
        need every rank), in the order ModelRunner.run makes them."""
        output = self.forward(inputs, self.build_metadata(inputs))
        if inputs.sample_rows:
            self.model.compute_logits(output.sampled_hidden(), dtype=None)
            if inputs.shares_sampled_tokens:
                sampled = torch.empty(
                    len(inputs.sample_rows), dtype=torch.int64, device=self.device
                )
                self.store_sampled(self.share_sampled(sampled), output.future_slots)
        if inputs.verify_rows:
            self.model.compute_logits(output.verify_hidden(), dtype=None)
        for row_start, num_rows in inputs.prompt_passes:
            self.model.compute_logits(output.hidden[row_start : row_start + num_rows])
