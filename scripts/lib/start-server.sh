# shellcheck shell=bash disable=SC2154
# (SC2154: NPROC, MODEL and target_dir are set by the caller.)
# Sourced by scripts/test-openai.sh and scripts/bench-serve.sh: builds tprun and
# candle-tp-serve, starts the server under tprun on a free port and waits until it listens.
#
#   start_server debug|release [candle-tp-serve options...]
#   stop_server                  # optional: the EXIT trap does it too
#
# Needs NPROC, MODEL and target_dir; sets pid (tprun), log (its output) and port, and an EXIT
# trap that stops the job and removes the log. Builds with scripts/test.sh's features
# (scripts/lib/features.sh: server, and mpi where MPI is installed), so that the test run's
# build serves; once per profile and shell (a later
# start_server with the same profile reuses the binaries); stop_server stops the job and waits
# for it (every rank gone) so that another server can start after it.
start_server() {
  local profile="$1"; shift
  local cargo_profile=()
  [ "$profile" = release ] && cargo_profile=(--release)
  if [ "${server_built:-}" != "$profile" ]; then
    # shellcheck source=scripts/lib/features.sh
    . "$(dirname "${BASH_SOURCE[0]}")/features.sh"
    cargo build --quiet "${cargo_profile[@]}" --features "$(test_features)" --bin tprun --bin candle-tp-serve >&2
    server_built="$profile"
  fi
  log=$(mktemp)
  "$target_dir/$profile/tprun" --standalone --nproc-per-node "$NPROC" \
    "$target_dir/$profile/candle-tp-serve" --model "$MODEL" --port 0 "$@" >"$log" 2>&1 &
  pid=$!
  trap stop_server EXIT
  # shellcheck disable=SC2034  # read by the scripts that source this file
  port=$(wait_for_port "$pid" "$log" 's/.*"listening":"http:\/\/[^:]*:\([0-9]*\)".*/\1/p' "the server")
}

# wait_for_port PID LOG SED_EXPR WHAT: prints the port that process PID wrote to LOG (what the
# sed expression prints first), waiting up to 120 s; exits (with LOG) when PID dies or time
# runs out. Call it as port=$(wait_for_port ...) under `set -e`.
wait_for_port() {
  local p="$1" l="$2" expr="$3" what="$4" found
  for _ in $(seq 1 600); do
    found=$(sed -n "$expr" "$l" | head -n 1)
    [ -n "$found" ] && { echo "$found"; return 0; }
    kill -0 "$p" 2>/dev/null || { cat "$l" >&2; exit 1; }
    sleep 0.2
  done
  echo "$what did not start in 120 s" >&2
  cat "$l" >&2
  exit 1
}

stop_server() {
  stop_job "${pid:-}" "${log:-}"
  pid="" log=""
}

# stop_job PID LOG: stops the process (TERM), waits for it and removes its log; either may be
# empty. `|| true`: set -e applies inside traps, and wait reports the TERM we sent (143).
stop_job() {
  if [ -n "$1" ]; then
    kill -TERM "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
  fi
  if [ -n "$2" ]; then
    rm -f "$2"
  fi
}
