"""`vacpack generate`: completions for prompts given on the command line or in a file."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vacpack.cli.engine_args import add_engine_args, engine_kwargs
from vacpack.llm import LLM
from vacpack.openai_api.served_model import DEFAULT_MAX_N
from vacpack.outputs import RequestOutput
from vacpack.sampling import SamplingParams


def add_generate_command(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser("generate", help="generate completions for prompts")
    add_engine_args(generate)
    _add_sampling_args(generate)
    prompts = generate.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    prompts.add_argument(
        "--input", help="file of prompts: .jsonl (fields override the flags) or one per line"
    )
    generate.add_argument("--output", help="write results as JSONL here, resumably")
    generate.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    generate.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        help=f"most choices (n) one --input line may ask for (default {DEFAULT_MAX_N})",
    )
    generate.add_argument("--quiet", action="store_true", help="no progress bar or texts")
    generate.set_defaults(handler=cmd_generate)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--min-tokens", type=int, default=0)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--n", type=int, default=1)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--logprobs", type=int, default=None)
    group.add_argument(
        "--structured-outputs",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='constrain every output, e.g. \'{"json": {"type": "object"}}\' or \'{"choice": '
        '["yes", "no"]}\' (keys: json, json_object, regex, choice, grammar); a JSONL input '
        'line\'s own "structured_outputs" (or "response_format") wins',
    )


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        structured_outputs=args.structured_outputs,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.prompt and not args.input:
        raise ValueError("give --prompt TEXT or --input FILE")
    params = sampling_params_from_args(args)  # the flags are checked before the model loads
    if args.input or args.output:
        from vacpack.batch.prompt_file import (
            GenerateOptions,
            PromptSource,
            request_defaults,
            run_generate_command,
        )

        source = (
            PromptSource(Path(args.input)) if args.input else PromptSource(texts=tuple(args.prompt))
        )
        if args.n > args.max_n:  # else every line would be refused, after the model loads
            raise ValueError(f"--n {args.n} is above --max-n {args.max_n}")
        options = GenerateOptions(
            Path(args.output) if args.output else None,
            args.overwrite,
            show_progress=not args.quiet,
            max_n=args.max_n,
        )
        defaults = request_defaults(params)
        return run_generate_command(args.model, engine_kwargs(args), source, defaults, options)
    llm = LLM(args.model, **engine_kwargs(args))
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    for output in outputs:
        if not args.quiet or len(outputs) == 1:
            for completion in output.outputs:
                print(f"--- {output.prompt!r}\n{completion.text}")
    print_report(llm, outputs, elapsed)
    return 0


def print_report(llm: LLM, outputs: list[RequestOutput], elapsed_s: float) -> None:
    """Throughput, the engine's totals and its step timeline, on stderr."""
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    state = llm.engine.state()
    print(
        f"\n{len(outputs)} requests in {elapsed_s:.2f} s: "
        f"{num_output / elapsed_s:.1f} output tok/s, "
        f"{(num_prompt + num_output) / elapsed_s:.1f} total tok/s "
        f"({num_prompt} prompt + {num_output} output tokens; "
        f"{state.num_steps} steps, {state.num_preemptions} preemptions; "
        f"{state.describe_prefix_cache()})",
        file=sys.stderr,
    )
    if state.num_draft_tokens:
        print(
            f"speculative decoding: {state.num_accepted_draft_tokens} of "
            f"{state.num_draft_tokens} draft tokens accepted ({state.draft_acceptance_rate:.1%})",
            file=sys.stderr,
        )
    print(f"step timeline: {llm.engine.timeline.summary().describe()}", file=sys.stderr)
