#!/usr/bin/env bash
# candle-tp against llama.cpp on a lent device machine's CPU (16-core Intel Xeon with AVX-512
# VNNI and AMX): the table of issue 47, in one call of the `device` tool.
#
#   scripts/bench-device.sh prepare   # here: fills .dev/ (about 20 MB, ignored by git)
#   scripts/bench-device.sh run       # there: device tool `run`, carry [".dev"]
#
# `prepare` (on the development machine) builds the release binaries (tprun, bench_generate,
# bench_memory, make_synthetic_llama, the kernels' bench_repacked and their unit-test binary),
# strips them into .dev/bin.tar.xz, packs llama.cpp's sources from the llama-cpp-python 0.3.36
# sdist (PyPI) without docs, models, tests, examples and GPU backends into
# .dev/llamacpp-src.tar.xz, and writes a tokenizer-only GGUF (SmolLM2's vocabulary) as
# .dev/tok.gguf. The device machine is bare and reaches nothing outside, so everything the run
# needs travels in .dev.
#
# `run` (on the device machine; it also runs on any x86-64 Linux host) writes log.txt,
# results.jsonl and table.txt under $OUT (default /tmp/bench-device-out) and prints:
#   1. the host: CPU model, cores, caches, its AVX-512 and AMX flags;
#   2. the kernels' unit tests on this CPU (AVX-512 VNNI and AMX tiles where it has them),
#      while llama.cpp builds twice in the background, natively (GGML_NATIVE=ON, AMX tiles
#      where the CPU has them) and natively without AMX (-mno-amx-tile -mno-amx-int8
#      -mno-amx-bf16), each binary's count of tile instructions printed;
#   3. the 1 B synthetic Llama of scripts/make-gguf-models.sh (hidden 2048, 16 layers, 32
#      heads, 8 KV heads, intermediate 8192, --seed 1), quantized by llama-quantize to TYPES;
#   4. bench_repacked (one thread, every kernel the CPU runs: AVX2, AVX-512 VNNI, AMX tiles) on
#      KERNEL_TYPES x KERNEL_ROWS, on a 1 B Llama's 5632 x 2048 matrix, after the builds;
#   5. for each round (round 1 candle-tp first, round 2 llama.cpp first), type and N in
#      THREADS: candle-tp world N x 1 thread (with CANDLE_TP_KERNEL=amx on an AMX host whose
#      kernel tests passed, avx512vnni on one where they failed; bench_generate --profile:
#      pp128 and 32 decoded tokens, with the split of each into matmuls, collectives and the
#      rest) against
#      `llama-bench -t N -p 128 -n 32`, native and without AMX (round 1 with NOAMX=1, every
#      round with NOAMX=2); the host's read bandwidth (bench_memory) with N threads in round 1;
#   6. the table (scripts/bench_device_table.py): medians, ratios candle-tp / llama.cpp.
# A DEADLINE (seconds from the start) is checked before each timed step, so the run ends in
# time and prints what it has.
#
# Environment: OUT, DEADLINE (470), TYPES ("Q4_0 Q4_1 Q8_0 Q4_K_M Q6_K"), THREADS ("1 4 16"),
# ROUNDS (2), NOAMX (1; 0: no build without AMX; 2: measured in every round), KERNEL_TYPES
# ("Q4_0 Q8_0 Q4_K"), KERNEL_ROWS ("1 16 128"), KERNEL_UNTIL (200: no bench_repacked starts
# after that many seconds),
# HID/HEADS/KV/INTER/LAYERS (the model's shape, for a quick local check), LLAMA_BIN and
# LLAMA_BIN_NOAMX (prebuilt llama.cpp bin dirs: no build). A local check of the whole flow on a
# small model: OUT=/tmp/bd THREADS="1 2" TYPES=Q4_0 HID=256 HEADS=4 KV=2 INTER=512 LAYERS=2
# scripts/bench-device.sh run.
#
# Device time: about 1.5 minutes to build llama.cpp twice on 16 cores (overlapping the tests
# and the model), 40 s to quantize, then about 30 s per type and round at N = 1, 4, 16.
set -u
cd "$(dirname "$0")/.."
mode=${1:-}

prepare() {
  set -euo pipefail
  # shellcheck source=scripts/lib/llama-cpp.sh
  source scripts/lib/llama-cpp.sh
  grep -qx '/.dev/' .gitignore || echo '/.dev/' >>.gitignore
  mkdir -p .dev
  local target=${CARGO_TARGET_DIR:-target} stage tests
  echo "==> release binaries"
  cargo build --release --bin tprun --example bench_generate --example bench_memory \
    --example make_synthetic_llama
  cargo build --release -p candle-tp-kernels --example bench_repacked
  tests=$(cargo test --release -p candle-tp-kernels --lib --no-run --message-format=json |
    python3 -c 'import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])')
  [ -x "$tests" ] || { echo "no kernel test binary ($tests)" >&2; exit 1; }
  stage=$(mktemp -d)
  cp "$target"/release/tprun "$target"/release/examples/{bench_generate,bench_memory,make_synthetic_llama,bench_repacked} "$stage/"
  cp "$tests" "$stage/kernel-tests"
  strip "$stage"/*
  tar -C "$stage" -cJf .dev/bin.tar.xz .
  rm -rf "$stage"
  echo "==> llama.cpp's sources (llama-cpp-python $llama_cpp_tools_version sdist), pruned"
  local sdist src
  sdist=$(llama_cpp_sdist)
  stage=$(mktemp -d)
  tar -xzf "$sdist" -C "$stage"
  src=$(echo "$stage"/llama_cpp_python-*/vendor/llama.cpp)
  [ -f "$src/CMakeLists.txt" ] || { echo "no vendor/llama.cpp in $sdist" >&2; exit 1; }
  rm -rf "${src:?}"/{docs,models,media,.github,.devops,tests,benches,gguf-py,examples,conversion,pocs,requirements,grammars}
  # tools/CMakeLists.txt adds ui, cli and server only with LLAMA_BUILD_SERVER (off in `run`), and
  # ggml/src/CMakeLists.txt a backend's folder only when its GGML_<BACKEND> is on.
  rm -rf "$src"/tools/{ui,cli,server} "$src"/tools/mtmd/{tests,test-*}
  local b
  for b in cuda metal vulkan sycl cann opencl musa hip kompute webgpu zdnn rpc blas hexagon \
    et openvino virtgpu zendnn; do
    rm -rf "$src/ggml/src/ggml-$b"
  done
  mv "$src" "$stage/llama.cpp"
  tar -C "$stage" -cJf .dev/llamacpp-src.tar.xz llama.cpp
  rm -rf "$stage"
  echo "==> a tokenizer-only GGUF (SmolLM2's vocabulary)"
  local smol="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}/models/smollm2-135m-instruct.Q4_1.gguf"
  [ -f "$smol" ] || scripts/fetch-models.sh
  "$target"/release/examples/make_synthetic_llama --gguf-out .dev/tok.gguf \
    --tokenizer-gguf "$smol" --hidden 64 --heads 2 --kv-heads 1 --intermediate 128 \
    --layers 1 --seed 3 >/dev/null
  du -sh .dev/*
  echo "==> .dev holds $(du -sm .dev | cut -f1) MB; run it with the device tool:"
  echo "    run(command: \"bash scripts/bench-device.sh run\", carry: [\".dev\"], timeout_s: 540)"
}

run() {
  O=${OUT:-/tmp/bench-device-out}
  mkdir -p "$O"
  L=$O/log.txt J=$O/results.jsonl
  : >"$J"
  # Everything printed goes to the log as well. A plain `wait` would also wait for this tee:
  # wait on pids only.
  exec > >(tee -a "$L") 2>&1
  local tee_pid=$!
  T0=$(date +%s)
  DEADLINE=${DEADLINE:-470}
  elapsed() { echo $(($(date +%s) - T0)); }
  left() { echo $((DEADLINE - $(elapsed))); }
  local types=${TYPES:-"Q4_0 Q4_1 Q8_0 Q4_K_M Q6_K"} threads=${THREADS:-"1 4 16"}
  local rounds=${ROUNDS:-2} noamx=${NOAMX:-1}
  local W=${WORK:-/tmp/bench-device-work}
  mkdir -p "$W/bin"
  echo "==> host"
  date -u
  echo "cores: $(nproc)"
  lscpu | grep -E "Model name|Socket|NUMA node\(s\)|Thread|Core|L2|L3" || true
  echo "flags: $(grep -o -w -E 'avx512[a-z_0-9]*|amx[a-z_0-9]*|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  free -g | head -2
  tar -C "$W/bin" -xJf .dev/bin.tar.xz
  local B=$W/bin
  # Built on the development machine (glibc 2.36): a library or symbol version missing here
  # shows now rather than as empty results.
  if ldd "$B"/* 2>&1 | grep -E "not found"; then
    echo "the binaries in .dev/bin.tar.xz do not run on this host (glibc $(ldd --version | head -1 | grep -o '[0-9.]*$'))"
  fi
  echo "==> llama.cpp: two builds in the background (native; native without AMX)"
  local lb=${LLAMA_BIN:-} lbn=${LLAMA_BIN_NOAMX:-} pids=() jobs gen=()
  jobs=$(($(nproc) / 2))
  [ "$jobs" -ge 1 ] || jobs=1
  command -v ninja >/dev/null && gen=(-G Ninja)
  echo "cmake $(cmake --version | head -1 | cut -d' ' -f3), generator ${gen[1]:-Unix Makefiles}, -j $jobs each"
  if [ -z "$lb" ] || { [ "$noamx" != 0 ] && [ -z "$lbn" ]; }; then
    mkdir -p "$W/src"
    tar -C "$W/src" -xJf .dev/llamacpp-src.tar.xz
  fi
  build() { # $1 build dir, $2 extra C/C++ flags
    cmake -S "$W/src/llama.cpp" -B "$1" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DGGML_CUDA=OFF -DCMAKE_C_FLAGS="$2" -DCMAKE_CXX_FLAGS="$2" >"$1.cmake.log" 2>&1 &&
      cmake --build "$1" -j "$jobs" --target llama-bench llama-quantize >"$1.build.log" 2>&1
    echo "llama.cpp build $(basename "$1") rc=$? at $(elapsed) s"
  }
  if [ -z "$lb" ]; then
    build "$W/native" "" &
    pids+=($!)
    lb=$W/native/bin
  fi
  if [ "$noamx" != 0 ] && [ -z "$lbn" ]; then
    # GCC keeps explicit -mno-* over what -march=native turns on, whatever their order.
    build "$W/noamx" "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" &
    pids+=($!)
    lbn=$W/noamx/bin
  fi
  echo "==> the kernels' unit tests on this CPU (AVX-512 VNNI, AMX tiles where present)"
  timeout 150 "$B/kernel-tests" --test-threads "$(nproc)" >"$O/kernel-tests.log" 2>&1
  local rc=$?
  echo "kernel tests rc=$rc at $(elapsed) s"
  if grep -qw amx_int8 /proc/cpuinfo; then
    # `auto` does not choose the AMX tiles yet (kernels/src/kernel.rs says why): the table
    # runs them where their tests pass here, and the AVX-512 VNNI kernel otherwise, so that a
    # broken tile kernel does not cost the table.
    if [ "$rc" = 0 ]; then
      export CANDLE_TP_KERNEL=amx
    else
      export CANDLE_TP_KERNEL=avx512vnni
      grep -E "panicked|FAILED|signal" "$O/kernel-tests.log" | head -20
    fi
    echo "candle-tp runs with CANDLE_TP_KERNEL=$CANDLE_TP_KERNEL"
  fi
  grep -E "^test result|FAILED|panicked" "$O/kernel-tests.log" | sort | uniq -c | head -30
  # Which kernels ran, and whether the AMX tiles did (the tests print it).
  "$B/kernel-tests" kernel::tests every_value_is_the_unpacked_rows_f64_dot panels_are \
    --nocapture --test-threads 1 2>&1 | grep -E "kernels under test|AMX" | sed "s/^test .* \.\.\. //" |
    sort | uniq -c
  echo "==> the 1 B model (F16)"
  "$B/make_synthetic_llama" --gguf-out "$W/m.F16.gguf" --tokenizer-gguf .dev/tok.gguf \
    --hidden "${HID:-2048}" --heads "${HEADS:-32}" --kv-heads "${KV:-8}" \
    --intermediate "${INTER:-8192}" --layers "${LAYERS:-16}" --seed 1 2>&1 | tail -1
  echo "model made at $(elapsed) s"
  local p
  for p in "${pids[@]}"; do wait "$p"; done
  for d in "$lb" ${lbn:+"$lbn"}; do
    if [ ! -x "$d/llama-bench" ]; then
      echo "no llama-bench in $d:"
      tail -30 "$(dirname "$d")".{cmake,build}.log 2>/dev/null
      [ "$d" = "$lb" ] && exit 1
      lbn=""
      continue
    fi
    if command -v objdump >/dev/null; then
      echo "$d/llama-bench: $(objdump -d "$d/llama-bench" | grep -c -E 'tdpb|tileloadd') AMX tile instructions"
    else
      echo "objdump missing: the AMX instructions of $d/llama-bench not counted"
    fi
  done
  # All types at once, the cores shared between them.
  local t qt ntypes qpids=() ok_types=""
  ntypes=$(echo "$types" | wc -w)
  qt=$(( ($(nproc) + ntypes - 1) / ntypes ))
  for t in $types; do
    "$lb/llama-quantize" "$W/m.F16.gguf" "$W/m.$t.gguf" "$t" "$qt" >"$W/q.$t.log" 2>&1 &
    qpids+=($!)
  done
  set -- "${qpids[@]}"
  for t in $types; do
    if wait "$1" && [ -s "$W/m.$t.gguf" ]; then
      ok_types="$ok_types $t"
      echo "quantized $t at $(elapsed) s: $(du -m "$W/m.$t.gguf" | cut -f1) MB"
    else
      echo "llama-quantize $t failed:"
      tail -5 "$W/q.$t.log"
    fi
    shift
  done
  rm -f "$W/m.F16.gguf"
  types=${ok_types# }
  [ -n "$types" ] || exit 1
  echo "==> bench_repacked (one thread; every kernel this CPU runs)"
  local kt m
  BT=none "$B/bench_repacked" 1 2>/dev/null | head -2
  for kt in ${KERNEL_TYPES:-Q4_0 Q8_0 Q4_K}; do
    for m in ${KERNEL_ROWS:-1 16 128}; do
      [ "$(elapsed)" -lt "${KERNEL_UNTIL:-200}" ] || { echo "KERNEL_UNTIL: no more bench_repacked"; break 2; }
      # bench_repacked names the types as candle does: Q4K, not Q4_K.
      BT=${kt/_K/K} BM=$m timeout 60 "$B/bench_repacked" 3 2>&1 | grep -v "^type\|^kernels" |
        grep -E "5632x2048" || true
    done
  done
  mem() { # $1 threads
    timeout 60 "$B/bench_memory" --threads "$1" --mib 2048 --passes 3 2>/dev/null |
      sed "s/^{/{\"side\":\"mem\",\"t\":$1,/" >>"$J"
  }
  tag() { sed "s/^{/{\"side\":\"$1\",\"t\":$2,\"type\":\"$3\",\"round\":$4,/"; }
  rows() { wc -l <"$J"; }
  ctp() { # $1 N, $2 type, $3 round
    local before
    before=$(rows)
    local c=("$B/bench_generate" --impl candle-tp --model "$W/m.$2.gguf" --prefill-lens 128
      --prompt-len 1 --new-tokens 33 --profile)
    if [ "$1" = 1 ]; then
      RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 timeout 150 "${c[@]}" 2>"$W/err"
    else
      RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 timeout 150 "$B/tprun" --standalone \
        --nproc-per-node "$1" "${c[@]}" 2>"$W/err" | sed -n 's/^\[rank 0\] //p'
    fi | grep '^{' | tag candle-tp "$1" "$2" "$3" >>"$J"
    [ "$(rows)" != "$before" ] || { echo "candle-tp $2 N=$1 failed:"; tail -5 "$W/err"; }
  }
  lcpp() { # $1 N, $2 type, $3 round, $4 bin dir, $5 side
    local before
    before=$(rows)
    timeout 150 "$4/llama-bench" -m "$W/m.$2.gguf" -t "$1" -p 128 -n 32 -r 1 -o jsonl \
      2>"$W/lerr" | grep '^{' | tag "$5" "$1" "$2" "$3" >>"$J"
    [ "$(rows)" != "$before" ] || { echo "$5 $2 N=$1 failed:"; tail -5 "$W/lerr"; }
  }
  echo "==> the table: $rounds rounds of $types at N = $threads"
  local r n
  for r in $(seq 1 "$rounds"); do
    for t in $types; do
      for n in $threads; do
        [ "$(left)" -gt 30 ] || { echo "deadline: stop before round $r $t N=$n"; break 3; }
        [ "$r" = 1 ] && [ "$t" = "${types%% *}" ] && mem "$n"
        if [ $((r % 2)) = 1 ]; then
          ctp "$n" "$t" "$r"
          lcpp "$n" "$t" "$r" "$lb" llama.cpp
        else
          lcpp "$n" "$t" "$r" "$lb" llama.cpp
          ctp "$n" "$t" "$r"
        fi
        if [ -n "$lbn" ] && { [ "$r" = 1 ] || [ "$noamx" = 2 ]; }; then
          lcpp "$n" "$t" "$r" "$lbn" llama.cpp-noamx
        fi
        echo "round $r $t N=$n at $(elapsed) s"
      done
    done
  done
  python3 scripts/bench_device_table.py "$J" | tee "$O/table.txt"
  echo "total $(elapsed) s"
  # The log complete before the device tool collects $OUT.
  exec >/dev/null 2>&1
  wait "$tee_pid"
}

case "$mode" in
  prepare) prepare ;;
  run) run ;;
  *)
    sed -n '2,/^set -u/p' "$0" | sed '$d'
    exit 2
    ;;
esac
