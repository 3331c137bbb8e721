"""A generation step asks the model for its sampled rows alone: past the last layer's attention
the other rows stop (no MLP for a prefill's non-final tokens). Those rows' hidden states equal
the whole forward's, in every decoder family, and the engine prunes exactly where nothing else
reads the rows (prompt logprobs keep them all)."""

from __future__ import annotations

import pytest
import torch

from vacpack import LLM, SamplingParams
from vacpack.testing.packed_forward import load_for_test, packed_forward

FAMILIES = ["llama", "qwen2", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_kept_rows_equal_the_whole_forward(family: str, tiny_checkpoint) -> None:
    model = load_for_test(tiny_checkpoint(family))
    assert model.prunes_output_rows
    generator = torch.Generator().manual_seed(0)
    vocab_size = model.config.vocab_size
    sequences = [torch.randint(vocab_size, (n,), generator=generator).tolist() for n in (9, 1, 30)]
    whole = packed_forward(model, sequences)
    # Each sequence's last row, out of stream order, and one row kept twice.
    rows = [39, 9, 8, 0, 9]
    kept = packed_forward(model, sequences, output_rows=rows)
    assert kept.shape == (len(rows), whole.shape[1])
    torch.testing.assert_close(kept, whole[rows], rtol=1e-5, atol=1e-5)
    assert packed_forward(model, sequences, output_rows=[]).shape == (0, whole.shape[1])


class _RowsSeen:
    """Counts the rows that reach a module's forward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.rows: list[int] = []
        module.register_forward_hook(lambda _module, args, _out: self.rows.append(len(args[0])))


def test_the_engine_runs_the_last_mlp_for_sampled_rows_only(tiny_checkpoint) -> None:
    llm = LLM(str(tiny_checkpoint("qwen2")), dtype="float32", max_num_batched_tokens=64)
    first_mlp = _RowsSeen(llm.loaded.model.layers[0].mlp)
    last_mlp = _RowsSeen(llm.loaded.model.layers[-1].mlp)
    # No shared prefix: every prompt token is computed.
    prompts = [
        {"prompt_token_ids": list(range(first, first + n))} for first, n in ((5, 40), (50, 200))
    ]
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    pruned = llm.generate(prompts, greedy)
    # 240 prompt tokens in steps of at most 64: the first layer sees them all, the last one
    # the rows sampled in each step (a prompt's last token, then the decodes).
    assert sum(first_mlp.rows) == 240 + 2
    assert sum(last_mlp.rows) == 2 + 2
    assert 0 in last_mlp.rows  # a step inside the long prompt samples nothing

    # Prompt logprobs read every row: nothing is pruned, and the sampled tokens are the same.
    first_mlp.rows.clear()
    last_mlp.rows.clear()
    with_prompt_logprobs = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    whole = llm.generate(prompts, with_prompt_logprobs)
    assert sum(last_mlp.rows) == sum(first_mlp.rows) == 240 + 2
    assert [o.outputs[0].token_ids for o in whole] == [o.outputs[0].token_ids for o in pruned]
