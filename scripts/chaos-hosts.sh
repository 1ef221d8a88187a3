#!/usr/bin/env bash
# Fault injection across emulated hosts (what `scripts/chaos.sh --hosts` runs): 2 hosts x 2
# ranks (scripts/hosts.sh: network namespaces, each with its own /dev/shm), the job started by
# Open MPI's mpirun (--map-by node: ranks 0 and 2 on ctp-h1, 1 and 3 on ctp-h2) on the
# hierarchical backend, examples/chaos_worker built with the mpi feature.
#
#   scripts/chaos.sh --hosts [--quick] [--runs N] [--debug] [--no-build] [--cases a,b] [--verbose]
#
# Cases (each run --runs times, default 5; --quick: 1), the victim a random rank unless said:
#   error-init       the victim returns an error before it joins (before MPI starts)
#   error-join       the victim fails inside the join: its shm slots twice its peers' size
#                    (a host's first rank makes the host's region with them, and its peer's
#                    error names it by its job rank)
#   wrong-token      the victim (rank 2 or 3) presents a wrong token to its host's store
#   error-collective the victim returns an error after 1 s of the all-reduce loop, its peers
#                    inside an all-reduce
#   error-handoff    the victim (not rank 0) receives its buffer in a ring of p2p hand-offs
#                    after 1 s and fails instead of handing it on, its successor in a recv
#   rendezvous-kill  SIGKILL of the victim while the ranks sit in the rendezvous of a sub-group
#                    (chaos_worker group --stagger 1: the hosts' segments made, not all mapped)
#   link-cut         ctp-h2's link taken down (ip link set vctp-h2 down) inside the all-reduce
#                    loop: the "victim" is the host
#
# Each run passes when mpirun exits non-zero within 10 s of the fault (the kill, the cut, or
# the timestamp the victim prints just before it fails), its output names the victim (the
# rank: MPI's exit handler, mpirun's report, or for link-cut the host), no process is left in
# either host, and nothing is left in either host's /dev/shm (looked at inside each host before
# the hosts go down). Prints a table (case, runs, passes, worst seconds from the fault to the
# job's end, processes left, segments left) and, last, one JSON object:
#   {"cases", "runs", "passes", "worst_teardown_s", "leaked_segments", "leftover_processes"}
# Exit code: 0 when every run passes, 1 otherwise, 2 on bad usage, a failed build, or a
# machine that cannot make hosts (root, iproute2, Open MPI).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
HOSTS_SH=$ROOT/scripts/hosts.sh
RUNS=5
PROFILE=release
BUILD=1
VERBOSE=0
ALL_CASES="error-init,error-join,wrong-token,error-collective,error-handoff,rendezvous-kill,link-cut"
CASES=$ALL_CASES
BOUND=10
NP=4

usage() { sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
# shellcheck source=scripts/lib/chaos-common.sh
. "$ROOT/scripts/lib/chaos-common.sh"
parse_args "chaos.sh --hosts" 1 "$@"
"$HOSTS_SH" check >&2 || { echo "chaos.sh --hosts: this machine cannot make emulated hosts" >&2; exit 2; }
command -v mpirun > /dev/null || { echo "chaos.sh --hosts: no mpirun (scripts/setup-mpi.sh)" >&2; exit 2; }

TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
WORKER=$TARGET/$PROFILE/examples/chaos_worker
if [ "$BUILD" = 1 ]; then
    flags=(--features mpi --example chaos_worker)
    [ "$PROFILE" = release ] && flags+=(--release)
    echo "chaos.sh --hosts: building chaos_worker with the mpi feature ($PROFILE)" >&2
    (cd "$ROOT" && cargo build "${flags[@]}") >&2 || { echo "chaos.sh --hosts: build failed" >&2; exit 2; }
fi
[ -x "$WORKER" ] || { echo "chaos.sh --hosts: $WORKER is missing (build it, or drop --no-build)" >&2; exit 2; }

# The hosts are global to the machine: hold the lock tests/common/hosts.rs holds.
exec 9> /tmp/candle-tp-hosts.lock
flock 9
WORK=$(mktemp -d "${TMPDIR:-/tmp}/chaos-hosts.XXXXXX")
cleanup() {
    for p in $(jobs -p); do kill -KILL "$p" 2>/dev/null; done
    "$HOSTS_SH" down > /dev/null 2>&1
    rm -rf "$WORK"
}
trap cleanup EXIT
"$HOSTS_SH" up 2 >&2 || { echo "chaos.sh --hosts: hosts.sh up 2 failed" >&2; exit 2; }
HOSTS=(ctp-h1 ctp-h2)


# The pid of world rank $1 (a chaos_worker in one of the hosts), or nothing.
rank_pid() {
    local h p
    for h in "${HOSTS[@]}"; do
        for p in $(ip netns pids "$h" 2>/dev/null); do
            grep -q chaos_worker "/proc/$p/cmdline" 2>/dev/null || continue
            tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1" && { echo "$p"; return; }
        done
    done
}

# mpirun's output with every `[1,R]<stream>:` tag removed (they cut lines at every write).
untagged() { sed -E 's/\[1,[0-9]+\]<std(out|err)>://g' "$1"; }

# Runs one case once; sets R_OK, R_TIME, R_WHY, R_LEFT, R_LEAKED, R_NAMED.
one_run() {
    local case=$1 dir=$2 victim fault_at="" rc t_end out
    local -a args
    R_OK=0; R_TIME=0; R_WHY=""; R_LEFT=0; R_LEAKED=0; R_NAMED=0
    mkdir -p "$dir"; out=$dir/out
    victim=$((RANDOM % NP))
    case $case in
        error-init) args=(error --phase init --victim "$victim") ;;
        # A host's first rank makes its region: with larger slots it is its peer that finds the
        # region does not match (an error naming the group, not the rank), so the victim is
        # a host's second rank.
        error-join) args=(error --phase join --victim "$victim") ;;
        # A client of a host's store (the host's second rank): the first serves it.
        wrong-token) victim=$((2 + RANDOM % 2)); args=(error --phase token --victim "$victim") ;;
        error-collective) args=(error --phase loop --after 1 --victim "$victim" --seconds 60) ;;
        error-handoff) victim=$((1 + RANDOM % (NP - 1)))
            args=(error --phase handoff --after 1 --victim "$victim" --seconds 60) ;;
        rendezvous-kill) args=(group --stagger 1 --seconds 60) ;;
        link-cut) victim=ctp-h2; args=(allreduce --seconds 600) ;;
    esac
    "$HOSTS_SH" mpirun -np "$NP" --map-by node --tag-output -x RAYON_NUM_THREADS=1 \
        -x CANDLE_TP_TIMEOUT=60 "$WORKER" "${args[@]}" --elems 4096 > "$out" 2>&1 &
    JOB=$!; WATCH_PID=$JOB
    # A watchdog: 90 s for the whole run.
    ( sleep 90 & s=$!; trap 'kill $s 2>/dev/null; exit 0' TERM; wait $s; kill -KILL "$JOB" 2>/dev/null ) \
        < /dev/null > /dev/null 2>&1 &
    local watchdog=$!
    case $case in
        rendezvous-kill)
            # Every rank is in the sub-group's rendezvous (rank R R s late), none through.
            if wait_for "[ \$(untagged $out | grep -c 'group rendezvous') -ge $NP ]" 60; then
                sleep "$(rand_between 0.1 1.5)"
                local vpid; vpid=$(rank_pid "$victim")
                if untagged "$out" | grep -q 'group joined'; then R_WHY="missed the phase: a rank was through"; fi
                [ -n "$vpid" ] && kill -KILL "$vpid" && fault_at=$(now)
            fi ;;
        link-cut)
            if wait_for "[ \$(untagged $out | grep -c 'all-reduce loop') -ge $NP ]" 60; then
                sleep "$(rand_between 0.2 1.0)"
                ip link set vctp-h2 down && fault_at=$(now)
            fi ;;
    esac
    wait "$JOB"; rc=$?
    t_end=$(now)
    kill "$watchdog" 2>/dev/null; wait "$watchdog" 2>/dev/null
    [ "$case" = link-cut ] && ip link set vctp-h2 up
    if [ -z "$fault_at" ] && [ "${case#error-}" != "$case" -o "$case" = wrong-token ]; then
        fault_at=$(untagged "$out" | sed -n "s/.*chaos: rank $victim returns an error ([A-Za-z]*) at \([0-9.]*\).*/\1/p" | head -n 1)
    fi
    [ -n "$fault_at" ] && R_TIME=$(fsub "$t_end" "$fault_at")

    # Nothing left in any host: processes (2 s to go), then /dev/shm.
    local h deadline n
    deadline=$(awk -v t="$(now)" 'BEGIN { printf "%.3f", t + 2 }')
    while :; do
        R_LEFT=0
        for h in "${HOSTS[@]}"; do
            n=$(ip netns pids "$h" 2>/dev/null | wc -l); R_LEFT=$((R_LEFT + n))
        done
        [ "$R_LEFT" -eq 0 ] && break
        fle "$(now)" "$deadline" || break
        sleep 0.05
    done
    for h in "${HOSTS[@]}"; do
        for p in $(ip netns pids "$h" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
        n=$("$HOSTS_SH" shm "$h" | grep -c '^candle-tp-'); R_LEAKED=$((R_LEAKED + n))
        [ "$n" -gt 0 ] && log "$case: left in $h's /dev/shm: $("$HOSTS_SH" shm "$h" | tr '\n' ' ')"
        # The next run starts from a clean host.
        nsenter --mount="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}/hosts/ns/$h.mnt" \
            sh -c 'rm -f /dev/shm/candle-tp-*'
    done

    # The output names the victim.
    local text; text=$(untagged "$out")
    if [ "$case" = link-cut ]; then
        grep -q "ctp-h2" <<< "$text" && grep -Eqi "lost communication|unable to|lost connection|not reachable" <<< "$text" && R_NAMED=1
    elif grep -Eq "MPI rank $victim of $NP is exiting|MPI_ABORT was invoked on rank $victim |process rank $victim with PID|Process name: \[\[[0-9]+,[0-9]+\],$victim\]" <<< "$text"; then
        R_NAMED=1
    elif [ "$case" = error-join ] && grep -Eq "made by rank 0 .*ranks 0, 1 are ranks $victim, " <<< "$text"; then
        # A host's first rank made the region with the wrong slots: its peer's error names it,
        # by its rank in the host's group and in the job.
        R_NAMED=1
    fi
    if [ -z "$R_WHY" ]; then
        if [ -z "$fault_at" ]; then R_WHY="the fault was not injected (or its time not printed)"
        elif [ "$rc" -eq 0 ]; then R_WHY="mpirun exited 0"
        elif ! fle "$R_TIME" "$BOUND"; then R_WHY="the job ended ${R_TIME} s after the fault (bound ${BOUND} s)"
        elif [ "$R_NAMED" = 0 ]; then R_WHY="the output does not name $victim"
        elif [ "$R_LEFT" -gt 0 ]; then R_WHY="$R_LEFT process(es) left in the hosts"
        elif [ "$R_LEAKED" -gt 0 ]; then R_WHY="$R_LEAKED segment(s) left in the hosts' /dev/shm"
        else R_OK=1
        fi
    fi
    log "$case: victim $victim, rc $rc, fault->end ${R_TIME} s, named $R_NAMED, left $R_LEFT, segments $R_LEAKED, ${R_WHY:-ok}"
    if [ "$R_OK" = 0 ]; then
        echo "chaos.sh --hosts: $case run failed: $R_WHY (victim $victim, rc $rc); mpirun output:" >&2
        untagged "$out" | grep -v '^\s*$' | tail -n 20 | cut -c 1-220 | sed 's/^/    /' >&2
    fi
}

total_runs=0; total_passes=0; worst_all=0; leaked_all=0; left_all=0; ncases=0; rows=()
for case in ${CASES//,/ }; do
    passes=0; worst=0; left=0; leaked=0; named=0
    for ((i = 1; i <= RUNS; i++)); do
        one_run "$case" "$WORK/$case.$i"
        passes=$((passes + R_OK)); named=$((named + R_NAMED))
        worst=$(fmax "$worst" "$R_TIME")
        left=$((left + R_LEFT)); leaked=$((leaked + R_LEAKED))
        rm -rf "$WORK/$case.$i"
    done
    ncases=$((ncases + 1)); total_runs=$((total_runs + RUNS)); total_passes=$((total_passes + passes))
    worst_all=$(fmax "$worst_all" "$worst"); left_all=$((left_all + left)); leaked_all=$((leaked_all + leaked))
    rows+=("$(printf '%-17s %5d %7d %17s %10s %15d %14d' "$case" "$RUNS" "$passes" "$worst" "$named/$RUNS" "$left" "$leaked")")
    echo "chaos.sh --hosts: $case: $passes/$RUNS passed, worst $worst s from the fault to the job's end" >&2
done

echo "binaries: $PROFILE ($WORKER), 2 emulated hosts x 2 ranks, mpirun --map-by node"
printf '%-17s %5s %7s %17s %10s %15s %14s\n' fault runs passes worst_end_s_le_10 names_rank processes_left segments_left
for row in "${rows[@]}"; do echo "$row"; done
printf '{"cases": %d, "runs": %d, "passes": %d, "worst_teardown_s": %s, "leaked_segments": %d, "leftover_processes": %d}\n' \
    "$ncases" "$total_runs" "$total_passes" "$worst_all" "$leaked_all" "$left_all"
[ "$total_passes" -eq "$total_runs" ]
