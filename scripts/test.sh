#!/usr/bin/env bash
# Runs the tests and prints one line per test binary (its tests passed / failed / ignored and
# its time), then a summary. The full run is the default and what CI runs: unit, integration
# (threads backend, real processes through tprun, real checkpoints, the server with
# --features server), doc tests, the examples under PyTorch's torchrun
# (scripts/test-torchrun.sh), the server driven by the openai client (scripts/test-openai.sh) and
# small mixture-of-experts GGUFs against llama.cpp (scripts/check-llama-cpp-logits.sh; as root
# or in CI it builds llama.cpp's tools once if they are missing, 20-30 minutes on 2 cores).
#
#   scripts/test.sh                # everything, default build (Candle's gemm)
#   scripts/test.sh --quick        # day-to-day: the fast selection below (1 min 21 s measured)
#   scripts/test.sh --mkl          # the layer and model tests on the MKL build (scripts/setup-mkl.sh)
#   CANDLE_TP_MKL=1 scripts/test.sh   # the same
#   scripts/test.sh --release      # also the release acceptance run (mlp under tprun, 2/3/4 ranks)
#   scripts/test.sh -- ARGS        # extra arguments for cargo test
#   scripts/test.sh --allow-skips  # as root: let a test that cannot run here skip (counted)
#
# Skips: a test that cannot run on this machine (no mpirun, no `ip netns`) skips through
# tests/common's `skip`, which writes a line to $CANDLE_TP_SKIP_LOG; the summary counts and
# lists those lines with the #[ignore]d tests. As root (and under CI) this script installs
# everything the tests need, so there a skip means something is broken: it sets
# CANDLE_TP_NO_SKIPS, which turns every skip into a failing test, unless --allow-skips.
#
# cargo's full output goes to $CARGO_TARGET_DIR/test-logs/cargo-test.log (target/ by default);
# the output of a failing binary is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

mkl="${CANDLE_TP_MKL:-0}"
release=0
quick=0
allow_skips=0
cargo_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --mkl) mkl=1; shift ;;
    --release) release=1; shift ;;
    --quick) quick=1; shift ;;
    --allow-skips) allow_skips=1; shift ;;
    --) shift; cargo_args=("$@"); break ;;
    *) cargo_args+=("$1"); shift ;;
  esac
done

start=$SECONDS
if [ -x scripts/fetch-models.sh ]; then
  echo "==> fetching the demo models (idempotent)"
  CANDLE_TP_CONVERT_PROFILE="${CANDLE_TP_CONVERT_PROFILE:-dev}" scripts/fetch-models.sh
fi

features=server
if [ "$mkl" = 0 ] && [ "$quick" = 0 ]; then
  # tests/mpirun.rs launches jobs with Open MPI's mpirun, and with the mpi feature tests the MPI
  # backend: installed as root (scripts/setup-mpi.sh); elsewhere without MPI those tests skip,
  # saying so (under CI they fail instead).
  if scripts/setup-mpi.sh >/dev/null 2>&1; then
    features=server,mpi
  else
    echo "==> no MPI (scripts/setup-mpi.sh needs root): the mpi feature is not built, tests/mpirun.rs skips"
  fi
fi
# scripts/test-openai.sh (through scripts/lib/start-server.sh) builds with the same features, so
# that it reuses this build instead of compiling candle-core again for another feature set.
export CANDLE_TP_FEATURES="$features"

targets=()
if [ "$mkl" = 1 ]; then
  # shellcheck disable=SC1091
  . scripts/setup-mkl.sh
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/mkl"
  echo "==> cargo test --features mkl (layers, mappings, vocabulary, Llama and BERT against candle-transformers)"
  targets=(--features mkl --test layers --test mappings --test vocab_parallel --test llama --test bert
    --test sampling)
elif [ "$quick" = 1 ]; then
  # Layers, collectives, the loader, two model families against candle-transformers (BERT and
  # the Llama family: llama, 48 s), the launcher and multi-process jobs; measured 1 min 21 s
  # with a warm build at load average 7 on 2 cores. Left out: real checkpoints (convert_smollm2,
  # llama_generate, bert_embed), sampling, fault injection (chaos), multi-process training,
  # 8-rank 3D layers, the other families, doc tests, torchrun.
  echo "==> cargo test, quick selection (scripts/test.sh without --quick runs everything)"
  targets=(--lib --bins --test layers --test mappings --test collectives --test vocab_parallel
    --test tprun --test hostile_headers --test loader_safetensors --test bert --test llama --test multiprocess
    --test train_ce --test two_jobs --test parallel_2d --test quickstart)
  # With targets named, cargo test builds no example; these tests run these ones.
  quick_examples=(--example chaos_worker --example mlp --example quickstart)
else
  # --features server: the OpenAI-compatible server and its tests (tests/serve_http.rs);
  # --workspace: the kernels crate's tests too.
  echo "==> cargo test --workspace --features $features (every test binary, then the doc tests)"
  targets=(--workspace --features "$features")
fi
target_dir="${CARGO_TARGET_DIR:-target}"
logs="$target_dir/test-logs"
mkdir -p "$logs"
log="$logs/cargo-test.log"
export CANDLE_TP_SKIP_LOG="$(cd "$logs" && pwd)/skipped.txt"
rm -f "$CANDLE_TP_SKIP_LOG"
if [ "$allow_skips" = 0 ] && { [ "$(id -u)" = 0 ] || [ -n "${CI:-}" ]; }; then
  export CANDLE_TP_NO_SKIPS=1
  echo "==> every test must run (root or CI): a test that would skip fails (--allow-skips to let it)"
fi

# One line per binary as it finishes: cargo prints "Running <source> (<binary>)" or
# "Doc-tests <crate>" before a binary's tests and "test result: ..." after them.
if [ "$quick" = 1 ] && [ "$mkl" = 0 ] && ! cargo build --quiet "${quick_examples[@]}"; then
  echo "==> building ${quick_examples[*]} failed; the tests that run them will fail"
fi
set +e
cargo test --no-fail-fast "${targets[@]}" "${cargo_args[@]}" 2>&1 | tee "$log" | awk '
  /^ *Running (unittests )?[^ ]+ \(/ { name = $2; if (name == "unittests") name = $3; next }
  /^ *Doc-tests / { name = "doc tests (" $2 ")"; next }
  /^test result: / {
    gsub(/;/, "")
    passed = $4; failed = $6; ignored = $8; secs = $NF; sub(/s$/, "", secs)
    printf "   %-34s %4d passed %3d failed %3d ignored %8.1f s\n", name, passed, failed, ignored, secs
    fflush()
  }
  /^error(\[E[0-9]+\])?: / && !/test failed/ { print "   " $0; fflush() }'
cargo_rc=${PIPESTATUS[0]}
set -e

read -r passed failed ignored <<<"$(awk '/^test result: / { gsub(/;/, ""); p += $4; f += $6; i += $8 }
  END { print p + 0, f + 0, i + 0 }' "$log")"
skipped=$ignored
binaries=$(grep -c '^test result: ' "$log" || true)
if [ "$cargo_rc" != 0 ] && [ "$failed" = 0 ]; then
  # A build error or a crashed test binary: no test result line says it.
  echo "==> cargo test failed (exit $cargo_rc) before reporting every test; the end of $log:"
  tail -n 40 "$log"
  failed=$((failed + 1))
elif [ "$failed" != 0 ]; then
  echo "==> failing tests (details in $log):"
  grep -E '^test .* FAILED$|^---- .* stdout ----$' "$log" | sed 's/^/   /' || true
fi

extra() {  # runs a checking script; counts it as one test: passed, failed or skipped
  local what="$1"; shift
  local out t0=$SECONDS
  if out=$("$@" 2>&1); then
    printf '%s\n' "$out" | sed 's/^/   /'
    if printf '%s\n' "$out" | grep -q '^SKIPPED' && [ -n "${CANDLE_TP_NO_SKIPS:-}" ]; then
      failed=$((failed + 1)); printf '   %-34s FAILED (skipped where it must run) %3.1f s\n' "$what" $((SECONDS - t0))
    elif printf '%s\n' "$out" | grep -q '^SKIPPED'; then
      skipped=$((skipped + 1)); printf '   %-34s skipped %25.1f s\n' "$what" $((SECONDS - t0))
    else
      passed=$((passed + 1)); printf '   %-34s passed %26.1f s\n' "$what" $((SECONDS - t0))
    fi
  else
    printf '%s\n' "$out" | sed 's/^/   /'
    failed=$((failed + 1)); printf '   %-34s FAILED %26.1f s\n' "$what" $((SECONDS - t0))
  fi
}

# The AMX tile kernels run only where the CPU has AMX-INT8 (Linux names the flag amx_int8):
# elsewhere their tests check everything around the tile instructions on an emulation.
if ! grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  echo "   AMX kernel not run: no AMX on this CPU (its tests ran the tile layouts emulated;" \
    "scripts/bench-device.sh runs them on a device machine)"
fi

if [ "$mkl" = 0 ] && [ "$quick" = 0 ]; then
  # The kernels' tests cover every kernel this CPU runs; the layers above them take the one
  # Kernel::detect picks (AVX-512 VNNI where the CPU has it, else AVX2 on any x86-64 host of
  # the last decade). Forcing the scalar kernel runs the quantized layers (and the crate's unit
  # tests) through the portable code; on an AVX-512 VNNI host, forcing avx2 does the same for
  # the AVX2 path that other hosts take. On a failure it names the failing tests and prints
  # their output, as the main pass does (cargo's whole output in $logs/cargo-test-KERNEL.log).
  forced_kernels=scalar
  # (Linux names the flag avx512_vnni.)
  if grep -qw avx512_vnni /proc/cpuinfo 2>/dev/null && grep -qw avx512vl /proc/cpuinfo; then
    forced_kernels="scalar avx2"
  fi
  for forced in $forced_kernels; do
    echo "==> the kernels and quantized layers again with CANDLE_TP_KERNEL=$forced"
    extra "kernels forced to $forced" bash -c '
      log=$1 forced=$2
      CANDLE_TP_KERNEL=$forced cargo test --workspace --features "$0" --lib \
        --test quant_matmul --test row_parallel_quantized -- --show-output >"$log" 2>&1; rc=$?
      grep -E "^test result: |^kernels under test" "$log" | sort | uniq -c
      [ "$rc" = 0 ] && exit 0
      if grep -qE "^test .* FAILED$" "$log"; then
        echo "failing tests with CANDLE_TP_KERNEL=$forced (details in $log):"
        grep -E "^test .* FAILED$" "$log" | sed "s/^/   /"
        # Each failing binary'"'"'s report: the failures'"'"' output, then their names.
        awk "/^failures:\$/ { on = 1 } on { print } /^test result: / { on = 0 }" "$log"
      else
        echo "cargo test failed (exit $rc) before reporting every test; the end of $log:"
        tail -n 60 "$log"
      fi
      exit 1' "$features" "$logs/cargo-test-$forced.log" "$forced"
  done
  echo "==> the examples under PyTorch's torchrun (scripts/test-torchrun.sh)"
  extra "torchrun (mlp, generate)" scripts/test-torchrun.sh
  echo "==> the server with the openai Python client and curl (scripts/test-openai.sh)"
  extra "openai client (candle-tp-serve)" scripts/test-openai.sh
  echo "==> MoE GGUFs against llama.cpp's server: first-token logits, greedy ids (scripts/check-llama-cpp-logits.sh)"
  extra "llama.cpp logits (MoE GGUF)" scripts/check-llama-cpp-logits.sh --debug
  if [ "$features" = server,mpi ]; then
    # Without the mpi feature an MPI-launched shm job meets with rank 0's token file
    # (src/comm/job_token.rs); tests/mpirun.rs holds the checks of both builds.
    echo "==> tests/mpirun.rs again, built without the mpi feature"
    extra "mpirun, no mpi feature" bash -c '
      log=$0
      { cargo build --example chaos_worker --example quickstart --example generate &&
        cargo test --test mpirun; } >"$log" 2>&1; rc=$?
      grep -E "^test result: " "$log"
      [ "$rc" = 0 ] && exit 0
      grep -E "^test .* FAILED$|panicked" "$log" || tail -n 40 "$log"
      exit 1' "$logs/cargo-test-mpirun-no-mpi.log"
  fi
fi

if [ "$release" = 1 ]; then
  echo "==> acceptance: the MLP example under tprun (release), 2, 3 and 4 ranks"
  cargo build --release --quiet --bin tprun --example mlp
  for n in 2 3 4; do
    extra "release mlp, $n ranks" sh -c '
      out=$("$1/release/tprun" --standalone --nproc-per-node "$2" "$1/release/examples/mlp") || exit 1
      json=$(printf "%s\n" "$out" | sed -n "s/^\[rank 0\] \({.*}\)$/\1/p" | tail -n 1)
      python3 - "$2" "$json" <<'"'PY'"'
import json, sys
n, v = int(sys.argv[1]), json.loads(sys.argv[2])
keys = ["max_abs_err_out", "max_abs_err_grad_input", "max_abs_err_grad_weight", "max_abs_err_grad_bias"]
bad = [k for k in keys if not v[k] <= 1e-5]
assert v["world_size"] == n, v
print(", ".join(f"{k}={v[k]:.2e}" for k in keys))
sys.exit(1 if bad else 0)
PY' sh "$target_dir" "$n"
  done
fi

if [ -s "$CANDLE_TP_SKIP_LOG" ]; then
  n=$(wc -l <"$CANDLE_TP_SKIP_LOG")
  skipped=$((skipped + n))
  passed=$((passed - n))  # cargo counted them as passed
  echo "==> $n tests skipped at run time (they passed without running what they test):"
  sed 's/^/   /' "$CANDLE_TP_SKIP_LOG"
fi
echo "==> $binaries test binaries (and the checks after them) in $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s"
echo "total: $passed passed, $failed failed, $skipped skipped"
[ "$failed" = 0 ]
