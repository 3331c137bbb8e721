"""A mixture-of-experts model's prefill and decode on a CPU: vacpack against transformers at
the same shapes.

A random-weight Qwen3-MoE-style checkpoint (default: 16 layers, hidden 1024, 32 experts of 512
intermediate features, 4 per token; about 0.9 B parameters, 0.3 B active per token), bfloat16,
random-token prompts (seed 0). Two workloads, each system in its own worker process:

- prefill: --num-prompts prompts of --prompt-len tokens, one output token each. vacpack packs
  them into steps of its token budget; transformers runs them as one batch (equal lengths, so
  no padding) in one forward.
- decode: the same prompts generating --max-tokens greedy tokens (EOS ignored), as one batch.
  Decode throughput is (output tokens - one per prompt) / (generate time - prefill time), the
  prefill time being the prefill workload's.

vacpack groups each step's tokens by expert (one matmul per expert that received any);
transformers loops over the experts that received tokens too, gathering them with a mask.

Full run (a few minutes on a quiet 2-core CPU):
    python bench/moe.py
Quick check:
    python bench/moe.py --shape tiny --num-prompts 2 --prompt-len 16 --max-tokens 4 \\
        --output bench/results/tmp/moe.json --plot bench/results/tmp/moe.png
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
SYSTEMS = ("vacpack", "transformers")
WORKLOADS = ("prefill", "decode")
FORWARDED = ("model_dir", "num_prompts", "prompt_len", "max_tokens", "dtype", "threads")

SHAPES: dict[str, dict[str, Any]] = {
    "moe-0.9b": {
        "hidden_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 2048,  # unused: every layer is sparse
        "moe_intermediate_size": 512,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "max_position_embeddings": 1024,
    },
}


def log(message: str) -> None:
    harness.log(message, "moe")


def ensure_checkpoint(shape: str, model_dir: Path, dtype: torch.dtype) -> Path:
    if (model_dir / "config.json").exists():
        return model_dir
    from vacpack.testing.tiny_models import build_random_checkpoint

    log(f"building the random-weight {shape} checkpoint in {model_dir}")
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    partial_dir = model_dir.with_name(f"{model_dir.name}.partial-{os.getpid()}")
    build_random_checkpoint(SHAPES[shape], "qwen3_moe", partial_dir, dtype=dtype)
    partial_dir.rename(model_dir)
    return model_dir


def prompts_for(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    shape = (args.num_prompts, args.prompt_len)
    return torch.randint(0, vocab_size, shape, generator=generator).tolist()


def run_vacpack(args: argparse.Namespace, max_tokens: int) -> dict[str, Any]:
    from vacpack import LLM, SamplingParams

    llm = LLM(str(args.model_dir), dtype=args.dtype, device="cpu")
    prompts = prompts_for(args, llm.loaded.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    with process_timing.timed_section() as section:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {**section.fields(), "output_tokens": num_output, **harness.vacpack_engine_fields(llm)}


def run_transformers(args: argparse.Namespace, max_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    model = model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompts = torch.tensor(prompts_for(args, int(model.config.vocab_size)))

    def generate(input_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
        )

    with torch.inference_mode():
        generate(prompts[:1], 2)  # warm-up
        with process_timing.timed_section() as section:
            sequences = generate(prompts, max_tokens)
    num_output = (sequences.shape[1] - prompts.shape[1]) * sequences.shape[0]
    return {**section.fields(), "output_tokens": num_output}


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    system, workload = args.worker.split(":")
    torch.set_num_threads(args.threads or torch.get_num_threads())
    max_tokens = 1 if workload == "prefill" else args.max_tokens
    runner = run_vacpack if system == "vacpack" else run_transformers
    log(f"{system} {workload}: {args.num_prompts} x {args.prompt_len} tokens, {max_tokens} out")
    return workers.run_catching_errors(lambda: runner(args, max_tokens))


def summarise(results: dict[str, Any], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Prefill tokens/s and decode tokens/s per system."""
    summary: dict[str, dict[str, float]] = {}
    prompt_tokens = args.num_prompts * args.prompt_len
    for system in SYSTEMS:
        prefill, decode = results[f"{system}:prefill"], results[f"{system}:decode"]
        if "error" in prefill or "error" in decode:
            continue
        decode_s = decode["wall_s"] - prefill["wall_s"]
        decode_tokens = decode["output_tokens"] - args.num_prompts
        summary[system] = {
            "prefill_tokens_per_s": prompt_tokens / prefill["wall_s"],
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else float("nan"),
        }
    return summary


def table(summary: dict[str, dict[str, float]]) -> str:
    lines = ["| system | prefill tokens/s | decode tokens/s |", "|---|---|---|"]
    for system, row in summary.items():
        lines.append(
            f"| {system} | {row['prefill_tokens_per_s']:.0f} | {row['decode_tokens_per_s']:.1f} |"
        )
    if len(summary) == len(SYSTEMS):
        ours, theirs = summary["vacpack"], summary["transformers"]
        prefill = ours["prefill_tokens_per_s"] / theirs["prefill_tokens_per_s"]
        decode = ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
        lines.append(f"\nvacpack / transformers: prefill {prefill:.2f}x, decode {decode:.2f}x")
    return "\n".join(lines)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    values = {
        f"{system}\n{kind}": row[f"{kind}_tokens_per_s"]
        for system, row in results["summary"].items()
        for kind in WORKLOADS
    }
    harness.save_bar_chart(
        values, plot_path, ylabel="tokens / s", title="MoE prefill and decode on CPU"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="moe-0.9b")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/moe_cpu.json")
    parser.add_argument("--plot", type=Path, default=None, help="default: --output as .png")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model_dir is None:
        args.model_dir = checkpoints.CHECKPOINT_CACHE_DIR / f"moe-{args.shape}-{args.dtype}"
    return args


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        workers.save_worker_result(run_worker(args), args.worker_output)
        return
    ensure_checkpoint(args.shape, args.model_dir, getattr(torch, args.dtype))
    results: dict[str, Any] = {"machine": harness.machine_description(), "args": vars(args)}
    results["args"] = {key: str(value) for key, value in vars(args).items()}
    for system in SYSTEMS:
        for workload in WORKLOADS:
            name = f"{system}:{workload}"
            results[name] = workers.run_worker(
                lambda output, name=name: workers.worker_command(
                    __file__, name, output, args, FORWARDED
                ),
                name,
                "moe",
            )
    results["summary"] = summarise(results, args)
    workers.publish_results(
        results, args.output, args.plot, save_plot, table(results["summary"]), "moe"
    )


if __name__ == "__main__":
    main()
