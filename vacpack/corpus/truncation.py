"""vLLM's `truncate_prompt_tokens` on pooling jobs (embed, classify, score and rerank).

The value follows generation's rule (vacpack.sampling: None, -1 or k >= 1), with two
differences that are vLLM's for pooling:

- -1 keeps max_model_len tokens, not max_model_len - 1: a pooling job generates nothing.
- k keeps each input's first k tokens, not its last: vLLM tokenizes pooling inputs with
  right-side truncation (generation alone truncates on the left), as sentence-transformers cuts
  at its max_seq_length. Text is cut by the tokenizer itself (`truncation=True, max_length=k`),
  so the special tokens it adds stay: a BERT input keeps its [CLS] and [SEP] (pooling reads
  [CLS]; dropping it would embed garbage), a pair `[CLS] A [SEP] B [SEP]` loses tokens from its
  longer text first. Token-id inputs are the caller's own tokens: their first k are kept.

A k that leaves no room for text is refused: the tokenizer ignores a max_length below its
special tokens (the input would silently stay whole), and at exactly that many it keeps the
special tokens alone. So k must hold the special tokens plus one token of each text.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from vacpack.sampling import check_truncate_prompt_tokens, prompt_tokens_to_keep


def pooling_tokens_to_keep(
    truncate_prompt_tokens: int | None,
    max_model_len: int,
    tokenizer: PreTrainedTokenizerBase,
    reads_pairs: bool,
) -> int | None:
    """How many tokens of each input a pooling job keeps (None: all of them); ValueError naming
    the field and the limits for a value it cannot take. `reads_pairs`: the inputs are text
    pairs the tokenizer joins with its own special tokens (a cross-encoder's)."""
    check_truncate_prompt_tokens(truncate_prompt_tokens, max_model_len)
    keep = prompt_tokens_to_keep(truncate_prompt_tokens, max_model_len)
    fewest = fewest_tokens_to_keep(tokenizer, reads_pairs)
    if keep is not None and keep < fewest:
        num_special = tokenizer.num_special_tokens_to_add(pair=reads_pairs)
        unit = "text pair" if reads_pairs else "text"
        raise ValueError(
            f"truncate_prompt_tokens must be -1 or in [{fewest}, {max_model_len}] for this "
            f"model, got {truncate_prompt_tokens}: its tokenizer adds {num_special} special "
            f"tokens to each {unit}, and at least one token of each text must stay"
        )
    return keep


def fewest_tokens_to_keep(tokenizer: PreTrainedTokenizerBase, reads_pairs: bool) -> int:
    """The smallest count that keeps the special tokens and one token of each text."""
    num_texts = 2 if reads_pairs else 1
    return tokenizer.num_special_tokens_to_add(pair=reads_pairs) + num_texts
