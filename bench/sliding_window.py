"""A long sliding-window decode's KV memory, against the same model without the window.

A random-weight Mistral-style checkpoint (default: 8 layers, hidden 1024, 16 query and 4 KV
heads of 64 dimensions), built twice: with a --window-token sliding window on every layer, and
without one. Each runs --num-seqs random-token prompts of --prompt-len tokens generating
--max-tokens greedy tokens (EOS ignored), on the portable attention backend for both (the only
one that honours windows on a CPU, so that attention speed is compared like for like), in its
own worker process.

Reported per model: the peak KV memory the sequences held (pages in use at the fullest step
times the bytes of a page), the pages held at the end of the run's last decode step, decode
throughput, and preemptions. With the window, pages wholly behind every layer's window go back
to the pool as a sequence advances, so its KV memory stays at about window / page_size pages a
sequence however long it decodes.

Full run (a few minutes on a quiet 2-core CPU):
    python bench/sliding_window.py
Quick check:
    python bench/sliding_window.py --shape tiny --window 32 --prompt-len 16 --max-tokens 96 \\
        --output bench/results/tmp/window.json --plot bench/results/tmp/window.png
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import checkpoints
import harness
import process_timing
import torch
import workers

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS = ("windowed", "full")
FORWARDED = ("model_dir", "num_seqs", "prompt_len", "max_tokens", "dtype", "block_size")

SHAPES: dict[str, dict[str, Any]] = {
    "mistral-0.2b": {
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 2816,
        "vocab_size": 32000,
        "max_position_embeddings": 16384,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
    },
}


def log(message: str) -> None:
    harness.log(message, "window")


def ensure_checkpoint(args: argparse.Namespace, model: str) -> Path:
    model_dir = args.model_root / f"{args.shape}-{model}-{args.window}-{args.dtype}"
    if (model_dir / "config.json").exists():
        return model_dir
    from vacpack.testing.tiny_models import build_random_checkpoint

    log(f"building the random-weight {args.shape} checkpoint ({model}) in {model_dir}")
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    partial_dir = model_dir.with_name(f"{model_dir.name}.partial-{os.getpid()}")
    window = args.window if model == "windowed" else None
    config = {**SHAPES[args.shape], "sliding_window": window}
    # The same seed: the two checkpoints hold the same weights.
    build_random_checkpoint(config, "mistral", partial_dir, dtype=getattr(torch, args.dtype))
    partial_dir.rename(model_dir)
    return model_dir


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    from vacpack import LLM, SamplingParams

    def run() -> dict[str, Any]:
        llm = LLM(
            str(args.model_dir),
            dtype=args.dtype,
            device="cpu",
            attention_backend="torch_sdpa",
            block_size=args.block_size,
            max_model_len=args.prompt_len + args.max_tokens + 1,
        )
        vocab_size = llm.loaded.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        shape = (args.num_seqs, args.prompt_len)
        prompts = torch.randint(0, vocab_size, shape, generator=generator).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        with process_timing.timed_section() as section:
            llm.generate(prompts, params, use_tqdm=False)
        engine = llm.engine
        steps = engine.timeline.steps
        page_bytes = engine.kv_cache.num_bytes // engine.kv_cache.num_pages
        decode_steps = [s for s in steps if s.num_prefill_tokens == 0]
        decode_s = sum(s.device_end_s - s.device_start_s for s in decode_steps)
        return {
            **section.fields(),
            "sliding_window": llm.loaded.config.kv_window,
            "kv_page_bytes": page_bytes,
            "peak_kv_pages": max(s.kv_pages_used for s in steps),
            "peak_kv_bytes": max(s.kv_pages_used for s in steps) * page_bytes,
            "last_step_kv_pages": steps[-1].kv_pages_used,
            "decode_tokens_per_s": sum(s.num_decode_tokens for s in decode_steps) / decode_s,
            "num_preemptions": engine.state().num_preemptions,
            **harness.vacpack_engine_fields(llm),
        }

    log(f"{args.worker}: {args.num_seqs} x {args.prompt_len} tokens, {args.max_tokens} out")
    return workers.run_catching_errors(run)


def table(results: dict[str, Any]) -> str:
    lines = [
        "| model | peak KV MiB | peak KV pages | decode tokens/s | preemptions |",
        "|---|---|---|---|---|",
    ]
    for model in MODELS:
        row = results[model]
        if "error" in row:
            lines.append(f"| {model} | {harness.markdown_cell(row['error'])} | | | |")
            continue
        lines.append(
            f"| {model} | {row['peak_kv_bytes'] / 2**20:.1f} | {row['peak_kv_pages']} | "
            f"{row['decode_tokens_per_s']:.1f} | {row['num_preemptions']} |"
        )
    return "\n".join(lines)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    values = {
        model: results[model]["peak_kv_bytes"] / 2**20
        for model in MODELS
        if "error" not in results[model]
    }
    harness.save_bar_chart(
        values,
        plot_path,
        ylabel="peak KV cache in use (MiB)",
        title=f"decode of {results['args']['max_tokens']} tokens, window "
        f"{results['args']['window']}",
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mistral-0.2b")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model-root", type=Path, default=checkpoints.CHECKPOINT_CACHE_DIR)
    parser.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--output", type=Path, default=REPO_ROOT / "bench/results/sliding_window_cpu.json"
    )
    parser.add_argument("--plot", type=Path, default=None, help="default: --output as .png")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        workers.save_worker_result(run_worker(args), args.worker_output)
        return
    results: dict[str, Any] = {
        "machine": harness.machine_description(),
        "args": {key: str(value) for key, value in vars(args).items()},
    }
    for model in MODELS:
        args.model_dir = ensure_checkpoint(args, model)
        results[model] = workers.run_worker(
            lambda output, model=model: workers.worker_command(
                __file__, model, output, args, FORWARDED
            ),
            model,
            "window",
        )
    workers.publish_results(results, args.output, args.plot, save_plot, table(results), "window")


if __name__ == "__main__":
    main()
