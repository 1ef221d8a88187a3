# shellcheck shell=bash
# Sourced by scripts/bench-generate.sh, bench-serve.sh and bench-llama-cpp.sh: llama.cpp through
# llama-cpp-python 0.3.36 (PyPI), built once for this CPU into $CANDLE_TP_HOME/venv-llama-cpp.
#
#   py=$(install_llama_cpp)          # the venv's python (about 15 minutes the first time)
#   py=$(install_llama_cpp_server)   # the same, plus the `[server]` extras (no rebuild)
#   start_llama_cpp_server "$py" FILE.gguf THREADS [llama_cpp.server options...]
#   stop_llama_cpp_server
#
# start_llama_cpp_server sets llama_pid, llama_log and llama_port (a free port) and returns
# once the server answers; the caller stops it (stop_llama_cpp_server, e.g. in its EXIT trap).

llama_cpp_home() { echo "${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}"; }

install_llama_cpp() {
  local venv
  venv="$(llama_cpp_home)/venv-llama-cpp"
  if [ -f "$venv/.complete" ] && "$venv/bin/python" -c "import llama_cpp, numpy" 2>/dev/null; then
    echo "$venv/bin/python"; return
  fi
  echo "==> building llama-cpp-python into $venv (about 15 minutes on 2 cores)" >&2
  # A venv left half-made by an interrupted run is started again, not trusted.
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  CMAKE_ARGS="-DGGML_NATIVE=ON" "$venv/bin/pip" install --quiet llama-cpp-python==0.3.36 numpy >&2
  touch "$venv/.complete"
  echo "$venv/bin/python"
}

# The server extras (uvicorn, fastapi, sse-starlette, starlette-context, pydantic-settings,
# PyYAML) only: llama-cpp-python is already installed at the pinned version, so pip keeps it
# and compiles nothing.
install_llama_cpp_server() {
  local py
  py=$(install_llama_cpp)
  if ! "$py" -c "import uvicorn, llama_cpp.server.app" 2>/dev/null; then
    echo "==> adding llama-cpp-python's [server] extras to $(dirname "$(dirname "$py")")" >&2
    "$(dirname "$py")/pip" install --quiet 'llama-cpp-python[server]==0.3.36' >&2
  fi
  echo "$py"
}

start_llama_cpp_server() {
  local py="$1" model="$2" threads="$3"; shift 3
  llama_log=$(mktemp)
  # --port 0: uvicorn binds a free port and prints it. --interrupt_requests False: by default
  # a streaming answer is cut short ([DONE]) as soon as another request waits for the model.
  "$py" -m llama_cpp.server --model "$model" --host 127.0.0.1 --port 0 \
    --n_threads "$threads" --n_threads_batch "$threads" --interrupt_requests False \
    --verbose False "$@" >"$llama_log" 2>&1 &
  llama_pid=$!
  # wait_for_port: scripts/lib/start-server.sh (sourced with this file by bench-serve.sh).
  # shellcheck disable=SC2034  # read by the scripts that source this file
  llama_port=$(wait_for_port "$llama_pid" "$llama_log" \
    's/.*Uvicorn running on http:\/\/[^:]*:\([0-9]*\).*/\1/p' "the llama.cpp server")
}

# start_llama_server BIN_DIR FILE.gguf THREADS PARALLEL CTX_PER_SLOT [llama-server options...]:
# llama.cpp's own server with PARALLEL slots and continuous batching, on a free port; sets
# llama_pid, llama_log and llama_port like start_llama_cpp_server (stop_llama_cpp_server
# stops it).
start_llama_server() {
  local bin="$1" model="$2" threads="$3" parallel="$4" ctx="$5"; shift 5
  llama_log=$(mktemp)
  # A free port from the kernel (closed again at once; llama-server binds it right after).
  llama_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$bin/llama-server" -m "$model" --host 127.0.0.1 --port "$llama_port" -t "$threads" \
    -tb "$threads" --parallel "$parallel" --cont-batching -c $((ctx * parallel)) \
    --no-webui "$@" >"$llama_log" 2>&1 &
  llama_pid=$!
  # It logs "listening on ADDRESS" once the model is loaded.
  wait_for_port "$llama_pid" "$llama_log" 's/.*listening on [^ ]*:\([0-9][0-9]*\).*/\1/p' \
    "llama-server" >/dev/null
}

stop_llama_cpp_server() {
  stop_job "${llama_pid:-}" "${llama_log:-}" # scripts/lib/start-server.sh
  llama_pid="" llama_log=""
}

# llama.cpp's own C++ tools (llama-bench, llama-server, llama-quantize, llama-cli,
# llama-simple, rpc-server), built once for this CPU from the llama.cpp sources vendored in
# the llama-cpp-python 0.3.36 sdist (the same pinned llama.cpp the Python binding above
# compiles), with GGML_NATIVE=ON and GGML_RPC=ON, into $CANDLE_TP_HOME/llama-cpp-0.3.36.
#
#   bin=$(install_llama_cpp_tools)   # the bin dir (about 20-30 minutes the first time)
#
# Built in a temporary directory next to the cache and renamed into place at the end, so an
# interrupted build leaves nothing that a later call trusts. Installs cmake with apt-get when
# it is missing. LLAMA_CPP_JOBS (default 2) sets the build's parallelism; the compiler runs
# under `nice -n 10`.
llama_cpp_tools_version=0.3.36
# CMake targets; ggml-rpc-server is installed as bin/rpc-server too (its name before 2025).
llama_cpp_tools=(llama-bench llama-server llama-quantize llama-cli llama-simple ggml-rpc-server)

# The llama-cpp-python sdist (PyPI), downloaded once into $CANDLE_TP_HOME/downloads; prints
# its path. Its vendor/llama.cpp holds the pinned llama.cpp sources.
llama_cpp_sdist() {
  local sdist tmp
  sdist="$(llama_cpp_home)/downloads/llama_cpp_python-$llama_cpp_tools_version.tar.gz"
  if [ ! -f "$sdist" ]; then
    tmp=$(mktemp -d)
    # --no-binary for this package only: with `:all:` pip would also compile the build
    # dependencies it installs to read the sdist's metadata (cmake itself, 10+ minutes).
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
      "llama-cpp-python==$llama_cpp_tools_version" -d "$tmp" >&2 || { rm -rf "$tmp"; return 1; }
    mkdir -p "$(dirname "$sdist")"
    mv "$tmp/$(basename "$sdist")" "$sdist.part" && mv "$sdist.part" "$sdist"
    rm -rf "$tmp"
  fi
  echo "$sdist"
}

install_llama_cpp_tools() {
  local home dest tmp src t ok=1
  home=$(llama_cpp_home)
  dest="$home/llama-cpp-$llama_cpp_tools_version"
  for t in "${llama_cpp_tools[@]}" rpc-server; do [ -x "$dest/bin/$t" ] || ok=0; done
  if [ "$ok" = 1 ] && [ -f "$dest/.complete" ]; then
    echo "$dest/bin"; return
  fi
  if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
    echo "==> installing cmake and build-essential (apt-get)" >&2
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq cmake build-essential >&2
  fi
  echo "==> building llama.cpp's tools ($llama_cpp_tools_version) into $dest (20-30 minutes on 2 cores)" >&2
  mkdir -p "$home"
  tmp=$(mktemp -d "$home/.llama-cpp-build.XXXXXX")
  local sdist
  # The build directory is removed however the function ends (the subshell's trap); on
  # success the finished tree has been moved out of it first.
  (
    set -euo pipefail
    trap 'rm -rf "$tmp"' EXIT
    sdist=$(llama_cpp_sdist)
    tar -xzf "$sdist" -C "$tmp"
    src=$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
    [ -f "$src/CMakeLists.txt" ] || { echo "no vendor/llama.cpp in the sdist" >&2; exit 1; }
    nice -n 10 cmake -S "$src" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release \
      -DGGML_NATIVE=ON -DGGML_RPC=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >&2
    nice -n 10 cmake --build "$tmp/build" --config Release -j "${LLAMA_CPP_JOBS:-2}" \
      --target "${llama_cpp_tools[@]}" >&2
    mkdir -p "$tmp/out/bin"
    for t in "${llama_cpp_tools[@]}"; do cp "$tmp/build/bin/$t" "$tmp/out/bin/"; done
    cp "$tmp/build/bin/ggml-rpc-server" "$tmp/out/bin/rpc-server"
    # The vendored converter and its gguf-py, for whoever wants an f16 GGUF from a
    # Hugging Face checkpoint (scripts/make-gguf-models.sh uses the project's own converter).
    cp "$src/convert_hf_to_gguf.py" "$tmp/out/"
    cp -r "$src/gguf-py" "$tmp/out/"
    "$tmp/out/bin/llama-bench" --help >/dev/null
    touch "$tmp/out/.complete"
    rm -rf "$dest"
    mv "$tmp/out" "$dest"
  )
  echo "$dest/bin"
}
