"""Load a checkpoint and run one packed, prefill-only forward: what tests compare to references."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from vacpack.attention import BatchLayout, create_backend
from vacpack.models.base import PackedModel
from vacpack.models.forward_context import ForwardContext, attention_windows
from vacpack.models.loader import load_hf_config, load_model

CPU = torch.device("cpu")


def load_for_test(model_dir: Path, dtype: torch.dtype = torch.float32) -> PackedModel:
    """Our model for a checkpoint directory, on the CPU, as the engine would load it."""
    return load_model(Path(model_dir), load_hf_config(Path(model_dir)), dtype, CPU)


@torch.inference_mode()
def packed_forward(
    model: PackedModel,
    sequences: Sequence[Sequence[int]],
    attention_backend: str = "torch_sdpa",
    output_rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """Final hidden states [total tokens, hidden] of all sequences packed into one stream (or
    of the stream's `output_rows` alone, as a generation step asks a model for its sampled rows).

    Attention is bidirectional within each sequence for encoders (model.is_causal False) and
    causal for decoders, through `attention_backend` (the portable one unless named); no KV
    cache is kept.
    """
    seq_lens = [len(tokens) for tokens in sequences]
    layout = BatchLayout(
        seq_lens,
        seq_lens,
        causal=getattr(model, "is_causal", True),
        attention_windows=attention_windows(model),
    )
    backend = create_backend(attention_backend)
    ctx = ForwardContext(
        backend,
        backend.build_metadata(layout, CPU),
        kv_cache=None,
        output_rows=None if output_rows is None else torch.tensor(output_rows, dtype=torch.int64),
    )
    token_ids = torch.tensor([token for tokens in sequences for token in tokens])
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    return model(token_ids, positions, ctx)
