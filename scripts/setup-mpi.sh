#!/usr/bin/env bash
# Installs what the `mpi` feature and the mpirun tests need, from Debian's archive: Open MPI
# (openmpi-bin: mpirun; libopenmpi-dev: the library and mpicc, which rsmpi's build probes) and
# libclang-dev (rsmpi generates its bindings with bindgen), and iproute2 (the emulated hosts).
# Idempotent; needs root and apt-get.
#
#   scripts/setup-mpi.sh && cargo build --features mpi
set -euo pipefail
if command -v mpirun >/dev/null && command -v mpicc >/dev/null && command -v ip >/dev/null \
  && ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "setup-mpi.sh: installing needs root and apt-get; install Open MPI (mpirun, mpicc) and libclang yourself" >&2
  exit 1
fi
echo "==> installing Open MPI, libclang and iproute2 (Debian: openmpi-bin libopenmpi-dev libclang-dev iproute2)"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev libclang-dev iproute2 >/dev/null
