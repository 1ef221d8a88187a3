#!/usr/bin/env bash
# candle-tp's shm collectives against Open MPI (shared memory), side by side in one run.
#
#   scripts/bench-collectives.sh                     # all_reduce f32, 2 3 4 ranks, 4K..64M
#   scripts/bench-collectives.sh --ranks "2" --sizes 4K,1M --ops all_reduce,all_gather
#   scripts/bench-collectives.sh --gloo              # also PyTorch gloo (installs torch: GBs)
#   scripts/bench-collectives.sh --load --ranks 2 --sizes 4K,64K   # on a busy machine
#   scripts/bench-collectives.sh --ops all_to_all,all_to_all_fallback --ranks "2 3 4"
#
# all_to_all_fallback is candle-tp's all-to-all through an all-gather of every send buffer
# (what backends without their own run): shown as its own column beside the native one and
# MPI_Alltoall.
#
# --load starts one busy process per core for the whole run (a stand-in for a compile on the
# same cores) and runs --rounds rounds (default 5 with --load, else 1), MPI and candle-tp
# interleaved, so both meet the same load; the table shows the median over rounds of each
# round's median.
#
# Both sides time the same way (see benches/mpi_collectives.c): per-iteration latency, the
# slowest rank per iteration, median over iterations. Prints one table of medians and the
# candle-tp / MPI time ratio per size, and keeps the JSON lines in $OUT_DIR (default
# target/bench-collectives).
set -euo pipefail
cd "$(dirname "$0")/.."

ranks="2 3 4"
sizes="4K,16K,64K,256K,1M,4M,16M,64M"
ops="all_reduce"
gloo=0
load=0
rounds=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --sizes) sizes="$2"; shift 2 ;;
    --ops) ops="$2"; shift 2 ;;
    --gloo) gloo=1; shift ;;
    --load) load=1; shift ;;
    --rounds) rounds="$2"; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
  echo "==> installing Open MPI (openmpi-bin libopenmpi-dev)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi

target_dir="${CARGO_TARGET_DIR:-target}"
out="${OUT_DIR:-$target_dir/bench-collectives}"
mkdir -p "$out"
echo "==> building (release)" >&2
cargo build --release --quiet --bin tprun --example bench_collectives
mpicc -O2 -o "$out/mpi_collectives" benches/mpi_collectives.c

cores=$(nproc)
: > "$out/results.jsonl"
if [ -z "$rounds" ]; then rounds=$([ "$load" = 1 ] && echo 5 || echo 1); fi
if [ "$load" = 1 ]; then
  echo "==> background load: $cores busy processes" >&2
  load_pids=()
  for _ in $(seq "$cores"); do
    bash -c 'while :; do :; done' &
    load_pids+=($!)
  done
  trap 'kill "${load_pids[@]}" 2>/dev/null || true' EXIT
fi
for round in $(seq "$rounds"); do
for n in $ranks; do
  echo "==> round $round/$rounds, $n ranks ($cores cores)" >&2
  # Oversubscribed MPI must not busy-poll forever: let it yield, as candle-tp does.
  mpi_flags=(--allow-run-as-root --mca btl self,vader -np "$n")
  if [ "$n" -gt "$cores" ]; then mpi_flags+=(--oversubscribe --mca mpi_yield_when_idle 1); fi
  mpirun "${mpi_flags[@]}" "$out/mpi_collectives" "$ops" ${sizes//,/ } | tee -a "$out/results.jsonl" >&2
  "$target_dir/release/tprun" --standalone --nproc-per-node "$n" "$target_dir/release/examples/bench_collectives" \
    --ops "$ops" --dtypes f32 --sizes "$sizes" | sed -n 's/^\[rank 0\] //p' | tee -a "$out/results.jsonl" >&2
  if [ "$load" = 1 ]; then
    CANDLE_TP_PATIENCE_YIELD=1 "$target_dir/release/tprun" --standalone --nproc-per-node "$n" "$target_dir/release/examples/bench_collectives" \
      --ops "$ops" --dtypes f32 --sizes "$sizes" | sed -n 's/^\[rank 0\] //p' \
      | sed 's/"impl": *"candle-tp"/"impl":"candle-tp, yielding"/' | tee -a "$out/results.jsonl" >&2
    # The same with the adaptive wait off (spin, a few yields, then sleep: the old policy).
    CANDLE_TP_PATIENCE_US=0 "$target_dir/release/tprun" --standalone --nproc-per-node "$n" "$target_dir/release/examples/bench_collectives" \
      --ops "$ops" --dtypes f32 --sizes "$sizes" | sed -n 's/^\[rank 0\] //p' \
      | sed 's/"impl": *"candle-tp"/"impl":"candle-tp, no patience"/' | tee -a "$out/results.jsonl" >&2
  fi
  if [ "$gloo" = 1 ]; then
    python3 -c "import torch" 2>/dev/null || pip install --quiet torch --index-url https://pypi.org/simple >&2
    python3 benches/gloo_collectives.py --world "$n" --ops "$ops" --sizes "$sizes" | tee -a "$out/results.jsonl" >&2
  fi
done
done

python3 - "$out/results.jsonl" "$load" "$rounds" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
runs = {}
for r in rows:
    runs.setdefault((r["op"], r["world_size"], r["bytes"], r["impl"]), []).append(r)
by = {}
for (op, n, b, impl), rs in runs.items():
    r = dict(rs[0])
    r["median_us"] = statistics.median(x["median_us"] for x in rs)
    r["busbw_gbps"] = statistics.median(x.get("busbw_gbps", 0.0) for x in rs)
    by.setdefault((op, n, b), {})[impl] = r
print()
print(f"{'with' if sys.argv[2] == '1' else 'without'} background load; median of {sys.argv[3]} round(s)")
def size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
impls = [i for i in ("candle-tp", "candle-tp, all-gather fallback", "candle-tp, yielding", "candle-tp, no patience", "mpi", "gloo") if any(i in v for v in by.values())]
print()
print(f"| op | ranks | size | " + " | ".join(f"{i} median" for i in impls) + " | candle-tp / MPI | candle-tp busbw GB/s |")
print("|---|---|---|" + "---|" * len(impls) + "---|---|")
worst = {}
for (op, n, b), v in sorted(by.items()):
    cells = [f"{v[i]['median_us']:.1f} µs" if i in v else "-" for i in impls]
    ratio = v["candle-tp"]["median_us"] / v["mpi"]["median_us"] if "candle-tp" in v and "mpi" in v else None
    if ratio is not None:
        worst[(op, n)] = max(worst.get((op, n), 0), ratio)
    bw = f"{v['candle-tp']['busbw_gbps']:.2f}" if "candle-tp" in v else "-"
    rs = f"{ratio:.2f}" if ratio is not None else "-"
    print(f"| {op} | {n} | {size(b)} | " + " | ".join(cells) + f" | {rs} | {bw} |")
print()
for (op, n), r in sorted(worst.items()):
    print(f"worst candle-tp / MPI ratio, {op}, {n} ranks: {r:.2f}")
PY
