# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/lib/start-server.sh: the cargo features the test
# scripts build with, so that they share one build (the same features, hence the same compiled
# candle-core) in one target directory.
#
#   test_features    # prints $CANDLE_TP_FEATURES if set, else "server,mpi" where Open MPI and
#                    # libclang are installed (what scripts/setup-mpi.sh checks), else "server"
test_features() {
  if [ -n "${CANDLE_TP_FEATURES:-}" ]; then
    echo "$CANDLE_TP_FEATURES"
  elif command -v mpirun >/dev/null && command -v mpicc >/dev/null \
    && ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1; then
    echo server,mpi
  else
    echo server
  fi
}
