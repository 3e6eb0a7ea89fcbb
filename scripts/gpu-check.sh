#!/usr/bin/env bash
# Check a GPU machine in one command: the test suite on the GPU, then the GPU benchmarks at their default
# sizes, written to OUT_DIR/gpu-report.md (each command, its exit status, time and output; nvidia-smi and
# the versions). See docs/gpu.md for what each figure is compared against.
#
#     bash scripts/gpu-check.sh [OUT_DIR]          (default OUT_DIR: gpu-check-<date>-<time>)
#     PYTHON=/path/to/python bash scripts/gpu-check.sh   (default: python)
#     ONLY="generate-compiled profile" bash scripts/gpu-check.sh   (those steps alone; names: STEPS below)
#
# Exits 2 with one line when no CUDA device is visible; otherwise 0 when every command succeeded, 1 when
# one failed or ran past its time limit (the report says which). Benchmarks that miss a target print
# FAIL in their table but still exit 0: the report is where targets are read.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python}
OUT=${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
STEPS="pytest mapper step-eager step-compiled generate-eager generate-compiled decode-step profile profile-compiled"
STEPS+=" peers latent-kinds demo-paper"
ONLY=${ONLY:-$STEPS}
for name in ${ONLY//,/ }; do
    case " $STEPS " in
        *" $name "*) ;;
        *) echo "gpu-check: unknown step '$name' in ONLY (steps: $STEPS)" >&2; exit 2 ;;
    esac
done
# wanted NAME: whether ONLY names the step
wanted() { case " ${ONLY//,/ } " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu-check: no CUDA device ($PYTHON: torch missing or torch.cuda.is_available() is False)" >&2
    exit 2
fi

mkdir -p "$OUT" || exit 2
REPORT="$OUT/gpu-report.md"
START=$(date +%s)
FAILED=()
STEP=0

fence() { echo '```'; cat; echo '```'; }

{
    echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)'), host $(hostname)"
    echo
    echo "steps: ${ONLY//,/ }"
    echo
    echo "## Versions"
    "$PYTHON" -c "import platform, torch; print('python', platform.python_version()); print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'cuDNN', torch.backends.cudnn.version()); print('device', torch.cuda.get_device_name(0), '| devices visible:', torch.cuda.device_count())" 2>&1 | fence
    echo
    echo "## nvidia-smi"
    if command -v nvidia-smi > /dev/null; then nvidia-smi 2>&1; else echo "nvidia-smi not found"; fi | fence
} > "$REPORT"

# run NAME LIMIT_SECONDS COMMAND...: runs it with a time limit, appends command, status and output to the report.
run() {
    local name=$1 limit=$2
    shift 2
    wanted "${name%-fp32}" || wanted "${name%-bf16}" || return 0  # peers-fp32 and peers-bf16: the step "peers"
    STEP=$((STEP + 1))
    local log
    log="$OUT/$(printf '%02d' "$STEP")-$name.log"
    echo "[gpu-check] $name: $*" >&2
    local began=$SECONDS
    timeout --kill-after=30 "$limit" "$@" > "$log" 2>&1
    local rc=$? elapsed=$((SECONDS - began))
    local status="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status="TIMED OUT after ${limit} s"
    elif [ "$rc" -ne 0 ]; then
        status="FAILED (exit $rc)"
    fi
    [ "$status" = ok ] || FAILED+=("$name: $status")
    echo "[gpu-check] $name: $status, ${elapsed} s" >&2
    {
        echo
        echo "## $name: $status, ${elapsed} s"
        echo
        echo "\`$*\`"
        echo
        # progress bars rewrite one line with carriage returns: keep the last state of each line
        sed 's/.*\r//' "$log" | fence
    } >> "$REPORT"
}

run pytest 480 "$PYTHON" -m pytest --device cuda -q -rs -p no:cacheprovider
run mapper 240 "$PYTHON" bench/mapper.py --quick --dtype bf16
run step-eager 360 "$PYTHON" bench/step.py --size paper-1.5b --dtype bf16 --bits 16
run step-compiled 600 "$PYTHON" bench/step.py --size paper-1.5b --dtype bf16 --bits 16 --compile
GENERATE=(bench/generate.py --size paper-1.5b --dtype bf16 --batch 1 16 --new-tokens 64 --recompute-tokens 0 --rounds 5)
run generate-eager 300 "$PYTHON" "${GENERATE[@]}"
# with --compile it also checks the graph's tokens against the same static step run eagerly (part (c)); each
# model, batch size and sampling variant compiles its step with Inductor first (about a minute at this size)
run generate-compiled 600 "$PYTHON" "${GENERATE[@]}" --compile
# the B=1 static decoding step alone: as is (CUDA graph), compiled with and without coordinate-descent tuning
run decode-step 480 "$PYTHON" bench/generate.py --size paper-1.5b --dtype bf16 --parts d --batch 1 --new-tokens 64 --step-rounds 5
# where the time of one training step (eager) and of one compiled decoding step goes: the top GPU kernels
run profile 540 "$PYTHON" bench/profile_steps.py --size paper-1.5b --dtype bf16 --new-tokens 32 --decode-batch 1 16 --top 25
# the same for a training step with every block compiled (compile=true), where the MFU target is read
run profile-compiled 420 "$PYTHON" bench/profile_steps.py --size paper-1.5b --dtype bf16 --compile --parts train --top 25
# x-transformers 2.31.10 (pip install x-transformers==2.31.10), at the size of docs/gpu.md's comparison target.
PEERS=(bench/peers.py --layers 16 --dim 1024 --heads 16 --kv-heads 4 --ffn 2816 --vocab 32000 --seq-len 1024 --batch 8 --rounds 3)
if ! wanted peers; then
    :
elif "$PYTHON" -c "import x_transformers.free_transformer" 2>/dev/null; then
    run peers-fp32 300 "$PYTHON" "${PEERS[@]}" --dtype fp32
    run peers-bf16 300 "$PYTHON" "${PEERS[@]}" --dtype bf16
else
    printf '\n## peers: skipped\n\nx_transformers is not importable (pip install x-transformers==2.31.10 to compare).\n' >> "$REPORT"
    echo "[gpu-check] peers: skipped (x_transformers not importable)" >&2
fi
run latent-kinds 180 "$PYTHON" bench/latent_kinds.py --rounds 5
# the paper's synthetic recipe, all 18 models (3 seeds) sharing the GPU; target <= 5 minutes.
run demo-paper 420 "$PYTHON" -m free_transformer.cli demo --preset paper --seeds 3 --device cuda --out "$OUT/demo-paper"

TOTAL=$(( $(date +%s) - START ))
{
    echo
    echo "## Summary"
    echo
    echo "$STEP commands in ${TOTAL} s."
    if [ ${#FAILED[@]} -eq 0 ]; then
        echo "Every command succeeded (targets: the PASS/FAIL columns above; docs/gpu.md)."
    else
        echo "Failed:"
        for failure in "${FAILED[@]}"; do echo "- $failure"; done
    fi
} >> "$REPORT"
echo "[gpu-check] report: $REPORT (${TOTAL} s)" >&2
[ ${#FAILED[@]} -eq 0 ]
