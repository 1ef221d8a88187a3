#!/usr/bin/env bash
# Across emulated hosts (scripts/hosts.sh: network namespaces on one machine), side by side in
# one run, rounds interleaved, medians:
#
#   scripts/bench-hosts.sh                      # all-reduce, then decoding, then serving
#   scripts/bench-hosts.sh --only all-reduce --rates "1gbit" --sizes 4K,1M --rounds 1
#   scripts/bench-hosts.sh --only serve --rates "1gbit unlimited" --rounds 1
#   scripts/bench-hosts.sh --only decode --ep --models MOE.gguf    # and expert parallelism
#
# all-reduce: f32, 4K..64M, 2 hosts x 2 ranks (--map-by node: a host's ranks are not
#   consecutive), at each link rate of --rates (tc tbf on every host link; "unlimited" for
#   none): candle-tp's hierarchical backend (shm inside a host, MPI across; with and without
#   the agreement on sizes before each MPI stage, CANDLE_TP_MPI_CHECK=0), candle-tp on flat
#   MPI (CANDLE_TP_BACKEND=mpi), and Open MPI's own MPI_Allreduce (benches/mpi_collectives.c,
#   shared memory inside a host and TCP across, as mpirun picks them). Also the payload each
#   rank hands to the network per all-reduce (candle-tp's statistics).
# decode: greedy decoding of --models (default SmolLM2 Q4_1, and the synthetic ~1 B Llama in
#   Q4_0 and Q4_1 that scripts/make-gguf-models.sh makes with llama-quantize) at 1 host x 1
#   rank, 1 host x 2 ranks, 2 hosts x 1 rank and 2 hosts x 2 ranks, 1 thread per rank, and as
#   pipelines across the hosts (2 hosts x 1 as 2 stages; 2 hosts x 2 as 2 stages of 2
#   tensor-parallel ranks, a stage a host), with --ep also expert-parallel (2 hosts x 1 and
#   2 hosts x 2 with whole experts per rank, `--ep`; and 2 hosts x 2 as `--ep 2`, --map-by
#   slot: a host an expert group, each expert split over the host's 2 ranks), at each
#   link rate: tokens/s, collectives and bytes crossing hosts per token; llama.cpp's own
#   llama-bench on the same files, on one host (1 and 2 threads) and with its RPC backend
#   (rpc-server on the second host), built by scripts/lib/llama-cpp.sh from the sources in
#   the llama-cpp-python 0.3.36 sdist; and, with DLLAMA_SRC=CHECKOUT, distributed-llama
#   (b4rtaz/distributed-llama, on no registry: clone it yourself; built here with make) on a
#   random-weight model of the synthetic 1 B Llama's shape in its own Q40 format
#   (scripts/dllama_model.py), 1 host x 1 thread and 2 hosts x 1 thread. Each round also
#   measures the machine's streaming read bandwidth (examples/bench_memory, 1 and 2 threads):
#   the emulated hosts share one memory, so it bounds what 2 ranks can gain over 1 (a table
#   gives that ceiling).
# serve: candle-tp-serve under mpirun on the 2 hosts (rank 0, and so HTTP, on ctp-h1), SmolLM2
#   Q4_1 (--serve-model), as 2 tensor-parallel ranks across the hosts and as 2 pipeline stages
#   (one a host), at each link rate: scripts/bench_serve.py from ctp-h1 at 1, 4, 8 and 16
#   concurrent streams of greedy requests (--serve-tokens tokens each, 2 per stream), total
#   tokens/s, and what crossed the hosts per generated token (the server's /metrics).
#
# Needs root (network namespaces), Open MPI (installed by scripts/setup-mpi.sh) and the mpi
# feature. The machine's cores are shared by every emulated host: 2 hosts x 2 ranks on 2 cores
# are oversubscribed, which the figures show as they are. This kernel has no netem: links get a
# rate, not a latency. JSON lines go to $OUT_DIR (default $CARGO_TARGET_DIR/bench-hosts), then
# a table with ratios from the same run.
set -euo pipefail
cd "$(dirname "$0")/.."

rates="1gbit unlimited"
sizes="4K,16K,64K,256K,1M,4M,16M,64M"
rounds=3
only=""
models=""
new_tokens=48
serve_model=""
serve_tokens=32
ep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --rates) rates="$2"; shift 2 ;;
    --sizes) sizes="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    --models) models="$2"; shift 2 ;;
    --ep) ep=1; shift ;;
    --new-tokens) new_tokens="$2"; shift 2 ;;
    --serve-model) serve_model="$2"; shift 2 ;;
    --serve-tokens) serve_tokens="$2"; shift 2 ;;
    -h|--help) sed -n '2,41p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$only" in ""|all-reduce|decode|serve) ;; *) echo "--only all-reduce, decode or serve" >&2; exit 2 ;; esac

scripts/hosts.sh check >/dev/null || { scripts/hosts.sh check; exit 1; }
# The hosts are global: one user at a time on the machine (the tests take the same lock).
exec 9>/tmp/candle-tp-hosts.lock
flock 9
scripts/setup-mpi.sh >&2
home=${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}
target_dir="${CARGO_TARGET_DIR:-target}"
out="${OUT_DIR:-$target_dir/bench-hosts}"
mkdir -p "$out"
results="$out/results.jsonl"
: >"$results"
trap 'scripts/hosts.sh down >/dev/null 2>&1 || true' EXIT

echo "==> building (release, features mpi and server)" >&2
cargo build --release --quiet --features mpi,server --example bench_collectives --example bench_generate \
  --example bench_memory \
  --bin candle-tp-serve
mpicc -O2 -o "$out/mpi_collectives" benches/mpi_collectives.c
bin="$target_dir/release/examples"

# mpirun on the hosts (hosts.sh makes waiting ranks yield: the hosts share the cores), 1 thread
# per rank.
# MAP_BY=slot with --host h1:2,h2:2 keeps consecutive ranks (a tensor-parallel group) on a host.
on_hosts() {
  local np=$1; shift
  scripts/hosts.sh mpirun -np "$np" --map-by "${MAP_BY:-node}" --oversubscribe -x RAYON_NUM_THREADS=1 "$@"
}
# Rank 0's JSON lines, tagged with the run's fields.
tag() { sed -n "s/^\[1,0\]<stdout>:{/{$1, /p" | tee -a "$results" >&2; }

# Waits up to 10 s for a TCP port on an emulated host to accept (from ctp-h1).
wait_port() {
  for _ in $(seq 100); do
    ip netns exec ctp-h1 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null && return 0
    sleep 0.1
  done
}
# distributed-llama's dllama built from the checkout $1 (make, -march=native, as its README
# says), cached under $CANDLE_TP_HOME by the checkout's commit; prints the binary's path.
build_dllama() {
  local src=$1 rev dir
  rev=$(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo local)
  dir="$home/distributed-llama-$rev"
  if [ ! -x "$dir/dllama" ]; then
    echo "==> building distributed-llama $rev (make dllama)" >&2
    rm -rf "$dir.tmp" && cp -r "$src" "$dir.tmp"
    (cd "$dir.tmp" && nice -n 10 make dllama >&2) && rm -rf "$dir" && mv "$dir.tmp" "$dir"
  fi
  echo "$dir/dllama"
}

if [ "$only" = "" ] || [ "$only" = all-reduce ]; then
  for rate in $rates; do
    if [ "$rate" = unlimited ]; then scripts/hosts.sh up 2 >&2; else scripts/hosts.sh up 2 "$rate" >&2; fi
    for r in $(seq "$rounds"); do
      echo "==> all-reduce, $rate links, round $r/$rounds" >&2
      # Only rank 0 of the MPI program prints.
      on_hosts 4 "$out/mpi_collectives" all_reduce ${sizes//,/ } \
        | sed 's/^{/[1,0]<stdout>:{/' | tag "\"round\": $r, \"rate\": \"$rate\""
      on_hosts 4 --tag-output "$bin/bench_collectives" --ops all_reduce --dtypes f32 --sizes "$sizes" \
        | tag "\"round\": $r, \"rate\": \"$rate\""
      on_hosts 4 --tag-output -x CANDLE_TP_MPI_CHECK=0 "$bin/bench_collectives" --ops all_reduce \
        --dtypes f32 --sizes "$sizes" | tag "\"round\": $r, \"rate\": \"$rate\", \"unchecked\": true"
      on_hosts 4 --tag-output -x CANDLE_TP_BACKEND=mpi "$bin/bench_collectives" --ops all_reduce \
        --dtypes f32 --sizes "$sizes" | tag "\"round\": $r, \"rate\": \"$rate\""
    done
    scripts/hosts.sh down >&2
  done
fi

if [ "$only" = "" ] || [ "$only" = decode ]; then
  if [ -z "$models" ]; then
    scripts/fetch-models.sh >&2
    # The synthetic ~1 B Llama, quantized by llama.cpp's llama-quantize (built once).
    scripts/make-gguf-models.sh --models synthetic-1b --types "Q4_0 Q4_1" >&2
    models="$home/models/smollm2-135m-instruct.Q4_1.gguf"
    models="$models $home/models/gguf/synthetic-llama-1b.Q4_0.gguf $home/models/gguf/synthetic-llama-1b.Q4_1.gguf"
  fi
  # shellcheck source=scripts/lib/llama-cpp.sh
  . scripts/lib/llama-cpp.sh
  lbin=$(install_llama_cpp_tools)
  # distributed-llama (tensor parallelism over TCP between CPU hosts), when a checkout of it is
  # given: it is on no registry this project installs from.
  dllama=""
  if [ -n "${DLLAMA_SRC:-}" ]; then
    dllama=$(build_dllama "$DLLAMA_SRC")
    dmodel="$home/models/dllama-synthetic-1b"
    [ -f "$dmodel/model.m" ] || python3 scripts/dllama_model.py "$dmodel" \
      "$home/models/smollm2-135m-instruct/tokenizer.json" >&2
  else
    echo "==> distributed-llama skipped: set DLLAMA_SRC to a checkout of b4rtaz/distributed-llama" >&2
  fi
  common=(--new-tokens "$new_tokens" --prompt-len 16)
  for rate in $rates; do
    if [ "$rate" = unlimited ]; then scripts/hosts.sh up 2 >&2; else scripts/hosts.sh up 2 "$rate" >&2; fi
    for r in $(seq "$rounds"); do
      for m in $models; do
        name=$(basename "$m")
        echo "==> decode $name, $rate links, round $r/$rounds" >&2
        # Tensor parallelism: 1 host x 1 rank, 1 host x 2 ranks (both on ctp-h1), 2 hosts x 1,
        # 2 hosts x 2 (--map-by node: a host's ranks are not consecutive, every all-reduce
        # crosses). Pipeline: 2 stages, one a host (2 hosts x 1, pp 2), and 2 stages of 2
        # tensor-parallel ranks each inside its host (2 hosts x 2, pp 2 x tp 2: --map-by slot,
        # ranks 0-1 on ctp-h1, 2-3 on ctp-h2).
        layouts=("1 ctp-h1:1 node 1" "2 ctp-h1:2 node 1" "2 - node 1" "4 - node 1"
          "2 - node 2" "4 ctp-h1:2,ctp-h2:2 slot 2")
        # Expert parallelism (a 5th field: the --ep value, 0 for whole experts per rank).
        [ "$ep" = 0 ] || layouts+=("2 - node 1 0" "4 - node 1 0" "4 ctp-h1:2,ctp-h2:2 slot 1 2")
        for layout in "${layouts[@]}"; do
          set -- $layout
          np=$1 host=$2 map=$3 pp=$4 epn=${5:-}
          [ "$host" = - ] && host=""
          case "$host" in *,*|"") label="2 hosts x $((np / 2))" ;; *) label="1 host x $np" ;; esac
          if [ "$pp" != 1 ]; then
            label="$label, pp $pp"
            if [ "$np" -gt "$pp" ]; then label="$label x tp $((np / pp))"; fi
          fi
          eparg=()
          case "$epn" in
            "") ;;
            0) label="$label, ep (whole experts per rank)"; eparg=(--ep) ;;
            *) label="$label, ep $epn x etp $((np / epn))"; eparg=(--ep "$epn") ;;
          esac
          MAP_BY=$map on_hosts "$np" --tag-output ${host:+--host "$host"} "$bin/bench_generate" \
            --model "$m" --pp "$pp" "${eparg[@]}" "${common[@]}" \
            | tag "\"round\": $r, \"rate\": \"$rate\", \"model\": \"$name\", \"layout\": \"$label\""
        done
        # llama.cpp's RPC backend on the same file and hosts: rpc-server on ctp-h2 holds part
        # of the layers (llama.cpp splits them between its devices), llama-bench on ctp-h1 the
        # rest; and llama-bench alone on one host with 1 and 2 threads. tg = decode tokens/s.
        for t in 1 2; do
          ip netns exec ctp-h1 "$lbin/llama-bench" -m "$m" -t "$t" -p 0 -n "$new_tokens" -r 1 -o jsonl \
            2>/dev/null | sed -n "s/^{/{\"round\": $r, \"rate\": \"$rate\", \"model\": \"$name\", \"layout\": \"llama.cpp 1 host x $t thread(s)\", /p" \
            | tee -a "$results" >&2
        done
        # The machine's streaming read bandwidth with 1 and 2 threads: the ceiling of every
        # layout above, whose emulated hosts share this machine's memory.
        for t in 1 2; do
          "$bin/bench_memory" --threads "$t" \
            | sed -n "s/^{/{\"round\": $r, \"rate\": \"$rate\", \"model\": \"$name\", \"layout\": \"host read, $t thread(s)\", /p" \
            | tee -a "$results" >&2
        done
        ip netns exec ctp-h2 "$lbin/rpc-server" -H 10.77.0.12 -p 50052 -t 1 >"$out/rpc-server.log" 2>&1 &
        rpc_pid=$!
        wait_port 10.77.0.12 50052
        ip netns exec ctp-h1 "$lbin/llama-bench" -m "$m" -t 1 -p 0 -n "$new_tokens" -r 1 -o jsonl \
          --rpc 10.77.0.12:50052 2>/dev/null \
          | sed -n "s/^{/{\"round\": $r, \"rate\": \"$rate\", \"model\": \"$name\", \"layout\": \"llama.cpp RPC 2 hosts x 1 thread\", /p" \
          | tee -a "$results" >&2
        kill "$rpc_pid" 2>/dev/null || true
        wait "$rpc_pid" 2>/dev/null || true
      done
      if [ -n "$dllama" ]; then
        echo "==> distributed-llama, $rate links, round $r/$rounds" >&2
        for hosts in 1 2; do
          workers=()
          if [ "$hosts" = 2 ]; then
            ip netns exec ctp-h2 "$dllama" worker --port 9999 --nthreads 1 >"$out/dllama-worker.log" 2>&1 &
            worker_pid=$!
            # Not wait_port: the worker takes the first connection for its root and then fails.
            for _ in $(seq 100); do
              grep -q "Listening" "$out/dllama-worker.log" 2>/dev/null && break
              sleep 0.1
            done
            workers=(--workers 10.77.0.12:9999)
          fi
          # A short prompt, then at least $new_tokens predicted tokens; "Prediction ... tokens/s".
          tps=$(ip netns exec ctp-h1 "$dllama" inference --model "$dmodel/model.m" \
            --tokenizer "$dmodel/tokenizer.t" --buffer-float-type q80 --nthreads 1 \
            --max-seq-len 512 --steps $((16 + new_tokens)) "${workers[@]}" \
            --prompt "Hello world" \
            2>&1 | awk '/^Prediction/ {p = 1} p && /tokens\/s:/ {print $2; exit}') || true
          if [ "$hosts" = 2 ]; then
            kill "$worker_pid" 2>/dev/null || true
            wait "$worker_pid" 2>/dev/null || true
          fi
          [ -n "$tps" ] || echo "==> distributed-llama on $hosts host(s) printed no speed" >&2
          [ -z "$tps" ] || echo "{\"round\": $r, \"rate\": \"$rate\", \"model\": \"synthetic-llama-1b (distributed-llama Q40)\", \"layout\": \"distributed-llama $hosts host(s) x 1 thread\", \"tokens_per_s\": $tps}" \
            | tee -a "$results" >&2
        done
      fi
    done
    scripts/hosts.sh down >&2
  done
fi

if [ "$only" = "" ] || [ "$only" = serve ]; then
  [ -n "$serve_model" ] || { scripts/fetch-models.sh >&2; serve_model="$home/models/smollm2-135m-instruct.Q4_1.gguf"; }
  # shellcheck source=scripts/lib/start-server.sh
  . scripts/lib/start-server.sh
  for rate in $rates; do
    if [ "$rate" = unlimited ]; then scripts/hosts.sh up 2 >&2; else scripts/hosts.sh up 2 "$rate" >&2; fi
    for r in $(seq "$rounds"); do
      for pp in 1 2; do
        label=$([ "$pp" = 1 ] && echo "2 hosts x 1, tp 2" || echo "2 hosts x 1, pp 2")
        echo "==> serve, $label, $rate links, round $r/$rounds" >&2
        slog=$(mktemp)
        on_hosts 2 --tag-output "$target_dir/release/candle-tp-serve" --model "$serve_model" \
          --port 0 --pp "$pp" --max-batch 16 --max-seq-len 512 >"$slog" 2>&1 &
        spid=$!
        sport=$(wait_for_port "$spid" "$slog" 's/.*"listening":"http:\/\/[^:]*:\([0-9]*\)".*/\1/p' "the server")
        metric() {
          ip netns exec ctp-h1 curl -s "http://127.0.0.1:$sport/metrics" \
            | awk -v m="$1" '$1 == m || index($1, m "{") == 1 {s += $2} END {printf "%.0f", s}'
        }
        bytes0=$(metric candle_tp:comm_cross_host_bytes_total)
        tokens0=$(metric candle_tp:generation_tokens_total)
        ip netns exec ctp-h1 python3 scripts/bench_serve.py "$sport" --levels 1,4,8,16 \
          --max-tokens "$serve_tokens" --requests-per-stream 2 \
          --extra "{\"min_tokens\": $serve_tokens}" >"$out/serve-one.json"
        bytes1=$(metric candle_tp:comm_cross_host_bytes_total)
        tokens1=$(metric candle_tp:generation_tokens_total)
        python3 -c '
import json, sys
v = json.load(open(sys.argv[1]))
b, t = float(sys.argv[6]) - float(sys.argv[5]), float(sys.argv[8]) - float(sys.argv[7])
print(json.dumps({"round": int(sys.argv[2]), "rate": sys.argv[3], "serve": sys.argv[4],
                  "levels": v["levels"], "rank0_cross_host_bytes_per_token": b / t if t else None}))' \
          "$out/serve-one.json" "$r" "$rate" "$label" "$bytes0" "$bytes1" "$tokens0" "$tokens1" \
          | tee -a "$results" >&2
        kill -TERM "$spid" 2>/dev/null || true
        wait "$spid" 2>/dev/null || true
        rm -f "$slog"
      done
    done
    scripts/hosts.sh down >&2
  done
fi

python3 scripts/bench_hosts_table.py "$results"
