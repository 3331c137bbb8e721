"""The `vacpack` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vacpack import __version__
from vacpack.bench_command import add_bench_command
from vacpack.corpus.commands import add_corpus_commands, run_corpus_command
from vacpack.structured.params import StructuredOutputsParams


def _add_engine_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", required=model_required, help="local checkpoint dir or hub id")
    group.add_argument("--tokenizer", default=None)
    group.add_argument("--dtype", default="auto", help="auto, bfloat16, float16, float32")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--trust-remote-code", action="store_true")
    group.add_argument("--attention-backend", default="auto", help="auto, or a backend's name")
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prepare step N+1 while the device runs step N (default: on for CUDA)",
    )
    group.add_argument(
        "--no-cuda-graphs",
        dest="enable_cuda_graphs",
        action="store_false",
        help="run every decode step eagerly",
    )


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = [
        "tokenizer", "dtype", "device", "max_model_len", "max_num_seqs",
        "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes", "seed",
        "trust_remote_code", "attention_backend", "async_scheduling", "enable_cuda_graphs",
    ]  # fmt: skip
    return {name: getattr(args, name) for name in names}


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
        'line\'s own "structured_outputs" wins',
    )


def _sampling_params(args: argparse.Namespace):
    from vacpack.sampling import SamplingParams

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


def read_prompts(path: Path) -> Iterator[tuple[str, StructuredOutputsParams | None]]:
    """(prompt, structured_outputs or None) from JSONL ({"prompt": ...} or {"text": ...} per
    line, optionally with "structured_outputs": {...}) or plain text lines."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: not valid JSON: {error}") from None
                if not isinstance(record, dict) or not isinstance(
                    record.get("prompt", record.get("text")), str
                ):
                    raise ValueError(f'{path}:{number}: expected {{"prompt": "..."}}')
                structured = record.get("structured_outputs")
                if structured is not None:
                    try:
                        structured = StructuredOutputsParams.from_dict(structured)
                    except ValueError as error:
                        raise ValueError(f"{path}:{number}: {error}") from None
                yield record.get("prompt", record.get("text")), structured
            else:
                yield line, None


def cmd_generate(args: argparse.Namespace) -> int:
    from vacpack.llm import LLM

    records = [(prompt, None) for prompt in args.prompt or []]
    if args.input:
        records.extend(read_prompts(Path(args.input)))
    if not records:
        print("vacpack generate: give --prompt TEXT or --input FILE", file=sys.stderr)
        return 2
    params = _sampling_params(args)
    prompts = [prompt for prompt, _ in records]
    params_list = [
        params if structured is None else dataclasses.replace(params, structured_outputs=structured)
        for _, structured in records
    ]
    llm = LLM(args.model, **_engine_kwargs(args))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params_list, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    sink = open(args.output, "w", encoding="utf-8") if args.output else None  # noqa: SIM115
    try:
        for output in outputs:
            record = {
                "prompt": output.prompt,
                "outputs": [
                    {
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                        "num_tokens": len(c.token_ids),
                    }
                    for c in output.outputs
                ],
            }
            if sink:
                sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            elif not args.quiet or len(outputs) == 1:
                for completion in output.outputs:
                    print(f"--- {output.prompt!r}\n{completion.text}")
    finally:
        if sink:
            sink.close()
    print_report(llm, outputs, elapsed)
    return 0


def print_report(llm: Any, outputs: list[Any], elapsed_s: float) -> None:
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    stats = llm.engine.stats
    cache = llm.engine.page_pool.stats
    print(
        f"\n{len(outputs)} requests in {elapsed_s:.2f} s: "
        f"{num_output / elapsed_s:.1f} output tok/s, "
        f"{(num_prompt + num_output) / elapsed_s:.1f} total tok/s "
        f"({num_prompt} prompt + {num_output} output tokens; "
        f"{stats.num_steps} steps, {stats.num_preemptions} preemptions; prefix cache hit rate "
        f"{cache.hit_rate:.1%}, {cache.num_evictions} evictions)",
        file=sys.stderr,
    )
    timeline = getattr(llm.engine, "timeline", None)
    if timeline is not None:
        print(f"step timeline: {timeline.summary().describe()}", file=sys.stderr)


def cmd_demo(args: argparse.Namespace) -> int:
    from vacpack.demo import run_demo

    return run_demo(num_prompts=args.num_prompts, max_tokens=args.max_tokens)


def cmd_serve(args: argparse.Namespace) -> int:
    from vacpack.server.config import server_config_from_args
    from vacpack.server.launch import serve

    return serve(args.model, _engine_kwargs(args), server_config_from_args(args))


def cmd_run_batch(args: argparse.Namespace) -> int:
    from vacpack.batch.options import batch_options_from_args
    from vacpack.batch.runner import run_batch_command

    return run_batch_command(args.model, _engine_kwargs(args), batch_options_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vacpack", description=__doc__)
    parser.add_argument("--version", action="version", version=f"vacpack {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate completions for prompts")
    _add_engine_args(generate)
    _add_sampling_args(generate)
    generate.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    generate.add_argument("--input", help="file of prompts: .jsonl or one per line")
    generate.add_argument("--output", help="write results as JSONL here")
    generate.add_argument("--quiet", action="store_true", help="no progress bar or texts")
    generate.set_defaults(handler=cmd_generate)

    add_corpus_commands(commands, _add_engine_args)
    add_bench_command(commands, _add_engine_args)

    demo = commands.add_parser("demo", help="the built-in job: a bundled batch on a built-in model")
    demo.add_argument("--num-prompts", type=int, default=32)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.set_defaults(handler=cmd_demo)

    from vacpack.batch.options import add_batch_args
    from vacpack.server.config import add_server_args

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server")
    _add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(handler=cmd_serve)

    run_batch = commands.add_parser("run-batch", help="answer an OpenAI batch file, resumably")
    _add_engine_args(run_batch)
    add_batch_args(run_batch)
    run_batch.set_defaults(handler=cmd_run_batch)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "corpus_command", False):
            return run_corpus_command(args, _engine_kwargs(args))
        return args.handler(args)
    except ValueError as error:
        print(f"vacpack {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
