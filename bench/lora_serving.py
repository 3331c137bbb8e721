"""LoRA adapters' cost: greedy decoding with none, one and several adapters in the batch, vacpack
beside vLLM CPU (its own environment, documented settings) on the same model, prompts, adapters
and dtype.

The model is G1's random-weight Qwen2.5-0.5B-shaped checkpoint; the adapters are PEFT LoRA
checkpoints with random A and B on all seven projections (q, k, v, o, gate, up, down), built
once beside it. Runs, each over the same prompts:

- base, LoRA off: an engine without LoRA (vacpack only: the baseline of the overhead);
- base, LoRA on: an engine with LoRA enabled, no request naming an adapter;
- 1 adapter: every prompt with the same adapter;
- N adapters: the prompts spread round-robin over N adapters in one batch.

vacpack's runs are interleaved over --rounds in one process, best of each kept; vLLM runs once
per run after a warm-up of the same run. Reported: output tokens per second, each run against
the same system's base with LoRA on, and vacpack against vLLM.

    python bench/lora_serving.py                              # 16 prompts, 4 adapters of rank 16
    python bench/lora_serving.py --num-adapters 8 --rank 64 --systems vacpack
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import checkpoints
import harness
import vllm_cpu
import workers

from vacpack import LLM, LoRARequest, SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE_OFF, BASE_ON, ONE = "base, LoRA off", "base, LoRA on", "1 adapter"


def log(message: str) -> None:
    harness.log(message, "lora")


def ensure_adapters(model_dir: Path, num_adapters: int, rank: int) -> list[Path]:
    """PEFT adapters with random A and B (B scaled small: the model stays a language model's
    shape of output), built once each beside the model."""
    paths = [model_dir.with_name(f"{model_dir.name}-lora-r{rank}-{i}") for i in range(num_adapters)]
    for index, path in enumerate(paths):
        if (path / "adapter_config.json").exists():
            continue
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        log(f"building adapter {index} (rank {rank}) in {path}")
        torch.manual_seed(index)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGET_MODULES, init_lora_weights=False
        )
        peft_model = get_peft_model(model, config)
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_B" in name:
                    parameter.mul_(0.05)
        peft_model.save_pretrained(path)
    return paths


def run_assignments(num_prompts: int, num_adapters: int) -> dict[str, list[int | None]]:
    """Each run's adapter id per prompt (None: the base model)."""
    return {
        BASE_ON: [None] * num_prompts,
        ONE: [1] * num_prompts,
        f"{num_adapters} adapters": [1 + i % num_adapters for i in range(num_prompts)],
    }


def run_vacpack(
    model_dir: Path, adapters: list[LoRARequest], prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    engine_args = {"dtype": args.dtype, "max_model_len": 2048}
    plain = LLM(str(model_dir), **engine_args)
    lora = LLM(
        str(model_dir), enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank,
        **engine_args,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    by_id = {adapter.lora_int_id: adapter for adapter in adapters}
    runs: dict[str, tuple[LLM, list[LoRARequest | None]]] = {
        BASE_OFF: (plain, [None] * len(prompts))
    }
    for name, ids in run_assignments(len(prompts), len(adapters)).items():
        runs[name] = (lora, [by_id[i] if i is not None else None for i in ids])
    best: dict[str, dict[str, Any]] = {}
    for round_index in range(args.rounds + 1):  # the first round warms up, untimed
        for name, (llm, assigned) in runs.items():
            start_s = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=assigned)
            elapsed_s = time.perf_counter() - start_s
            if round_index == 0:
                continue
            log(f"vacpack round {round_index} {name}: {elapsed_s:.2f} s")
            if name not in best or elapsed_s < best[name]["elapsed_s"]:
                tokens = [o.outputs[0].token_ids for o in outputs]
                best[name] = {"elapsed_s": elapsed_s, "output_token_ids": tokens}
    return {"runs": best, "dtype": plain.loaded.dtype_description}


def run_vllm(
    model_dir: Path, adapters: list[LoRARequest], prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    job = {
        "task": "lora",
        "model_dir": str(model_dir),
        "engine_args": vllm_cpu.engine_args(
            dtype=args.dtype,
            max_model_len=2048,
            enable_lora=True,
            max_loras=len(adapters),
            max_lora_rank=args.rank,
        ),
        "adapters": [
            {"name": a.lora_name, "id": a.lora_int_id, "path": a.lora_path} for a in adapters
        ],
        "prompts": prompts,
        "max_tokens": args.max_tokens,
        "runs": run_assignments(len(prompts), len(adapters)),
    }
    raw = vllm_cpu.run_job(job, "vllm_cpu", "lora", None, args.worker_timeout_s)
    if "error" in raw:
        return raw
    runs = {
        name: {"elapsed_s": run["timed"]["wall_s"], "output_token_ids": run["output_token_ids"]}
        for name, run in raw.pop("runs").items()
    }
    return {"runs": runs} | vllm_cpu.system_fields(raw)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = checkpoints.ensure_qwen2_5_0_5b_shapes_checkpoint(args.model_dir, "lora")
    paths = ensure_adapters(model_dir, args.num_adapters, args.rank)
    adapters = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(paths)]
    prompts = harness.random_token_prompts(
        args.num_prompts, args.prompt_len, args.prompt_len, 151936, seed=0
    )
    systems: dict[str, dict[str, Any]] = {}
    if "vacpack" in args.systems:
        systems["vacpack"] = run_vacpack(model_dir, adapters, prompts, args)
    if "vllm_cpu" in args.systems:
        systems["vllm_cpu"] = run_vllm(model_dir, adapters, prompts, args)
    num_output_tokens = args.num_prompts * args.max_tokens
    for system in systems.values():
        runs = system.get("runs", {})
        for row in runs.values():
            row["output_tokens_per_s"] = num_output_tokens / row["elapsed_s"]
            row["vs_base_lora_on"] = runs[BASE_ON]["elapsed_s"] / row["elapsed_s"]
    ours, theirs = systems.get("vacpack", {}).get("runs", {}), systems.get("vllm_cpu", {})
    for name, row in ours.items():
        if name in theirs.get("runs", {}):
            row["vs_vllm_cpu"] = theirs["runs"][name]["elapsed_s"] / row["elapsed_s"]
            vllm_tokens = theirs["runs"][name]["output_token_ids"]
            row["same_tokens_as_vllm"] = sum(
                a == b for a, b in zip(row["output_token_ids"], vllm_tokens, strict=True)
            )
    return {
        "machine": harness.machine_description(),
        "workload": {
            "model": "random-weight Qwen2.5-0.5B shapes",
            "dtype": args.dtype,
            "num_prompts": args.num_prompts,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "num_adapters": args.num_adapters,
            "rank": args.rank,
            "target_modules": TARGET_MODULES,
            "rounds": args.rounds,
        },
        "systems": systems,
    }


def table(results: dict[str, Any]) -> str:
    workload = results["workload"]
    lines = [
        f"{harness.machine_summary(results['machine'])}; {workload['model']}, "
        f"{workload['dtype']}; {workload['num_prompts']} prompts of {workload['prompt_len']} "
        f"tokens, {workload['max_tokens']} greedy tokens; adapters of rank {workload['rank']} "
        "on q/k/v/o/gate/up/down",
        "",
        "| run | vacpack tok/s | vs base (LoRA on) | vLLM CPU tok/s | vs base (LoRA on) "
        "| vacpack / vLLM |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    systems = results["systems"]
    ours = systems.get("vacpack", {}).get("runs", {})
    theirs = systems.get("vllm_cpu", {}).get("runs", {})
    for name in dict.fromkeys([*ours, *theirs]):
        cells = []
        for runs in (ours, theirs):
            row = runs.get(name)
            cells += (
                [f"{row['output_tokens_per_s']:.1f}", f"{row['vs_base_lora_on']:.2f}x"]
                if row
                else ["-", "-"]
            )
        ratio = ours.get(name, {}).get("vs_vllm_cpu")
        lines.append(f"| {name} | {' | '.join(cells)} | {f'{ratio:.2f}x' if ratio else '-'} |")
    if "error" in systems.get("vllm_cpu", {}):
        lines.append(f"\nvLLM CPU: {systems['vllm_cpu']['error']}")
    return "\n".join(lines)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    systems = {name: s["runs"] for name, s in results["systems"].items() if "runs" in s}
    labels = list(dict.fromkeys(name for runs in systems.values() for name in runs))
    harness.save_paired_bar_chart(
        labels,
        {
            system: [runs[label]["output_tokens_per_s"] if label in runs else 0 for label in labels]
            for system, runs in systems.items()
        },
        plot_path,
        ylabel="output tokens / s",
        title=f"LoRA adapters, {harness.machine_summary(results['machine'])}",
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--systems", default="vacpack,vllm_cpu")
    parser.add_argument("--worker-timeout-s", type=float, default=1800)
    parser.add_argument("--model-dir", type=Path, default=checkpoints.QWEN2_5_0_5B_SHAPES_DIR)
    parser.add_argument(
        "--output", type=Path, default=REPO_ROOT / "bench" / "results" / "lora_serving_cpu.json"
    )
    parser.add_argument("--plot", type=Path, default=None, help="default: --output as .png")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    results = run(args)
    workers.publish_results(results, args.output, args.plot, save_plot, table(results), "lora")


if __name__ == "__main__":
    main()
