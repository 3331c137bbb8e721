"""`vacpack bench`: a generation benchmark on random prompts, with the engine's step timeline.

Prompts are random token ids of uniformly drawn lengths (seeded, so runs compare), answered
greedily with ignore_eos, so every request decodes exactly --output-len tokens. The report gives
the throughput and the timeline's device-busy fraction; --timeline draws the host and device
lanes, --json keeps every number and every step record.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from vacpack.cli.demo import demo_model_dir
from vacpack.cli.engine_args import add_engine_args, engine_kwargs
from vacpack.engine.timeline import StepTimeline
from vacpack.llm import LLM
from vacpack.sampling import SamplingParams
from vacpack.tuning import RecordedChoice, audit, recording

# A few short requests before the timed run: first-call costs (allocator growth, kernel
# selection, lazy initialisation) would otherwise land in the first steps of the timeline.
WARMUP_NUM_PROMPTS = 4
WARMUP_OUTPUT_TOKENS = 8


def parse_length_range(text: str) -> tuple[int, int]:
    """'MIN:MAX' (or a single 'N') as an inclusive range of token counts."""
    low_text, _, high_text = text.partition(":")
    try:
        low = int(low_text)
        high = int(high_text) if high_text else low
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX or N, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return low, high


def add_bench_command(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench", help="generation throughput on random prompts, with the step timeline"
    )
    add_engine_args(bench, model_required=False)
    group = bench.add_argument_group("benchmark")
    group.add_argument("--num-prompts", type=int, default=64)
    group.add_argument(
        "--input-len",
        type=parse_length_range,
        default=(128, 512),
        metavar="MIN:MAX",
        help="prompt lengths in tokens, drawn uniformly (default 128:512)",
    )
    group.add_argument("--output-len", type=int, default=128, help="tokens decoded per prompt")
    group.add_argument("--timeline", metavar="PATH", help="plot the step timeline here (.png)")
    group.add_argument(
        "--timeline-steps",
        type=int,
        default=None,
        metavar="N",
        help="plot only N consecutive steps, so that single spans stay visible (default: all)",
    )
    group.add_argument(
        "--timeline-window",
        choices=["start", "middle", "end"],
        default="middle",
        help="which N steps --timeline-steps plots",
    )
    group.add_argument("--json", metavar="PATH", help="write results and step records here")
    group.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run a few short requests first, outside the measurement",
    )
    group.add_argument("--quiet", action="store_true", help="no progress bar")
    group.add_argument(
        "--audit-choices",
        action="store_true",
        help="after the run, time every measured choice's candidates again over many rounds "
        "and report how much slower each chosen one ran than the fastest",
    )
    bench.set_defaults(handler=cmd_bench)


def random_prompts(
    num_prompts: int, length_range: tuple[int, int], vocab_size: int, seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    low, high = length_range
    return [
        [rng.randrange(vocab_size) for _ in range(rng.randint(low, high))]
        for _ in range(num_prompts)
    ]


def cmd_bench(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.output_len < 1:
        raise ValueError("--num-prompts and --output-len must be at least 1")
    model = args.model or str(demo_model_dir())
    # What builds each choice's candidates, kept for --audit-choices (a few closures).
    with recording() as recorded:
        llm = LLM(model, **engine_kwargs(args))
        timeline = llm.engine.timeline  # the engine's attention choices are made here
    max_total_tokens = args.input_len[1] + args.output_len
    if max_total_tokens > llm.loaded.max_model_len:
        raise ValueError(
            f"the longest prompt plus --output-len is {max_total_tokens} tokens, more than "
            f"max_model_len={llm.loaded.max_model_len}"
        )
    # Token ids the model and the tokenizer both know, so outputs detokenize as usual.
    vocab_size = min(llm.loaded.config.vocab_size, len(llm.get_tokenizer()))
    prompts = random_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    if args.warmup:
        # Its own prompts (another seed), so the prefix cache gives the timed run nothing.
        warmup = random_prompts(WARMUP_NUM_PROMPTS, args.input_len, vocab_size, args.seed + 1)
        warmup_params = SamplingParams(max_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in warmup], warmup_params, use_tqdm=False)
    timeline.reset()

    print(
        f"vacpack bench: {len(prompts)} prompts of {args.input_len[0]}-{args.input_len[1]} "
        f"tokens, {args.output_len} output tokens each, on {model} "
        f"({llm.loaded.device}, {llm.loaded.dtype_description})"
    )
    start_s = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=not args.quiet
    )
    elapsed_s = time.perf_counter() - start_s

    # The model's (dtype, elementwise ops) and the engine's (attention and its options).
    measured_choices = llm.loaded.measured_choices + llm.engine.setup.measured_choices
    num_prompt_tokens = sum(len(p) for p in prompts)
    num_output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    results: dict[str, Any] = {
        "model": model,
        "device": str(llm.loaded.device),
        "dtype": llm.loaded.dtype_description,
        "engine_args": engine_kwargs(args),
        "num_prompts": len(prompts),
        "input_len": list(args.input_len),
        "output_len": args.output_len,
        "elapsed_s": elapsed_s,
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
        "output_tokens_per_s": num_output_tokens / elapsed_s,
        "total_tokens_per_s": (num_prompt_tokens + num_output_tokens) / elapsed_s,
        "measured_choices": [c.to_dict() for c in measured_choices],
    }
    print(
        f"throughput: {results['output_tokens_per_s']:.1f} output tok/s, "
        f"{results['total_tokens_per_s']:.1f} total tok/s ({num_prompt_tokens} prompt + "
        f"{num_output_tokens} output tokens in {elapsed_s:.2f} s)"
    )
    for choice in measured_choices:
        print(f"chosen by measurement: {choice.summary()}")
    print(f"timeline: {timeline.summary().describe()}")
    results["timeline"] = timeline.to_dict()
    if args.audit_choices:
        results["choice_audit"] = _audit(recorded)
    if args.timeline:
        _plot(timeline, args)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
        print(f"results -> {path}")
    return 0


def _audit(recorded: list[RecordedChoice]) -> list[dict[str, Any]]:
    """Each choice's candidates timed again (vacpack.tuning.audit), printed and returned."""
    with torch.inference_mode():
        audited = audit(recorded)
    for row in audited:
        choice = row.choice
        timings = ", ".join(f"{name} {s * 1e3:.3g} ms" for name, s in row.best_time_s.items())
        print(
            f"audit: {choice.phase} [{choice.shape_key}]: chose {choice.chosen}, fastest "
            f"{row.fastest}, chosen / fastest {row.chosen_over_fastest:.3f} ({timings})"
        )
    return [row.to_dict() for row in audited]


def _plot(timeline: StepTimeline, args: argparse.Namespace) -> None:
    # Imported only when asked for: matplotlib takes a while to load.
    from vacpack.engine.timeline_plot import plot_timeline

    name = Path(args.model).name if args.model else "built-in demo model"
    plot_timeline(
        timeline,
        args.timeline,
        title=f"vacpack bench: {name}, {args.num_prompts} prompts",
        max_steps=args.timeline_steps,
        window=args.timeline_window,
    )
    print(f"timeline plot -> {args.timeline}")
