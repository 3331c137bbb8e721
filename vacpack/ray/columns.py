"""Reading a batch's model inputs from its columns, and adding the results beside them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from vacpack.tokenizer import apply_chat_template

ERROR_COLUMN = "error"
# A row's own sampling parameters (a struct or a JSON object), over the job's, as in Ray Data.
SAMPLING_PARAMS_COLUMN = "sampling_params"
MESSAGES_COLUMN = "messages"


class RowError(Exception):
    """A row that cannot go into the model; its message goes to the row's error column."""


def per_row(results: list[Any], value: Callable[[Any], Any]) -> list[Any]:
    """`value(result)` per row; None for a row that failed."""
    return [None if result is None else value(result) for result in results]


def first_present(batch: pa.Table, names: Sequence[str]) -> str:
    for name in names:
        if name in batch.column_names:
            return name
    raise ValueError(
        f"the dataset has no input column: expected one of {list(names)} (or name one with "
        f"input_column), got columns {batch.column_names}"
    )


def column_values(batch: pa.Table, name: str) -> list[Any]:
    if name not in batch.column_names:
        raise ValueError(f"the dataset has no column {name!r}; its columns: {batch.column_names}")
    return batch.column(name).to_pylist()


def text_or_token_ids(value: Any, column: str) -> str | list[int] | RowError:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, int) for t in value):
        return value
    return RowError(f"column {column!r} holds {type(value).__name__}, not text or token ids")


def chat_prompt(tokenizer: Any, messages: Any) -> list[int] | RowError:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return RowError(f"column {MESSAGES_COLUMN!r} must hold a list of messages")
    try:
        return apply_chat_template(tokenizer, messages, add_generation_prompt=True)
    except Exception as error:  # a template can raise anything; the row says what
        return RowError(f"the chat template failed: {type(error).__name__}: {error}")


def with_columns(batch: pa.Table, columns: Mapping[str, pa.Array]) -> pa.Table:
    """The batch with `columns` appended; a result column replaces an input of the same name."""
    table = batch.drop_columns([name for name in columns if name in batch.column_names])
    for name, array in columns.items():
        table = table.append_column(name, array)
    return table
