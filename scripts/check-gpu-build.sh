#!/usr/bin/env bash
# GPU build check without a GPU: builds the `cuda` + `nccl` features against the pip-installable
# CUDA 13 toolchain and generated link stubs, then runs the stub test (a `cuda` build starts with
# the stubs on LD_LIBRARY_PATH, and `--device cuda` fails with a clear driver error).
#
# usage: scripts/check-gpu-build.sh            # setup (idempotent) + build + stub test
#        scripts/check-gpu-build.sh --env-only # only install the toolchain / stubs, print env file
# Release binaries for a GPU machine: scripts/gpu-smoke.sh build (uses --env-only).
# Exit code 0 = the GPU build and its stub test pass.
#
# The toolchain is cached under $CANDLE_TP_HOME/cuda-13.0-pip (default ~/.cache/candle-tp):
# about 100 MB downloaded once from PyPI (nvcc, cicc/nvvm, crt + cudart + CCCL headers).
# Stubs: link-only libcuda/libnccl/libnvrtc/libcurand/libcublas(Lt) generated from cudarc's own
# sys bindings; every stub function returns an error code, so nothing can silently "work".
# Candle forces cudarc's dynamic-linking (load-time linking), hence the stubs.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

mode=build
for a in "$@"; do
  case "$a" in
    --env-only) mode=env ;;
    *) echo "check-gpu-build.sh: unknown argument '$a' (expected --env-only)" >&2; exit 2 ;;
  esac
done

home=${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}
PREFIX=${CUDA_PIP_PREFIX:-$home/cuda-13.0-pip}
CU="$PREFIX/nvidia/cu13" # the CUDA-13 wheels all unpack into nvidia/cu13/{bin,include,lib,nvvm}
t0=$(date +%s)

command -v g++ >/dev/null || { apt-get update -qq && apt-get install -y -qq g++; }
command -v python3 >/dev/null || { apt-get update -qq && apt-get install -y -qq python3 python3-pip; }

# --- 1. toolchain wheels (one pip call: `pip --target` skips a top-level dir that exists) -------
if [ ! -x "$CU/bin/nvcc" ]; then
  echo "==> installing the CUDA 13.0 toolchain wheels into $PREFIX"
  python3 -m pip install --disable-pip-version-check --no-deps --no-cache-dir --target "$PREFIX" \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
fi
ln -sf libcudart.so.13 "$CU/lib/libcudart.so" # candle-kernels links -lcudart (real lib)

# --- 2. link stubs, regenerated when the cudarc version changes ----------------------------------
cudarc_dir=$(cargo metadata --format-version 1 --features nccl | python3 -c '
import json, os, sys
m = json.load(sys.stdin)
p = [p for p in m["packages"] if p["name"] == "cudarc"]
if not p:
    sys.exit("cudarc is not in the dependency graph of the nccl feature")
print(os.path.dirname(p[0]["manifest_path"]))')
stamp="$CU/lib/stubs/.from"
if [ "$(cat "$stamp" 2>/dev/null)" != "$cudarc_dir" ]; then
  echo "==> generating link stubs from $cudarc_dir"
  mkdir -p "$CU/lib/stubs"
  python3 - "$cudarc_dir" "$CU/lib/stubs" <<'PY'
import os, re, subprocess, sys
src, out = sys.argv[1], sys.argv[2]
# lib -> (cudarc sys module, SONAME of the real library, error code every stub returns)
LIBS = {
    "cuda":     ("driver",   "libcuda.so.1",      34),  # CUDA_ERROR_STUB_LIBRARY
    "nccl":     ("nccl",     "libnccl.so.2",       1),  # ncclUnhandledCudaError
    "nvrtc":    ("nvrtc",    "libnvrtc.so.13",     7),  # NVRTC_ERROR_BUILTIN_OPERATION_FAILURE
    "curand":   ("curand",   "libcurand.so.10",  203),  # CURAND_STATUS_INITIALIZATION_FAILED
    "cublas":   ("cublas",   "libcublas.so.13",    1),  # CUBLAS_STATUS_NOT_INITIALIZED
    "cublasLt": ("cublaslt", "libcublasLt.so.13",  1),
}
FN = re.compile(r'extern "C" \{\s*fn (\w+)\((.*?)\)\s*(->\s*([^;{]+))?;', re.S)
for lib, (mod, soname, err) in LIBS.items():
    text = open(os.path.join(src, "src", mod, "sys", "mod.rs")).read()
    names, body = set(), ["/* link-time stub for %s generated from cudarc; not a working library */" % soname]
    for m in FN.finditer(text):
        name, ret = m.group(1), (m.group(4) or "").strip()
        if name in names:
            continue
        names.add(name)
        body.append(("void *%s(void) { return 0; }" if ret.startswith("*") else
                     "long %s(void) { return " + str(err) + "; }") % name)
    c = os.path.join(out, "lib%s_stub.c" % lib)
    so = os.path.join(out, "lib%s.so" % lib)
    open(c, "w").write("\n".join(body) + "\n")
    subprocess.check_call(["gcc", "-shared", "-fPIC", "-O0", "-w", "-Wl,-soname," + soname, "-o", so, c])
    os.remove(c)
    link = os.path.join(out, soname)
    if os.path.lexists(link):
        os.remove(link)
    os.symlink("lib%s.so" % lib, link)
    print("   stub %-18s %4d symbols" % (soname, len(names)))
PY
  echo "$cudarc_dir" >"$stamp"
fi

# --- 3. env file -----------------------------------------------------------------------------------
cat >"$PREFIX/env.sh" <<EOF
# source me before cargo build/check/test of the cuda/nccl features (written by check-gpu-build.sh)
export CUDA_HOME="$CU"
export PATH="$CU/bin:\$PATH"
export CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}
export CUDAFORGE_THREADS=\${CUDAFORGE_THREADS:-\$(nproc)}
export CUDA_RUN_LIBS="$CU/lib:$CU/lib/stubs"
EOF
echo "==> toolchain ready in $(( $(date +%s) - t0 )) s: $PREFIX/env.sh"
if [ "$mode" = env ]; then
  echo "$PREFIX/env.sh"
  exit 0
fi
# shellcheck disable=SC1091
. "$PREFIX/env.sh"

# --- 4. build everything with the nccl feature (links against the stubs) --------------------------
# A target dir of its own: the CPU build's binaries (used by other checks) must stay CPU builds.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/gpu"
t1=$(date +%s)
# With the mpi feature too where Open MPI can be installed: GPU jobs launched by mpirun/srun
# meet through a store found over MPI (src/comm/mpi/bootstrap.rs).
gpu_features=nccl
if "$(dirname "$0")/setup-mpi.sh" >&2; then gpu_features=nccl,mpi; else
  echo "==> no Open MPI (scripts/setup-mpi.sh needs root): building without the mpi feature" >&2
fi
echo "==> cargo build --all-targets --features $gpu_features"
cargo build --all-targets --features "$gpu_features"
echo "==> built in $(( $(date +%s) - t1 )) s"

# --- 5. the stub test: the binaries start, and asking for CUDA gives the driver error -------------
echo "==> stub test: a cuda build runs with the stubs and --device cuda fails clearly"
LD_LIBRARY_PATH="$CUDA_RUN_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  cargo test --features "$gpu_features" --test cuda_stub --test gpu -- --test-threads 1

echo "==> GPU build check passed in $(( $(date +%s) - t0 )) s"
