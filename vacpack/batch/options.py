"""Batch-run options: a frozen config, and the `vacpack run-batch` flags that fill it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from vacpack.lora.modules import add_lora_modules_arg
from vacpack.openai_api.served_model import DEFAULT_MAX_N, DEFAULT_MAX_SEQUENCES_PER_REQUEST


@dataclass(frozen=True)
class BatchOptions:
    input_path: Path
    output_path: Path
    # Engine requests (prompts) taken in at once. More than the engine runs at once keeps its
    # waiting queue full between steps; a bound keeps memory flat however long the file is.
    # None: twice the engine's max_num_seqs.
    max_in_flight: int | None = None
    # 0: every record is fsynced as it is written (about 0.2 ms each on an SSD), so even a power
    # cut loses at most the record being written; more trades that for fewer fsyncs.
    fsync_interval_s: float = 0.0
    show_progress: bool = True
    # Replace an existing output file that is not an earlier run's output for this input.
    overwrite: bool = False
    # The model name lines may give (and responses carry), as the server's --served-model-name;
    # None: the --model argument. A line naming another model gets a 404, as from the server.
    served_model_name: str | None = None
    # The most choices (n) one line may ask for, as the server's --max-n.
    max_n: int = DEFAULT_MAX_N
    # The most sequences (prompts x n) one line may start, as the server's
    # --max-sequences-per-request.
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    # LoRA adapters lines may name as their model, as the server's --lora-modules.
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_sequences_per_request < 1:
            raise ValueError(
                f"max_sequences_per_request must be >= 1, got {self.max_sequences_per_request}"
            )
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.fsync_interval_s < 0:
            raise ValueError(f"fsync_interval_s must be >= 0, got {self.fsync_interval_s}")
        if Path(self.input_path).resolve() == Path(self.output_path).resolve():
            raise ValueError("the output file must not be the input file")


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("batch")
    group.add_argument("-i", "--input-file", required=True, help="OpenAI batch input (JSONL)")
    group.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="results (JSONL); an earlier run's output for this input is resumed, any other "
        "existing file refused",
    )
    group.add_argument(
        "--overwrite", action="store_true", help="replace an existing output file instead"
    )
    group.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="prompts held at once (default: twice --max-num-seqs)",
    )
    group.add_argument(
        "--fsync-interval-s",
        type=float,
        default=0.0,
        help="fsync the output at most this often (default 0: after every record)",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        help="the model name lines may give in their body (default: --model); lines naming "
        "another model get a 404 record",
    )
    add_lora_modules_arg(group)
    group.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        help=f"most choices (n) one line may ask for (default {DEFAULT_MAX_N})",
    )
    group.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        help="most sequences (prompts x n) one line may start "
        f"(default {DEFAULT_MAX_SEQUENCES_PER_REQUEST})",
    )
    group.add_argument("--quiet", action="store_true", help="no progress bar")


def batch_options_from_args(args: argparse.Namespace) -> BatchOptions:
    return BatchOptions(
        input_path=Path(args.input_file),
        output_path=Path(args.output_file),
        max_in_flight=args.max_in_flight,
        fsync_interval_s=args.fsync_interval_s,
        show_progress=not args.quiet,
        overwrite=args.overwrite,
        served_model_name=args.served_model_name,
        max_n=args.max_n,
        max_sequences_per_request=args.max_sequences_per_request,
        lora_modules=tuple(args.lora_modules),
    )
