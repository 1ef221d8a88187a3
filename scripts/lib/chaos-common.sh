# shellcheck shell=bash
# Sourced by scripts/chaos.sh and scripts/chaos-hosts.sh: their options, time arithmetic and
# the wait for a condition that gives up when the job under test ends first.
#
#   parse_args NAME QUICK_RUNS "$@"
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

# parse_args NAME QUICK_RUNS "$@": the options of both suites (--quick sets RUNS to
# QUICK_RUNS); sets RUNS, PROFILE, BUILD, CASES and VERBOSE, checks RUNS and every case against
# ALL_CASES, and calls the suite's `usage` on a bad argument. NAME prefixes the errors.
parse_args() {
    local name=$1 quick=$2 c
    shift 2
    while [ $# -gt 0 ]; do
        case "$1" in
            --hosts) ;;
            --quick) RUNS=$quick ;;
            --runs) RUNS=${2:?--runs needs a number}; shift ;;
            --debug) PROFILE=debug ;;
            --no-build) BUILD=0 ;;
            --cases) CASES=${2:?--cases needs a list}; shift ;;
            --verbose) VERBOSE=1 ;;
            -h|--help) usage ;;
            *) echo "$name: unknown argument '$1'" >&2; usage ;;
        esac
        shift
    done
    case "$RUNS" in ''|*[!0-9]*) echo "$name: --runs '$RUNS' is not a number" >&2; exit 2 ;; esac
    for c in ${CASES//,/ }; do
        case ",$ALL_CASES," in *",$c,"*) ;; *) echo "$name: unknown case '$c' (cases: $ALL_CASES)" >&2; exit 2 ;; esac
    done
}
