#!/usr/bin/env bash
# Fault injection for candle-tp jobs launched by tprun.
#
#   scripts/chaos.sh [--quick] [--runs N] [--debug] [--no-build] [--cases a,b,...] [--verbose]
#
# Each case starts a job under tprun, injects one fault into a random rank at a chosen phase,
# and checks that:
#   - tprun exits non-zero,
#   - within 10 s of the fault (timeout + 10 s for a stopped rank); the time from the fault to
#     tprun's exit is measured and reported,
#   - its output names the failing rank,
#   - no process of the job remains (every worker's process group is empty),
#   - nothing of the job remains in /dev/shm (candle-tp-<the job's CANDLE_TP_SHM_TAG>*).
#
# Cases (each run --runs times, default 20; --quick: 3):
#   rendezvous-kill   SIGKILL of a random rank while the ranks meet (staggered joins, 3 ranks)
#   load-kill         SIGKILL of a random rank while it maps and reads the SmolLM2 checkpoint
#                     (examples/generate, 2 ranks)
#   allreduce-kill    SIGKILL of a random rank inside an all-reduce loop (3 ranks)
#   generate-kill     SIGKILL of a random rank while rank 0 streams generated text (2 ranks)
#   collective-stop   SIGSTOP of a random rank inside the all-reduce loop, CANDLE_TP_TIMEOUT=2
#   exit0-early       a random rank leaves the all-reduce loop and exits with code 0 (3 ranks)
#
# Prints a table (case, runs, passes, worst time to tear down, segments tprun had to remove)
# and, as its last line, one JSON object:
#   {"cases", "runs", "passes", "worst_teardown_s", "leaked_segments", "leftover_processes"}
# Exit code: 0 when every run passes, 1 otherwise, 2 on bad usage or a failed build.
# The SmolLM2 checkpoint is read from ${CANDLE_TP_HOME:-~/.cache/candle-tp}/models/
# smollm2-135m-instruct (scripts/fetch-models.sh). Release binaries unless --debug.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
RUNS=20
PROFILE=release
BUILD=1
VERBOSE=0
ALL_CASES="rendezvous-kill,load-kill,allreduce-kill,generate-kill,collective-stop,exit0-early"
CASES=$ALL_CASES
STOP_TIMEOUT=2

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) RUNS=3 ;;
        --runs) RUNS=${2:?--runs needs a number}; shift ;;
        --debug) PROFILE=debug ;;
        --no-build) BUILD=0 ;;
        --cases) CASES=${2:?--cases needs a list}; shift ;;
        --verbose) VERBOSE=1 ;;
        -h|--help) usage ;;
        *) echo "chaos.sh: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done
case "$RUNS" in ''|*[!0-9]*) echo "chaos.sh: --runs '$RUNS' is not a number" >&2; exit 2 ;; esac
for c in ${CASES//,/ }; do
    case ",$ALL_CASES," in *",$c,"*) ;; *) echo "chaos.sh: unknown case '$c' (cases: $ALL_CASES)" >&2; exit 2 ;; esac
done

TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
BIN=$TARGET/$PROFILE
TPRUN=$BIN/tprun
WORKER=$BIN/examples/chaos_worker
GENERATE=$BIN/examples/generate
MODEL=${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}/models/smollm2-135m-instruct

if [ "$BUILD" = 1 ]; then
    flags=()
    [ "$PROFILE" = release ] && flags+=(--release)
    echo "chaos.sh: building tprun, chaos_worker and generate ($PROFILE)" >&2
    (cd "$ROOT" && cargo build "${flags[@]}" --bin tprun --example chaos_worker --example generate) >&2 \
        || { echo "chaos.sh: build failed" >&2; exit 2; }
fi
for exe in "$TPRUN" "$WORKER"; do
    [ -x "$exe" ] || { echo "chaos.sh: $exe is missing (build it, or drop --no-build)" >&2; exit 2; }
done
case ",$CASES," in
    *,load-kill,*|*,generate-kill,*)
        [ -x "$GENERATE" ] || { echo "chaos.sh: $GENERATE is missing" >&2; exit 2; }
        [ -f "$MODEL/model.safetensors" ] || {
            echo "chaos.sh: no checkpoint at $MODEL (run scripts/fetch-models.sh, or leave out load-kill and generate-kill with --cases)" >&2
            exit 2
        } ;;
esac

WORK=$(mktemp -d "${TMPDIR:-/tmp}/chaos.XXXXXX")
cleanup() {
    # Our own jobs only: every tprun this script started, by pid.
    for p in $(jobs -p); do kill -KILL "$p" 2>/dev/null; done
    rm -rf "$WORK"
}
trap cleanup EXIT

now() { date +%s.%N; }
# Floating-point helpers (awk).
fsub() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a - b }'; }
fle() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; }
fmax() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", (a > b ? a : b) }'; }
rand_between() { awk -v lo="$1" -v hi="$2" -v r="$RANDOM" 'BEGIN { printf "%.3f", lo + (hi - lo) * r / 32767 }'; }

log() { [ "$VERBOSE" = 1 ] && echo "  $*" >&2; return 0; }

# Waits (up to $2 s) until the command "$1" succeeds; fails if tprun ($TP) ends first.
wait_for() {
    local cond=$1 limit=$2 start
    start=$(now)
    while ! eval "$cond"; do
        kill -0 "$TP" 2>/dev/null || return 1
        fle "$(fsub "$(now)" "$start")" "$limit" || return 1
        sleep 0.005
    done
}

# Fills PIDS[rank] and TAG from tprun's children (the workers), waiting up to 30 s for them.
find_workers() {
    local n=$1 start p r
    start=$(now)
    while :; do
        PIDS=()
        for p in $(pgrep -P "$TP"); do
            r=$(tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | sed -n 's/^RANK=//p')
            [ -n "$r" ] && PIDS[r]=$p
            TAG=$(tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | sed -n 's/^CANDLE_TP_SHM_TAG=//p')
        done
        [ "${#PIDS[@]}" -eq "$n" ] && [ -n "$TAG" ] && return 0
        kill -0 "$TP" 2>/dev/null || return 1
        fle "$(fsub "$(now)" "$start")" 30 || return 1
        sleep 0.005
    done
}

# Runs one case once; sets R_OK (1/0), R_TIME (fault to tprun exit, s), R_WHY, R_LEAKED,
# R_LEFT, R_CLEANED.
one_run() {
    local case=$1 dir=$2 nproc victim bound=10 fault_at="" rc t_end delay
    local -a cmd env=()
    R_OK=0; R_TIME=0; R_WHY=""; R_LEAKED=0; R_LEFT=0; R_CLEANED=0
    mkdir -p "$dir"
    case $case in
        rendezvous-kill) nproc=3; cmd=("$WORKER" rendezvous --stagger 1 --seconds 30) ;;
        allreduce-kill) nproc=3; cmd=("$WORKER" allreduce --seconds 60) ;;
        collective-stop) nproc=3; cmd=("$WORKER" allreduce --seconds 60)
            env=(CANDLE_TP_TIMEOUT=$STOP_TIMEOUT); bound=$((STOP_TIMEOUT + 10)) ;;
        exit0-early) nproc=3 ;;
        load-kill) nproc=2; cmd=("$GENERATE" --model "$MODEL" --max-new-tokens 8) ;;
        generate-kill) nproc=2; cmd=("$GENERATE" --model "$MODEL" --max-new-tokens 400) ;;
    esac
    victim=$((RANDOM % nproc))
    [ "$case" = exit0-early ] && cmd=("$WORKER" exit0 --victim "$victim" --after "$(rand_between 0.3 1.0)" --seconds 60)
    env "${env[@]}" "$TPRUN" --standalone --nproc-per-node "$nproc" --log-dir "$dir/logs" -- "${cmd[@]}" \
        > "$dir/out" 2>&1 &
    TP=$!
    # A watchdog, so that a hung job cannot hang the script: 120 s for the whole run.
    # Its sleep is killed with it, so that no stray process holds our output open.
    ( sleep 120 & s=$!; trap 'kill $s 2>/dev/null; exit 0' TERM; wait $s; kill -KILL "$TP" 2>/dev/null ) \
        < /dev/null > /dev/null 2>&1 &
    local watchdog=$!
    if ! find_workers "$nproc"; then
        R_WHY="the workers did not start"
    else
        local vpid=${PIDS[victim]} out=$dir/out
        case $case in
            rendezvous-kill)
                # Every rank announced the rendezvous, none has joined yet: kill in that window.
                if wait_for "[ \$(grep -c 'rendezvous\$' $out) -ge $nproc ]" 20; then
                    sleep "$(rand_between 0.05 0.8)"
                    if grep -q 'joined$' "$out"; then R_WHY="missed the phase: a rank had joined"; fi
                    kill -KILL "$vpid"; fault_at=$(now)
                fi ;;
            allreduce-kill|collective-stop)
                if wait_for "[ \$(grep -c 'all-reduce loop\$' $out) -ge $nproc ]" 30; then
                    sleep "$(rand_between 0.1 0.6)"
                    if [ "$case" = collective-stop ]; then kill -STOP "$vpid"; else kill -KILL "$vpid"; fi
                    fault_at=$(now)
                fi ;;
            load-kill)
                # The victim has the checkpoint mapped: it is reading its slices.
                if wait_for "grep -q model.safetensors /proc/$vpid/maps 2>/dev/null" 30; then
                    sleep "$(rand_between 0 0.05)"
                    kill -KILL "$vpid"; fault_at=$(now)
                    if [ -s "$dir/logs/rank0.stdout" ]; then R_WHY="missed the phase: generation had started"; fi
                fi ;;
            generate-kill)
                if wait_for "[ -s $dir/logs/rank0.stdout ]" 60; then
                    sleep "$(rand_between 0.05 0.3)"
                    if grep -q tokens_per_s "$dir/logs/rank0.stdout"; then R_WHY="missed the phase: generation had ended"; fi
                    kill -KILL "$vpid"; fault_at=$(now)
                fi ;;
            exit0-early)
                wait_for "grep -q 'exits 0 early at' $out" 30 \
                    && fault_at=$(sed -n 's/.*exits 0 early at \([0-9.]*\).*/\1/p' "$out" | head -n 1) ;;
        esac
        [ -z "$fault_at" ] && [ -z "$R_WHY" ] && R_WHY="the job ended before the fault could be injected"
    fi
    wait "$TP"; rc=$?
    t_end=$(now)
    kill "$watchdog" 2>/dev/null; wait "$watchdog" 2>/dev/null
    [ -n "$fault_at" ] && R_TIME=$(fsub "$t_end" "$fault_at")

    # No process of the job: every worker and its process group gone (they are reaped by
    # init once tprun is gone; allow 2 s for that).
    local p left deadline
    deadline=$(awk -v t="$(now)" 'BEGIN { printf "%.3f", t + 2 }')
    while :; do
        left=0
        for p in "${PIDS[@]}"; do
            if kill -0 "$p" 2>/dev/null || pgrep -g "$p" > /dev/null 2>&1; then left=$((left + 1)); fi
        done
        [ "$left" -eq 0 ] && break
        fle "$(now)" "$deadline" || break
        sleep 0.05
    done
    R_LEFT=$left
    if [ "$left" -gt 0 ]; then
        for p in "${PIDS[@]}"; do kill -KILL -- "-$p" 2>/dev/null; kill -CONT "$p" 2>/dev/null; done
    fi
    if [ -n "$TAG" ]; then
        R_LEAKED=$(find /dev/shm -maxdepth 1 -name "candle-tp-$TAG*" 2>/dev/null | wc -l)
        find /dev/shm -maxdepth 1 -name "candle-tp-$TAG*" -delete 2>/dev/null
    fi
    R_CLEANED=$(sed -n 's/^tprun: removed \([0-9]*\) shared-memory segment.*/\1/p' "$dir/out" | head -n 1)
    R_CLEANED=${R_CLEANED:-0}

    # The output names the failing rank: tprun's report, or a survivor's error about it.
    local named=0
    if grep -Eq "tprun: rank $victim \(pid [0-9]+\) failed first|peer rank $victim \(pid" "$dir/out"; then
        named=1
    elif grep -Eq "for rank\(s\) ([0-9]+, )*$victim(, [0-9]+)* that never arrived" "$dir/out"; then
        named=1
    fi

    if [ -z "$R_WHY" ]; then
        if [ "$rc" -eq 0 ]; then R_WHY="tprun exited 0"
        elif ! fle "$R_TIME" "$bound"; then R_WHY="teardown took ${R_TIME} s (bound ${bound} s)"
        elif [ "$named" = 0 ]; then R_WHY="the output does not name rank $victim"
        elif [ "$R_LEFT" -gt 0 ]; then R_WHY="$R_LEFT process(es) of the job left"
        elif [ "$R_LEAKED" -gt 0 ]; then R_WHY="$R_LEAKED segment(s) left in /dev/shm"
        else R_OK=1
        fi
    fi
    log "$case: victim rank $victim, rc $rc, fault->exit ${R_TIME} s, cleaned $R_CLEANED, ${R_WHY:-ok}"
    if [ "$R_OK" = 0 ]; then
        echo "chaos.sh: $case run failed: $R_WHY (victim rank $victim, rc $rc); tprun output:" >&2
        tail -n 15 "$dir/out" | sed 's/^/    /' >&2
    fi
}

total_runs=0; total_passes=0; worst_all=0; leaked_all=0; left_all=0; ncases=0
rows=()
for case in ${CASES//,/ }; do
    passes=0; worst=0; cleaned=0
    for ((i = 1; i <= RUNS; i++)); do
        one_run "$case" "$WORK/$case.$i"
        passes=$((passes + R_OK))
        worst=$(fmax "$worst" "$R_TIME")
        cleaned=$((cleaned + R_CLEANED))
        leaked_all=$((leaked_all + R_LEAKED))
        left_all=$((left_all + R_LEFT))
        rm -rf "$WORK/$case.$i"
    done
    ncases=$((ncases + 1))
    total_runs=$((total_runs + RUNS)); total_passes=$((total_passes + passes))
    worst_all=$(fmax "$worst_all" "$worst")
    rows+=("$(printf '%-16s %5d %7d %19s %17d' "$case" "$RUNS" "$passes" "$worst" "$cleaned")")
    echo "chaos.sh: $case: $passes/$RUNS passed, worst teardown $worst s" >&2
done

echo "binaries: $PROFILE ($BIN)"
printf '%-16s %5s %7s %19s %17s\n' case runs passes worst_teardown_s tprun_removed_shm
for row in "${rows[@]}"; do echo "$row"; done
printf '{"cases": %d, "runs": %d, "passes": %d, "worst_teardown_s": %s, "leaked_segments": %d, "leftover_processes": %d}\n' \
    "$ncases" "$total_runs" "$total_passes" "$worst_all" "$leaked_all" "$left_all"
[ "$total_passes" -eq "$total_runs" ]
