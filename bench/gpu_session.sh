#!/usr/bin/env bash
# The GPU run of the "no idle device" benchmarks: set-up, the CUDA tests, O1 (async scheduling
# off/on) and G1 (vacpack against transformers) for both model shapes. Every result (JSON, charts,
# timelines) and one log per stage land in bench/results/, ready to commit.
#
#   bash bench/gpu_session.sh                          # every stage, about 25 minutes at most
#   bash bench/gpu_session.sh --stages setup,tests,o1  # some stages, in the order given
#   bash bench/gpu_session.sh --budget-s 540 --archive /tmp/results.tar.gz
#
# Stages: setup, tests, o1, g1-0.5b, g1-1.5b, and three on the GPU machine's host CPU (often an
# Intel Xeon with AMX, where the CPU issue's targets are also checked), pinned to two of its
# cores as on the project's 2-core machines, the GPU hidden: cpu-decode
# (bench/decode_attention.py, bf16), cpu-g1 (G1 against transformers' generate, bf16; the
# measured kernel choices are in its JSON) and cpu-amx (the AMX attention and bf16 decode
# kernels' tests, on the CPU's own instructions where it has them, bench/prefill_attention.py:
# the AMX kernel against the AVX-512 one and SDPA, and an audit of G1's measured choices in
# bf16). They are not in the
# default list: name them.
# Each runs under a time limit: its own nominal one,
# cut to what is left of --budget-s, so the whole run ends within the budget; a stage that runs
# past its limit is stopped and the next one starts. Within o1 and g1 every system runs in its
# own worker with its own limit (--worker-timeout-s), so one slow system costs only its own row.
# Elapsed time is printed after every stage. To cut the workloads: --quick (O1 at 128 requests x
# 256 tokens; G1 without the padded generate baseline), or pass flags through with --o1-args and
# --g1-args. Every stage sets PYTHONPATH to this checkout, so that no stage depends on the
# set-up's install having worked; on a machine without network, --wheels DIR installs the
# wheels in DIR first (no index, no dependencies). --device cpu is a dry run of this script on a
# machine without a GPU: give it tiny workloads and bench/results/tmp outputs through the
# --o1-args and --g1-args flags (and --log-dir).
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRIPT_PATH="$REPO_ROOT/bench/gpu_session.sh"
cd "$REPO_ROOT" || exit 1
RESULTS_DIR="bench/results"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"

STAGES="setup,tests,o1,g1-0.5b,g1-1.5b"
BUDGET_S=1500
WORKER_TIMEOUT_S=240
ARCHIVE=""
WHEELS_DIR=""
QUICK=0
O1_ARGS=""
G1_ARGS=""
DEVICE="cuda"
LOG_DIR="$RESULTS_DIR"
RUN_STAGE=""  # internal: run this one stage in this process (see run_stage)
STAGE_LIMIT_S=0  # internal: that stage's time limit

usage() {
    sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
    cat <<EOF
Options:
  --stages LIST          comma-separated, in order (default: $STAGES)
  --budget-s SECONDS     the whole run's time budget (default: $BUDGET_S)
  --worker-timeout-s S   limit of one system's worker in o1 and g1 (default: $WORKER_TIMEOUT_S)
  --quick                smaller workloads (see above)
  --o1-args "FLAGS"      extra flags for bench/o1_overlap.py
  --g1-args "FLAGS"      extra flags for bench/g1_generation.py
  --wheels DIR           install the wheels in DIR before the set-up (offline machines)
  --archive FILE         also pack every result and log this run wrote into FILE (.tar.gz)
  --device cuda|cpu      cpu: a dry run of the script itself, without a GPU (default: cuda)
  --log-dir DIR          where the per-stage logs go (default: $LOG_DIR)
EOF
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --stages) STAGES="$2"; shift 2 ;;
        --budget-s) BUDGET_S="$2"; shift 2 ;;
        --worker-timeout-s) WORKER_TIMEOUT_S="$2"; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --o1-args) O1_ARGS="$2"; shift 2 ;;
        --g1-args) G1_ARGS="$2"; shift 2 ;;
        --wheels) WHEELS_DIR="$2"; shift 2 ;;
        --archive) ARCHIVE="$2"; shift 2 ;;
        --device) DEVICE="$2"; shift 2 ;;
        --log-dir) LOG_DIR="$2"; shift 2 ;;
        --run-stage) RUN_STAGE="$2"; shift 2 ;;
        --stage-limit-s) STAGE_LIMIT_S="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # logs show progress as it happens
export TOKENIZERS_PARALLELISM=false
START_S=$SECONDS

say() { echo "[gpu-session $(( SECONDS - START_S ))s] $*"; }

# ------------------------------------------------------------------------------- stages

# Nominal time limit of each stage, in seconds: a few times its expected length on an H200.
declare -A NOMINAL_LIMIT_S=(
    [setup]=240
    [tests]=480
    [o1]=600
    [g1-0.5b]=540
    [g1-1.5b]=600
    [cpu-decode]=300
    [cpu-g1]=560
    [cpu-amx]=480
)
MIN_STAGE_S=60      # a stage with less time than this left is skipped, not started
ARCHIVE_RESERVE_S=15
# A benchmark gets its stage's limit less this as its own time budget: enough to write its
# results and charts after its last worker, before the stage is stopped.
PUBLISH_RESERVE_S=30

benchmark_budget_args() {
    (( STAGE_LIMIT_S > PUBLISH_RESERVE_S )) \
        && echo "--time-budget-s $(( STAGE_LIMIT_S - PUBLISH_RESERVE_S ))"
}

stage_setup() {
    if [[ -n "$WHEELS_DIR" ]]; then
        "$PYTHON" -m pip install --no-index --no-deps "$WHEELS_DIR"/*.whl || return 1
    fi
    # The packages the extras name are often present already on a GPU image; without network,
    # pip fails on the first one that is not, and the editable install without dependencies
    # (or PYTHONPATH, set above) is enough for the stages below.
    if ! "$PYTHON" -m pip install --no-build-isolation --retries 0 --timeout 15 \
        -e ".[test,bench]"; then
        say "the full install failed (no network?): installing vacpack alone, no dependencies"
        "$PYTHON" -m pip install --no-build-isolation --no-deps -e . \
            || say "no editable install either: the stages use PYTHONPATH=$REPO_ROOT"
    fi
    "$PYTHON" bench/check_imports.py vacpack torch transformers safetensors tokenizers numpy \
        matplotlib jinja2 tqdm pytest triton hypothesis
}

stage_tests() {
    "$PYTHON" -m pytest tests/test_cuda_graphs.py tests/test_triton_attention.py \
        tests/test_attention_windows.py tests/test_async_scheduling.py \
        tests/test_triton_layer_ops.py -q
}

stage_o1() {
    local quick_args=""
    (( QUICK )) && quick_args="--num-prompts 128 --max-tokens 256"
    # shellcheck disable=SC2086  # the flag strings split into words on purpose
    "$PYTHON" bench/o1_overlap.py --device "$DEVICE" --worker-timeout-s "$WORKER_TIMEOUT_S" \
        $(benchmark_budget_args) $quick_args $O1_ARGS
}

stage_g1() {
    local shape="$1" quick_args=""
    (( QUICK )) && quick_args="--systems vacpack,hf_generate_batch,hf_generate_batch_auto"
    # shellcheck disable=SC2086
    "$PYTHON" bench/g1_generation.py --device "$DEVICE" --shape "$shape" \
        --worker-timeout-s "$WORKER_TIMEOUT_S" $(benchmark_budget_args) $quick_args $G1_ARGS
}

# The host CPU's stages: two of its cores, as on the project's 2-core machines, and no GPU.
on_two_host_cores() {
    CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=2 taskset -c 0,1 "$@"
}

stage_cpu_decode() {
    on_two_host_cores "$PYTHON" bench/decode_attention.py --layers 8 --rounds 4 \
        --output "$RESULTS_DIR/decode_attention_cpu_gpu_host.json"
}

stage_cpu_g1() {
    # shellcheck disable=SC2086
    on_two_host_cores "$PYTHON" bench/g1_generation.py --device cpu --systems vacpack,hf_generate \
        --output "$RESULTS_DIR/g1_qwen2.5-0.5b_cpu_gpu_host.json" \
        --worker-timeout-s "$(( STAGE_LIMIT_S / 2 ))" $(benchmark_budget_args) $G1_ARGS
}

stage_cpu_amx() {
    # -rs: the skip reasons say whether the CPU had the tiles.
    on_two_host_cores "$PYTHON" -m pytest tests/test_amx_attention.py tests/test_bf16_decode_kernels.py \
        -q -rs || return 1
    on_two_host_cores "$PYTHON" bench/prefill_attention.py --rounds 7 \
        --output "$RESULTS_DIR/prefill_attention_cpu_gpu_host.json" || return 1
    # Whether the measured choices (the bf16 kernel's among them) hold there: G1's model in bf16.
    on_two_host_cores "$PYTHON" bench/choice_audit.py --dtype bfloat16 \
        --output "$RESULTS_DIR/choice_audit_cpu_gpu_host_bf16.json"
}

stage_call() {
    case "$1" in
        setup) stage_setup ;;
        tests) stage_tests ;;
        o1) stage_o1 ;;
        g1-0.5b) stage_g1 qwen2.5-0.5b ;;
        g1-1.5b) stage_g1 qwen2.5-1.5b ;;
        cpu-decode) stage_cpu_decode ;;
        cpu-g1) stage_cpu_g1 ;;
        cpu-amx) stage_cpu_amx ;;
    esac
}

if [[ -n "$RUN_STAGE" ]]; then
    stage_call "$RUN_STAGE"
    exit $?
fi

mkdir -p "$RESULTS_DIR" "$LOG_DIR"
# Files newer than this marker are what this run wrote: the archive packs exactly those.
RUN_MARKER="$(mktemp)"
declare -a SUMMARY=()
FAILED=0

pack_archive() {
    [[ -n "$ARCHIVE" ]] || return 0
    local files
    files="$( (find "$RESULTS_DIR" -path "$RESULTS_DIR/tmp" -prune -o -type f \
        -newer "$RUN_MARKER" -print; find "$LOG_DIR" -type f -newer "$RUN_MARKER") | sort -u)"
    if [[ -z "$files" ]]; then
        say "nothing written: no archive"
        return 0
    fi
    mkdir -p "$(dirname "$ARCHIVE")"
    # shellcheck disable=SC2086  # one path per line, none with spaces
    tar czf "$ARCHIVE" $files && say "packed $(echo "$files" | wc -l) files into $ARCHIVE"
}

finish() {
    say "summary:"
    for line in "${SUMMARY[@]+"${SUMMARY[@]}"}"; do echo "  $line"; done
    say "total $(( SECONDS - START_S )) s of a $BUDGET_S s budget"
    pack_archive
    rm -f "$RUN_MARKER"
}
trap finish EXIT

# ------------------------------------------------------------------------------- checks

if [[ -z "$PYTHON" ]]; then
    echo "no python3 or python on PATH" >&2
    exit 1
fi
if [[ "$DEVICE" != "cuda" ]]; then
    say "--device $DEVICE: a dry run of this script, not the GPU benchmarks"
elif ! "$PYTHON" - <<'EOF'
import sys

try:
    import torch
except ImportError as error:
    sys.exit(f"torch cannot be imported ({error}): this script needs a CUDA build of torch")
if not torch.cuda.is_available():
    sys.exit(
        f"torch {torch.__version__} sees no GPU (built for CUDA {torch.version.cuda}; "
        "a None there is a CPU-only build): these benchmarks need a CUDA device"
    )
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
EOF
then
    say "no usable CUDA device: stopping before any stage"
    exit 1
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader

run_stage() {
    local stage="$1" limit_s left_s log status stage_start_s elapsed_s
    left_s=$(( BUDGET_S - (SECONDS - START_S) - ARCHIVE_RESERVE_S ))
    limit_s=${NOMINAL_LIMIT_S[$stage]}
    (( left_s < limit_s )) && limit_s=$left_s
    if (( limit_s < MIN_STAGE_S )); then
        say "$stage: skipped, ${left_s} s of the budget left"
        SUMMARY+=("$stage: skipped (budget)")
        FAILED=1
        return
    fi
    log="$LOG_DIR/gpu_session_${stage}.log"
    say "$stage: starting, limit ${limit_s} s, log $log"
    stage_start_s=$SECONDS
    # The stage runs as this script again (--run-stage), under timeout, which signals the whole
    # process group on expiry: the benchmark's workers stop with it.
    timeout --kill-after=20 "$limit_s" bash "$SCRIPT_PATH" --run-stage "$stage" \
        --stage-limit-s "$limit_s" \
        --worker-timeout-s "$WORKER_TIMEOUT_S" --o1-args "$O1_ARGS" --g1-args "$G1_ARGS" \
        --wheels "$WHEELS_DIR" --device "$DEVICE" $( (( QUICK )) && echo --quick ) 2>&1 \
        | tee "$log"
    status=${PIPESTATUS[0]}
    elapsed_s=$(( SECONDS - stage_start_s ))
    case "$status" in
        0) SUMMARY+=("$stage: ok in ${elapsed_s} s") ;;
        124|137) SUMMARY+=("$stage: STOPPED at its ${limit_s} s limit"); FAILED=1 ;;
        *) SUMMARY+=("$stage: FAILED (exit $status) after ${elapsed_s} s"); FAILED=1 ;;
    esac
    say "${SUMMARY[-1]} (total $(( SECONDS - START_S )) s)"
}

IFS=',' read -r -a STAGE_LIST <<<"$STAGES"
for stage in "${STAGE_LIST[@]}"; do
    if [[ -z "${NOMINAL_LIMIT_S[$stage]+set}" ]]; then
        echo "unknown stage $stage; stages: ${!NOMINAL_LIMIT_S[*]}" >&2
        exit 2
    fi
done
say "stages ${STAGES} on $DEVICE; budget ${BUDGET_S} s; results in $RESULTS_DIR/, logs in $LOG_DIR/"
for stage in "${STAGE_LIST[@]}"; do
    run_stage "$stage"
done
exit "$FAILED"
