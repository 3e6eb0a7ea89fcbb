#!/usr/bin/env bash
# Check the Slurm launcher on a real cluster of one node: installs Debian's slurm-wlm and munge (as root, where
# missing), starts munged, slurmctld and slurmd on localhost (2 CPUs, partition `check`), then runs through it:
#   1. study --preset smoke, through Slurm and through the local pool: the two reports must be equal;
#   2. demo --preset smoke --seeds 2 through Slurm, its measures and report as one more job;
#   3. a longer smoke study whose run kappa-4 gets `scancel --signal=TERM` mid-training: the command says it
#      stopped; run again, it resubmits that run, which resumes from its checkpoint and ends with the losses of
#      the same run trained without interruption;
#   4. bad input, one line each: a partition Slurm lacks, a job that fails at start, no sbatch on PATH;
#   5. tests/test_slurm.py, whose real-cluster test runs here (sbatch exists).
# Re-runnable: it stops the daemons it started before and begins from a fresh cluster state.
#
#     bash scripts/slurm-check.sh [OUT_DIR]          (default OUT_DIR: slurm-check-out)
#     PYTHON=/path/to/python bash scripts/slurm-check.sh   (default: .venv/bin/python, else python3)
#     SLURM_CHECK_STATE=/path  the daemons' state, logs and config (default: /tmp/slurm-check)
#
# Exits 0 when every check passed (the cluster stays up), 1 at the first that did not (saying which, and stopping
# the cluster and any job of it), 2 when it cannot run (not root).
set -euo pipefail

cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo "$REPO/.venv/bin/python" || echo python3)}
OUT=$(realpath -m "${1:-slurm-check-out}")
STATE=${SLURM_CHECK_STATE:-/tmp/slurm-check}
CLI=("$PYTHON" -m free_transformer.cli)
START=$(date +%s)

say() { echo "[slurm-check $(( $(date +%s) - START )) s] $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || { echo "slurm-check: run it as root (it installs packages and starts Slurm's daemons)" >&2; exit 2; }

# ---- the cluster ----------------------------------------------------------------------------------------------

if ! command -v slurmctld > /dev/null || ! command -v munged > /dev/null; then
    say "installing slurm-wlm and munge"
    apt-get update -q > /dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge > /dev/null
fi

stop_daemons() {  # those this script started before, by their pid files
    for pidfile in "$STATE"/slurmd.pid "$STATE"/slurmctld.pid "$STATE"/munged.pid; do
        if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2> /dev/null; then
            kill "$(cat "$pidfile")"
            for _ in $(seq 50); do kill -0 "$(cat "$pidfile")" 2> /dev/null || break; sleep 0.2; done
        fi
        rm -f "$pidfile"
    done
}
stop_daemons
# A failure, or an error the script did not expect, leaves no job and no daemon running.
trap 'status=$?; if [ $status -ne 0 ]; then scancel --user=root 2> /dev/null || true; stop_daemons; say "cluster stopped"; fi' EXIT
rm -rf "$STATE"
mkdir -p "$STATE"/ctld "$STATE"/slurmd /etc/slurm
if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile /etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 600 /etc/munge/munge.key
fi
install -d -o munge -g munge -m 0755 /run/munge
runuser -u munge -- /usr/sbin/munged --pid-file="$STATE/munged.pid.tmp" --socket=/run/munge/munge.socket.2
sleep 0.5
cp "$STATE/munged.pid.tmp" "$STATE/munged.pid" 2> /dev/null || pgrep -u munge -n munged > "$STATE/munged.pid"
munge -n | unmunge > /dev/null || fail "munge does not authenticate"

MEMORY_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))
cat > /etc/slurm/slurm.conf << EOF
# written by free-transformer's scripts/slurm-check.sh: a cluster of one node, this machine
ClusterName=check
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
MinJobAge=600
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=$MEMORY_MB State=UNKNOWN
PartitionName=check Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
/usr/sbin/slurmctld -c
/usr/sbin/slurmd -N localhost
for _ in $(seq 60); do
    [ "$(sinfo --noheader --nodes=localhost --format=%T 2> /dev/null)" = idle ] && break
    sleep 1
done
sinfo
[ "$(sinfo --noheader --nodes=localhost --format=%T)" = idle ] || fail "the node is not idle: $(tail -3 "$STATE"/slurmd.log)"
say "cluster up: partition check, node localhost idle"

# ---- 1. the smoke study, through Slurm and locally: equal reports ---------------------------------------------

rm -rf "$OUT"
mkdir -p "$OUT"
say "study --preset smoke --launcher slurm"
"${CLI[@]}" study --preset smoke --launcher slurm --out "$OUT/study-slurm" || fail "study through Slurm"
squeue --states=all
say "study --preset smoke --launcher local"
"${CLI[@]}" study --preset smoke --launcher local --device cpu --out "$OUT/study-local" || fail "study locally"
"$PYTHON" scripts/same_study_report.py "$OUT/study-slurm" "$OUT/study-local" || fail "the reports differ"
say "the smoke study's report from Slurm equals the local one"

# ---- 2. the smoke demo over 2 seeds ----------------------------------------------------------------------------

say "demo --preset smoke --seeds 2 --launcher slurm --report-on slurm"
"${CLI[@]}" demo --preset smoke --seeds 2 --launcher slurm --report-on slurm --out "$OUT/demo-slurm" \
    || fail "demo through Slurm"
[ "$(grep -c '"state": "FINISHED"' "$OUT/demo-slurm/slurm/record.json")" -eq 13 ] \
    || fail "demo: not 12 runs and the report finished"
[ -s "$OUT/demo-slurm/report.html" ] || fail "demo: no report.html"

# ---- 3. a run stopped with scancel --signal=TERM mid-training, resumed by running the command again ---------

LONG=(study --preset smoke --seeds 1 --kappas 4 steps=2000 validate_every=0 log_every=1 checkpoint_every=20)
say "${LONG[*]} --launcher local (uninterrupted)"
"${CLI[@]}" "${LONG[@]}" --launcher local --device cpu --out "$OUT/long-local" > /dev/null 2>&1 || fail "local long study"
say "${LONG[*]} --launcher slurm, with kappa-4 cancelled by TERM"
RUN="$OUT/long-slurm/seed-0/kappa-4"
set +e
"${CLI[@]}" "${LONG[@]}" --launcher slurm --out "$OUT/long-slurm" 2> "$OUT/long-slurm.err" &
WAITER=$!
last_step() { tail -1 "$RUN/metrics.jsonl" 2> /dev/null | sed -n 's/.*"step": \([0-9]*\).*/\1/p'; }
# Until the run has logged step 41, past its checkpoint of step 40: a line of metrics.jsonl stays, where a
# checkpoint directory may be pruned again within a step (keep_checkpoints). 2,000 steps leave it far from its end.
for _ in $(seq 1200); do
    [ "$(last_step)" -ge 41 ] 2> /dev/null && break
    sleep 0.2
done
[ "$(last_step)" -ge 41 ] 2> /dev/null || fail "kappa-4 did not reach step 41 in 240 s"
JOB=$("$PYTHON" -c "import json, sys; print(json.load(open(sys.argv[1]))['runs']['seed-0/kappa-4']['job'])" \
      "$OUT/long-slurm/slurm/record.json")
say "kappa-4 (job $JOB) at step $(last_step): scancel --signal=TERM $JOB"
scancel --signal=TERM "$JOB"
wait $WAITER
STATUS=$?
set -e
tail -2 "$OUT/long-slurm.err" | sed 's/.*\r//'
[ $STATUS -eq 143 ] || fail "the stopped sweep exited $STATUS, not 143"
grep -q '"state": "STOPPED"' "$OUT/long-slurm/slurm/record.json" || fail "the record does not say STOPPED"
say "running the same command again"
"${CLI[@]}" "${LONG[@]}" --launcher slurm --out "$OUT/long-slurm" || fail "the resumed sweep"
grep -q '"submissions": 2' "$OUT/long-slurm/slurm/record.json" || fail "kappa-4 was not resubmitted"
"$PYTHON" scripts/compare_losses.py --quiet --keys loss,cross_entropy_bits,kl_bits "$OUT/long-local/seed-0/kappa-4" "$RUN" || fail "the resumed run's losses differ"
say "the TERM-stopped run resumed and ended with the uninterrupted run's losses"

# ---- 4. bad input: one line each ----------------------------------------------------------------------------

expect_one_line() {  # NAME PATTERN COMMAND...: exits 2 with one line that matches PATTERN
    local name=$1 pattern=$2
    shift 2
    set +e
    "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
    local status=$?
    set -e
    local last
    last=$(sed 's/.*\r//' "$OUT/$name.err" | grep -v '^\s*$' | tail -1)
    echo "  $name: exit $status: $last" >&2
    [ $status -eq 2 ] && [[ $last == error:* ]] && [[ $last =~ $pattern ]] || fail "$name"
}
expect_one_line partition "no partition 'nope'" "${CLI[@]}" study --preset smoke --launcher slurm --slurm-partition nope \
    --out "$OUT/bad-partition"
expect_one_line fails-at-start "exceed model.max_seq_len" "${CLI[@]}" study --preset smoke --seeds 1 --kappas 4 \
    model.max_seq_len=16 --launcher slurm --out "$OUT/bad-start"
expect_one_line no-sbatch "PATH lacks sbatch" env PATH="$(dirname "$PYTHON")" "${CLI[@]}" study \
    --preset smoke --launcher slurm --out "$OUT/no-sbatch"

# ---- 5. the tests, with the real-cluster one --------------------------------------------------------------------

say "pytest tests/test_slurm.py"
"$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/test_slurm.py || fail "tests/test_slurm.py"

say "every check passed in $(( $(date +%s) - START )) s; the cluster is still up (scripts/slurm-check.sh stops it at its next run)"
