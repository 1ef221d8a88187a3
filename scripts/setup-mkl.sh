# shellcheck shell=bash
# Intel oneMKL from PyPI for Candle's `mkl` feature (candle-tp's `--features mkl`).
#
#   . scripts/setup-mkl.sh              # fetch once (~300 MB), then export MKLROOT
#   scripts/setup-mkl.sh                # the same, and print the export line
#   cargo build --release --features mkl
#
# Candle's `mkl` feature pulls intel-mkl-src, whose build script downloads MKL from a
# container registry that is not reachable here; it also looks at $MKLROOT first, so we give
# it MKL from PyPI: mkl-static, mkl-include and intel-openmp, pinned and checksummed.
# Only the static libraries are unpacked (libiomp5.so is left out on purpose), so OpenMP and
# MKL link statically: binaries need no MKL files and no LD_LIBRARY_PATH at run time.
# Idempotent; cached under $CANDLE_TP_HOME (default ~/.cache/candle-tp).
# Threads at run time: MKL_NUM_THREADS (tprun sets it per rank, like RAYON_NUM_THREADS).

_ctp_mkl_version="2026.2.0"
_ctp_mkl_home="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}/mkl-$_ctp_mkl_version"

_ctp_mkl_fetch() {
  local tmp
  tmp="$(mktemp -d)" || return 1
  echo "setup-mkl: downloading MKL $_ctp_mkl_version wheels from PyPI" >&2
  python3 -m pip download --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --python-version 3.11 -d "$tmp" \
    "mkl-static==$_ctp_mkl_version" "mkl-include==$_ctp_mkl_version" "intel-openmp==$_ctp_mkl_version" >&2 \
    || { rm -rf "$tmp"; return 1; }
  (cd "$tmp" && sha256sum -c --quiet >&2 <<'SUMS'
090e439bf202b45579c75d2ba50ff7ead05752d553a06aba79c3ed2b5247921b  mkl_static-2026.2.0-py2.py3-none-manylinux_2_28_x86_64.whl
889cc72057a1671fee1e9a8beb2fc4e0d222ba78c08b6d69584dae03fbec4822  mkl_include-2026.2.0-py2.py3-none-manylinux_2_28_x86_64.whl
2308a1a3e74718a9cd8cccf218c34d8cd80b43d3b89dfbb01b38dee205c50980  intel_openmp-2026.2.0-py2.py3-none-manylinux_2_28_x86_64.whl
SUMS
  ) || { echo "setup-mkl: checksum mismatch" >&2; rm -rf "$tmp"; return 1; }
  rm -rf "$_ctp_mkl_home.partial"
  mkdir -p "$_ctp_mkl_home.partial/lib" "$_ctp_mkl_home.partial/include"
  python3 - "$tmp" "$_ctp_mkl_home.partial" <<'PY' || { rm -rf "$tmp" "$_ctp_mkl_home.partial"; return 1; }
import glob, os, shutil, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
want = {"lib": {"libmkl_intel_lp64.a", "libmkl_intel_thread.a", "libmkl_core.a", "libiomp5.a"},
        "include": {"mkl.h", "mkl_version.h"}}
found = set()
for whl in glob.glob(os.path.join(tmp, "*.whl")):
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            parts = name.split("/")
            # wheel data files live in <dist>.data/data/{lib,include}/<file>
            if len(parts) == 4 and parts[0].endswith(".data") and parts[1] == "data" \
                    and parts[2] in want and parts[3] in want[parts[2]]:
                with z.open(name) as src, open(os.path.join(dest, parts[2], parts[3]), "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                found.add(parts[3])
missing = set().union(*want.values()) - found
if missing:
    sys.exit(f"setup-mkl: missing from the wheels: {sorted(missing)}")
PY
  rm -rf "$tmp"
  mv "$_ctp_mkl_home.partial" "$_ctp_mkl_home"
}

if [ ! -f "$_ctp_mkl_home/lib/libmkl_core.a" ] || [ ! -f "$_ctp_mkl_home/include/mkl.h" ]; then
  _ctp_mkl_fetch || { echo "setup-mkl: could not fetch MKL" >&2; return 1 2>/dev/null || exit 1; }
fi
export MKLROOT="$_ctp_mkl_home"
# On AMD CPUs oneMKL picks a generic code path unless told which instructions it may use
# (measured here on an AMD EPYC: sgemm 44 -> 64 GMAC/s). Harmless on Intel. Run-time setting.
export MKL_ENABLE_INSTRUCTIONS="${MKL_ENABLE_INSTRUCTIONS:-AVX512}"
echo "setup-mkl: MKLROOT=$MKLROOT MKL_ENABLE_INSTRUCTIONS=$MKL_ENABLE_INSTRUCTIONS" >&2
if grep -q -m1 AuthenticAMD /proc/cpuinfo 2>/dev/null; then
  # Measured on an AMD EPYC (Zen 4), docs/PERFORMANCE.md: sgemm no faster than gemm, and
  # matrix-vector products (decode) on MKL's generic kernel, about half gemm's speed.
  echo "setup-mkl: note: this is an AMD CPU; oneMKL runs its generic gemv kernel here, so decode" \
    "with --mkl is slower than the default build (docs/PERFORMANCE.md, 'Intel MKL')" >&2
fi
# Run as a script (not sourced): print the line to eval.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "export MKLROOT=$MKLROOT MKL_ENABLE_INSTRUCTIONS=$MKL_ENABLE_INSTRUCTIONS"
fi
