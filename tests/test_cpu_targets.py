"""bench/cpu_targets.py: the CPU issue's targets read from the results committed in bench/results
(the Zen 3 session's, untagged), checked against numbers read off those files by hand; a tag
whose files are missing; and the CPU tag each kind of machine gets."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
RESULTS_DIR = BENCH_DIR / "results"


def load_bench_module(name: str) -> ModuleType:
    """bench/ is a folder of scripts, not a package: a module is loaded from its file, after
    the neighbours it imports. Registered in sys.modules first, as dataclasses need."""
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


load_bench_module("cpu_target_measures")  # what each target reads, which cpu_targets imports
cpu_targets = load_bench_module("cpu_targets")

# The committed Zen 3 results under the names the session script now writes, where they differ.
COMMITTED = {
    "g1_generate": RESULTS_DIR / "g1_qwen2.5-0.5b_cpu_bf16.json",
    "e1_bf16": RESULTS_DIR / "e1_cpu_bf16_weights_avx2.json",
}
ZEN3_CPU = "AMD EPYC, 2 cores, no AVX-512"


def test_committed_zen3_results_give_every_target() -> None:
    files = cpu_targets.result_files("", RESULTS_DIR, COMMITTED)
    rows = {row.target: row for row in cpu_targets.read_targets(files)}
    assert len(rows) == len(cpu_targets.TARGETS)

    # Wall times as the files (and the README's tables) give them; each benchmark's ratio is
    # vacpack's throughput over the baseline's, the inverse ratio of their wall times.
    expected = {
        "G1 vs vLLM CPU": 301.617 / 223.491,  # g1_qwen2.5-0.5b_cpu.json
        "P1 vs vLLM CPU": 267.751 / 210.598,  # p1_cpu.json
        "E1 vs vLLM CPU": 87.402 / 70.808,  # e1_cpu.json, float32
        "shared prompt vs vLLM CPU": 144.907 / 113.960,  # prefix_cpu.json
        "G1 vs transformers generate": 3446.197 / 234.141,  # ..._cpu_bf16.json
        "E1 bf16 vs sentence-transformers bf16": 61.757 / 5.921,  # e1_cpu_bf16_weights_avx2.json
        # 944,431,104 KV bytes per step in 61.763 ms against a 23.231 GB/s copy.
        "decode attention KV read / copy bandwidth": 944_431_104 / 61.763e-3 / 23.231e9,
        "choice audit, G1's model": 1.0,  # every one of 17 choices its fastest
        "choice audit, E1's encoder": 1.0879,  # cpu_linear q/k/v: oneDNN chosen, C kernel fastest
    }
    for name, value in expected.items():
        row = rows[name]
        assert row.measured == pytest.approx(value, rel=1e-3), name
        assert row.met is True, name
        assert row.cpu == ZEN3_CPU, name
    assert rows["G1 vs vLLM CPU"].file == "bench/results/g1_qwen2.5-0.5b_cpu.json"
    assert "223.5 s" in rows["G1 vs vLLM CPU"].detail
    assert "heads in lanes" in rows["decode attention KV read / copy bandwidth"].detail
    assert rows["choice audit, E1's encoder"].comparison == "<="
    assert "6 of 6 choices within 10%" in rows["choice audit, E1's encoder"].detail


ZEN4_CPU = "AMD EPYC, 2 cores (avx512_bf16, avx512f)"


def test_committed_zen4_results_give_every_target() -> None:
    """The Zen 4 session's files (tag zen4, bf16): every target read, met or not as measured."""
    files = cpu_targets.result_files("zen4", RESULTS_DIR, {})
    rows = {row.target: row for row in cpu_targets.read_targets(files)}
    assert len(rows) == len(cpu_targets.TARGETS)
    expected = {
        "G1 vs vLLM CPU": (97.445 / 87.778, False),  # g1_qwen2.5-0.5b_cpu_zen4.json
        "P1 vs vLLM CPU": (104.538 / 93.189, False),  # p1_cpu_zen4.json
        "E1 vs vLLM CPU": (34.544 / 28.699, True),  # e1_cpu_zen4.json
        "shared prompt vs vLLM CPU": (56.411 / 48.656, False),  # prefix_cpu_zen4.json
        "G1 vs transformers generate": (289.877 / 92.402, False),
        "E1 bf16 vs sentence-transformers bf16": (44.830 / 29.753, False),
        # 472,215,552 KV bytes per step in 24.811 ms against a 55.871 GB/s copy.
        "decode attention KV read / copy bandwidth": (
            472_215_552 / 24.811e-3 / 55.871e9,
            False,
        ),
        "choice audit, G1's model": (1.0935, True),
        "choice audit, E1's encoder": (1.0, True),
    }
    for name, (value, met) in expected.items():
        row = rows[name]
        assert row.measured == pytest.approx(value, rel=1e-3), name
        assert row.met is met, name
        assert row.cpu == ZEN4_CPU, name
    assert "C paged kernel" in rows["decode attention KV read / copy bandwidth"].detail


def test_missing_files_are_rows_without_a_value(tmp_path: Path) -> None:
    # The Xeon's decode attention is committed; nothing else was run there with that tag.
    files = cpu_targets.result_files("xeon_amx", RESULTS_DIR)
    rows = {row.target: row for row in cpu_targets.read_targets(files)}
    decode = rows.pop("decode attention KV read / copy bandwidth")
    assert decode.measured == pytest.approx(7.758 / 23.161, rel=1e-3)  # the C paged kernel
    assert decode.met is False and "amx_tile" in decode.cpu
    assert decode.file == "bench/results/decode_attention_cpu_xeon_amx.json"
    for row in rows.values():
        assert (row.measured, row.met, row.cpu) == (None, None, None)
        assert row.detail.startswith("no file") and row.file.endswith("_xeon_amx.json")

    broken = tmp_path / "p1.json"
    broken.write_text("{not json")
    failed_vllm = tmp_path / "g1.json"
    failed_vllm.write_text('{"systems": {"vacpack": {"wall_s": 1.0}, "vllm_cpu": {"error": "x"}}}')
    files = cpu_targets.result_files("none", tmp_path, {"p1": broken, "g1_vllm": failed_vllm})
    rows = {row.target: row for row in cpu_targets.read_targets(files)}
    assert rows["P1 vs vLLM CPU"].met is None and "unreadable" in rows["P1 vs vLLM CPU"].detail
    assert rows["G1 vs vLLM CPU"].met is None and "vllm_cpu: x" in rows["G1 vs vLLM CPU"].detail


def test_files_from_before_the_run_are_marked_stale(tmp_path: Path) -> None:
    p1 = tmp_path / "p1.json"
    p1.write_text((RESULTS_DIR / "p1_cpu.json").read_text())
    written_s = p1.stat().st_mtime
    target = next(t for t in cpu_targets.TARGETS if t.source == "p1")
    earlier = cpu_targets.read_target(target, p1, since=written_s + 60)
    assert earlier.stale and earlier.met is True
    assert cpu_targets.status(earlier) == "met (earlier run)"
    assert not cpu_targets.read_target(target, p1, since=written_s - 60).stale
    assert not cpu_targets.read_target(target, p1).stale and earlier.written is not None


def test_main_writes_the_table_json_and_chart(tmp_path: Path) -> None:
    output = tmp_path / "targets.json"
    argv = ["--tag", "", "--output", str(output)]
    argv += [f"--file={source}={path}" for source, path in COMMITTED.items()]
    assert cpu_targets.main(argv) == 0
    written = json.loads(output.read_text())
    assert written["cpus"] == [ZEN3_CPU]
    assert [row["met"] for row in written["rows"]] == [True] * len(cpu_targets.TARGETS)
    assert output.with_suffix(".png").stat().st_size > 0


def cpuinfo(vendor: str, family: int, model: int, flags: str) -> str:
    fields = (
        f"vendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\nflags\t\t: {flags}"
    )
    return f"processor\t: 0\n{fields}\n\nprocessor\t: 1\n{fields}\n"


@pytest.mark.parametrize(
    ("text", "tag", "dtype"),
    [
        (cpuinfo("AuthenticAMD", 25, 1, "fma avx avx2"), "zen3", "float32"),
        (cpuinfo("AuthenticAMD", 25, 17, "avx2 avx512f avx512_bf16"), "zen4", "bfloat16"),
        (cpuinfo("GenuineIntel", 6, 143, "avx512f avx512_bf16 amx_bf16 amx_tile"), "xeon_amx",
         "bfloat16"),
        (cpuinfo("GenuineIntel", 6, 85, "avx2 avx512f"), "intel_avx512", "float32"),
        ("", "aarch64", "float32"),
    ],
)  # fmt: skip
def test_cpu_tag_and_dtype(text: str, tag: str, dtype: str) -> None:
    assert cpu_targets.cpu_tag(text, machine="aarch64") == tag
    assert cpu_targets.session_dtype(text) == dtype


def test_result_paths_carry_the_tag() -> None:
    assert cpu_targets.result_path("p1", "zen4", RESULTS_DIR).name == "p1_cpu_zen4.json"
    assert cpu_targets.result_path("p1", "", RESULTS_DIR).name == "p1_cpu.json"
