# shellcheck shell=bash
# Sourced by scripts/chaos.sh and scripts/chaos-hosts.sh: time arithmetic and the wait for a
# condition that gives up when the job under test ends first.
#
#   WATCH_PID=$pid wait_for "CONDITION" SECONDS [POLL_SECONDS]

now() { date +%s.%N; }
# Floating-point helpers (awk).
fsub() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a - b }'; }
fle() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; }
fmax() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", (a > b ? a : b) }'; }
rand_between() { awk -v lo="$1" -v hi="$2" -v r="$RANDOM" 'BEGIN { printf "%.3f", lo + (hi - lo) * r / 32767 }'; }

log() { [ "${VERBOSE:-0}" = 1 ] && echo "  $*" >&2; return 0; }

# Waits (up to $2 s, polling every $3 s, default 0.01) until the command "$1" succeeds; fails
# if the process $WATCH_PID (the launcher of the job under test) ends first.
wait_for() {
    local cond=$1 limit=$2 poll=${3:-0.01} start
    start=$(now)
    while ! eval "$cond"; do
        kill -0 "$WATCH_PID" 2>/dev/null || return 1
        fle "$(fsub "$(now)" "$start")" "$limit" || return 1
        sleep "$poll"
    done
}
