#!/usr/bin/env bash
# Decode and prefill tokens/s of candle-tp against llama.cpp's own `llama-bench`, on the same
# GGUF files (scripts/make-gguf-models.sh: SmolLM2-135M and a synthetic 1 B Llama, each in
# Q4_0 Q4_1 Q5_K_M Q4_K_M Q6_K Q8_0, made by llama-quantize), in one run:
#
#   candle-tp world 1 (1 process x 1 thread)   against  llama-bench -t 1
#   candle-tp world 2 (2 processes x 1 thread) against  llama-bench -t 2
#
# Tests as llama-bench names them: tg N (decode N tokens from an empty context, one at a
# time) and pp N (one forward over an N-token prompt from an empty context); both sides do a
# warm-up first. candle-tp's side is examples/bench_generate (--prefill-lens for pp, a 1-token
# prompt and N more tokens for tg; its decode includes the distributed greedy sampling,
# llama-bench's does not sample). Rounds are interleaved (every model, type and world in
# each round, the two implementations back to back); the table gives medians over the rounds
# and the ratios candle-tp / llama.cpp. Right before each side, examples/bench_memory
# measures the host's streaming read bandwidth with as many threads: a decode reads every
# weight once per token, so a second table puts each decode's weight traffic (tokens/s x the
# file's weight_bytes_per_token) against the bandwidth measured before it, and gives the
# ceiling that this sets on the ratio (1 / llama.cpp's share). JSON lines go to --out (default
# $CARGO_TARGET_DIR/bench-llama-cpp.jsonl).
#
#   scripts/bench-llama-cpp.sh [--types "Q4_0 Q8_0"] [--models "smollm2 synthetic-1b"]
#                              [--rounds 3] [--pp "128 512"] [--tg 64] [--worlds "1 2"] [--quick]
#                              [--out FILE.jsonl]
#
# --quick: pp 128 only, tg 32, 2 rounds (unless given), for a run of minutes rather than an
# hour. With CANDLE_TP_QUIET_LOCK=/path set, every timed command runs under `flock -x` on that
# file (and builds under `flock -s`), so that nothing else sharing the lock runs meanwhile.
# The first run builds llama.cpp (20-30 minutes on 2 cores) and the models (~10 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."

types="Q4_0 Q4_1 Q5_K_M Q4_K_M Q6_K Q8_0"
models="smollm2 synthetic-1b"
rounds=""
pp="128 512"
tg=64
worlds="1 2"
quick=0
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --types) types="$2"; shift 2 ;;
    --models) models="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --pp) pp="$2"; shift 2 ;;
    --tg) tg="$2"; shift 2 ;;
    --worlds) worlds="$2"; shift 2 ;;
    --quick) quick=1; shift ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ "$quick" = 1 ]; then pp=128; tg=32; fi
if [ -z "$rounds" ]; then
  if [ "$quick" = 1 ]; then rounds=2; else rounds=3; fi
fi
for n in $rounds $tg $pp; do
  case "$n" in ''|*[!0-9]*|0) echo "--rounds, --tg and --pp take positive integers, not '$n'" >&2; exit 2 ;; esac
done
for w in $worlds; do
  case "$w" in 1|2) ;; *) echo "--worlds: 1 and/or 2, not '$w'" >&2; exit 2 ;; esac
done

lock() { # $1 -s|-x, then the command
  local mode="$1"; shift
  if [ -n "${CANDLE_TP_QUIET_LOCK:-}" ]; then flock "$mode" "$CANDLE_TP_QUIET_LOCK" "$@"; else "$@"; fi
}

home="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}"
target_dir="${CARGO_TARGET_DIR:-target}"
export CARGO_TARGET_DIR="$target_dir"
# shellcheck source=scripts/lib/llama-cpp.sh
. scripts/lib/llama-cpp.sh
lbin=$(lock -s bash -c '. scripts/lib/llama-cpp.sh && install_llama_cpp_tools')
gguf=$(lock -s scripts/make-gguf-models.sh --models "$models" --types "$types" | tail -1)
echo "==> building candle-tp (release)" >&2
lock -s cargo build --release --quiet --bin tprun --example bench_generate --example bench_memory
bin="$target_dir/release"

out="${out:-$target_dir/bench-llama-cpp.jsonl}"
: > "$out"
err=$(mktemp)
trap 'rm -f "$err"' EXIT
pp_csv=$(echo "$pp" | tr ' ' ',')
stem() { case "$1" in smollm2) echo smollm2-135m-instruct ;; synthetic-1b) echo synthetic-llama-1b ;; *) echo "unknown model $1" >&2; exit 2 ;; esac; }
tag() { sed "s/^{/{\"round\": $1, \"bench_model\": \"$2\", \"type\": \"$3\", \"world\": $4, /"; }

# candle-tp, world $1: one JSON line from bench_generate (rank 0).
candle_tp() {
  local w="$1" file="$2"
  local cmd=("$bin/examples/bench_generate" --impl candle-tp --model "$file"
    --prefill-lens "$pp_csv" --prompt-len 1 --new-tokens $((tg + 1)))
  if [ "$w" = 1 ]; then
    RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 lock -x "${cmd[@]}" 2>"$err" || { tail -20 "$err" >&2; exit 1; }
  else
    # 1 thread per rank: 2 threads in all, as llama-bench -t 2.
    RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 lock -x "$bin/tprun" --standalone --nproc-per-node 2 "${cmd[@]}" 2>"$err" \
      | sed -n 's/^\[rank 0\] //p' || { tail -20 "$err" >&2; exit 1; }
  fi
}

# The host's streaming read bandwidth with $1 threads: one JSON line.
host_memory() {
  lock -x "$bin/examples/bench_memory" --threads "$1" --mib 1024 --passes 5 2>"$err" \
    || { tail -20 "$err" >&2; exit 1; }
}

# llama-bench -t $1: its JSON lines (one per test).
llama_bench() {
  lock -x "$lbin/llama-bench" -m "$2" -t "$1" -p "$pp_csv" -n "$tg" -r 1 -o jsonl 2>"$err" \
    || { tail -20 "$err" >&2; exit 1; }
}

for r in $(seq "$rounds"); do
  for m in $models; do
    for t in $types; do
      file="$gguf/$(stem "$m").$t.gguf"
      [ -f "$file" ] || { echo "missing $file" >&2; exit 1; }
      for w in $worlds; do
        echo "==> round $r/$rounds, $m $t, world $w: candle-tp, llama-bench -t $w" >&2
        # Alternate which side goes first, so neither always runs on a cooler machine.
        if [ $((r % 2)) = 1 ]; then order="candle llama"; else order="llama candle"; fi
        for side in $order; do
          # The read bandwidth right before each side: this host's moves between runs.
          host_memory "$w" | tag "$r" "$m" "$t" "$w" | sed "s/^{/{\"before\": \"$side\", /" | tee -a "$out" >&2
          if [ "$side" = candle ]; then
            candle_tp "$w" "$file" | tag "$r" "$m" "$t" "$w" | tee -a "$out" >&2
          else
            llama_bench "$w" "$file" | tag "$r" "$m" "$t" "$w" | sed 's/^{/{"impl": "llama.cpp", /' | tee -a "$out" >&2
          fi
        done
      done
    done
  done
done

echo "==> $(date -u '+%Y-%m-%d %H:%M UTC'), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores" >&2
python3 scripts/bench_llama_cpp_table.py "$out"
