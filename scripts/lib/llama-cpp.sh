# shellcheck shell=bash
# Sourced by scripts/bench-generate.sh and scripts/bench-serve.sh: llama.cpp through
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

stop_llama_cpp_server() {
  stop_job "${llama_pid:-}" "${llama_log:-}" # scripts/lib/start-server.sh
  llama_pid="" llama_log=""
}
