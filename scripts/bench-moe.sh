#!/usr/bin/env bash
# Expert parallelism against tensor parallelism on a mixture-of-experts model (issue 45):
# decode tokens/s at world 1, and at world 2 with every expert split across the ranks (TP) and
# with whole experts per rank (`--ep`), in one run, the three alternating over rounds; then the
# medians, the ratios, each layout's memory per rank once loaded, and the collectives and bytes
# per decoded token each layout moved.
#
# usage: scripts/bench-moe.sh [--family mixtral|qwen3-moe] [--gguf TYPE] [--rounds N]
#                             [--new-tokens N] [--experts N] [--top-k N] [--hidden N]
#                             [--intermediate N] [--layers N]
#   --family mixtral    (default) a synthetic Mixtral, f32 safetensors (8 experts, top-2,
#                       hidden 1024, expert width 1024, 4 layers)
#   --family qwen3-moe  a synthetic Qwen3-MoE in Qwen3-30B-A3B's proportions at ~1.8 B
#                       parameters (hidden 1024, 16 heads of 128, 4 KV heads, 64 experts of
#                       width 512, top-8, 16 layers, SmolLM2's vocabulary)
#   --gguf TYPE         the model as a GGUF of that type (Q8_0, Q4_K, ...; SmolLM2's tokenizer,
#                       scripts/fetch-models.sh), written from the checkpoint by
#                       make_synthetic_llama (convert::hf_to_gguf); llama.cpp's mixtures
#                       (Q4_K_M, Q5_K_M, ...) are made from its F16 file by llama-quantize
#   --llama-cpp         with --gguf: llama.cpp's llama-bench -t 1 and -t 2 on the same file in
#                       every round (tg N), and the first-token logits and greedy ids against
#                       llama.cpp's server (scripts/check-llama-cpp-logits.sh; llama.cpp built
#                       once by scripts/lib/llama-cpp.sh)
# The model is written once under $CANDLE_TP_HOME/models (default ~/.cache/candle-tp).
# Serving: scripts/bench-serve.sh --ep-vs-tp; emulated hosts: scripts/bench-hosts.sh --ep.
set -euo pipefail
cd "$(dirname "$0")/.."

family=mixtral gguf="" llama_cpp=0 rounds=3 new_tokens=32 experts="" top_k="" hidden="" intermediate="" layers=""
while [ $# -gt 0 ]; do
  case "$1" in
    --family) family="$2"; shift 2 ;;
    --gguf) gguf="$2"; shift 2 ;;
    --llama-cpp) llama_cpp=1; shift ;;
    --rounds) rounds="$2"; shift 2 ;;
    --new-tokens) new_tokens="$2"; shift 2 ;;
    --experts) experts="$2"; shift 2 ;;
    --top-k) top_k="$2"; shift 2 ;;
    --hidden) hidden="$2"; shift 2 ;;
    --intermediate) intermediate="$2"; shift 2 ;;
    --layers) layers="$2"; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$family" in
  mixtral)
    experts=${experts:-8} top_k=${top_k:-2} hidden=${hidden:-1024}
    intermediate=${intermediate:-1024} layers=${layers:-4}
    shape=(--family mixtral --heads 16 --kv-heads 8 --intermediate "$intermediate") ;;
  qwen3-moe)
    experts=${experts:-64} top_k=${top_k:-8} hidden=${hidden:-1024}
    intermediate=${intermediate:-512} layers=${layers:-16}
    shape=(--family qwen3-moe --heads 16 --kv-heads 4 --head-dim 128
      --moe-intermediate "$intermediate") ;;
  *) echo "--family $family: expected mixtral or qwen3-moe" >&2; exit 2 ;;
esac

home="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}"
target_dir="${CARGO_TARGET_DIR:-target}"
echo "==> building (release)" >&2
cargo build --release --quiet --bin tprun --example bench_generate --example make_synthetic_llama
bin="$target_dir/release"
name="$family-syn-h${hidden}-i${intermediate}-e${experts}-k${top_k}-l${layers}"
# The same shape always gets the same weights (--seed 7).
make=("$bin/examples/make_synthetic_llama" "${shape[@]}" --hidden "$hidden" --layers "$layers"
  --experts "$experts" --experts-per-tok "$top_k" --seed 7)
if [ -n "$gguf" ]; then
  tok="$home/models/smollm2-135m-instruct.Q4_1.gguf"
  [ -f "$tok" ] || { echo "$tok is missing: run scripts/fetch-models.sh" >&2; exit 1; }
  # -v2: written since the router (ffn_gate_inp) stays f32 as llama.cpp's quantizer keeps it;
  # an older file's quantized router routed differently in llama.cpp (2026-11-28).
  model="$home/models/$name-v2.$gguf.gguf"
  if [ ! -f "$model" ]; then
    case "$gguf" in
      *_[SML]|*_XS|*_XXS)
        # A llama.cpp mixture: llama-quantize picks each tensor's type from the F16 file.
        # shellcheck disable=SC1091
        qbin=$(. scripts/lib/llama-cpp.sh && install_llama_cpp_tools)
        f16="$home/models/$name-v2.F16.gguf"
        if [ ! -f "$f16" ]; then
          echo "==> writing $f16" >&2
          "${make[@]}" --gguf-out "$f16" --gguf-type F16 --tokenizer-gguf "$tok" >&2
        fi
        echo "==> llama-quantize $f16 -> $model ($gguf)" >&2
        "$qbin/llama-quantize" "$f16" "$model.partial" "$gguf" >/dev/null 2>&1
        mv "$model.partial" "$model" ;;
      *)
        echo "==> writing $model" >&2
        "${make[@]}" --gguf-out "$model" --gguf-type "$gguf" --tokenizer-gguf "$tok" >&2 ;;
    esac
  fi
else
  model="$home/models/$name"
  if [ ! -f "$model/config.json" ]; then
    echo "==> writing $model" >&2
    "${make[@]}" --out "$model" --vocab 32000 >&2
  fi
fi
if [ "$llama_cpp" = 1 ]; then
  [ -n "$gguf" ] || { echo "--llama-cpp needs --gguf TYPE" >&2; exit 2; }
  # shellcheck disable=SC1091
  lbin=$(. scripts/lib/llama-cpp.sh && install_llama_cpp_tools)
fi
out="$target_dir/bench-moe.jsonl"
: > "$out"
llama() { # LABEL THREADS: llama-bench's decode of the same number of tokens
  "$lbin/llama-bench" -m "$model" -t "$2" -p 0 -n "$new_tokens" -r 1 -o jsonl 2>/dev/null |
    python3 -c '
import json, sys
r = json.loads(sys.stdin.readline())
print(json.dumps({"label": sys.argv[1], "tokens_per_s": r["avg_ts"], "model": sys.argv[2]}))' \
    "$1" "$(basename "$model")" >> "$out"
}
run() { # LABEL WORLD [FLAGS...]
  local label=$1 world=$2; shift 2
  "$bin/tprun" --standalone --nproc-per-node "$world" "$bin/examples/bench_generate" \
    --model "$model" --new-tokens "$new_tokens" --prompt-len 32 "$@" 2>/dev/null |
    sed 's/^\[rank 0\] //' | grep '^{' | tail -1 | python3 -c '
import json, sys
r = json.loads(sys.stdin.read()); r["label"] = sys.argv[1]; print(json.dumps(r))' "$label" >> "$out"
}
for r in $(seq 1 "$rounds"); do
  echo "==> round $r of $rounds" >&2
  # Alternate the order so that neither layout always runs first.
  if [ $((r % 2)) = 1 ]; then
    run world1 1; run tp2 2; run ep2 2 --ep
    [ "$llama_cpp" = 0 ] || { llama llama_t1 1; llama llama_t2 2; }
  else
    [ "$llama_cpp" = 0 ] || { llama llama_t2 2; llama llama_t1 1; }
    run ep2 2 --ep; run tp2 2; run world1 1
  fi
done
text_line=""
if [ "$llama_cpp" = 1 ]; then
  # First-token logits and greedy ids against llama.cpp's server (K/V in f32, as candle-tp
  # keeps them), world 1 and the EP layouts; the script's header says what is gated.
  text_line=$(scripts/check-llama-cpp-logits.sh --model "$model" --tokens 16 2>&1 | grep -v '^  ' || true)
fi
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
python3 - "$out" "$cpu" "$(nproc)" "$text_line" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault(r["label"], []).append(r)
med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in by.items()}
ids = {k: {tuple(x["token_ids"]) for x in v} for k, v in by.items() if not k.startswith("llama")}
print(f"CPU: {sys.argv[2]} ({sys.argv[3]} cores); model {rows[0]['model']}; "
      f"{len(by.get('tp2', []))} rounds")
print("| layout | decode tok/s (median) | vs world 1 | memory per rank (max) | vs world 1 | collectives/token | bytes/token (rank 0) |")
print("|---|---|---|---|---|---|---|")
mem = {k: max(v[-1].get("rss_bytes") or [0]) for k, v in by.items()}
for k, name in [("world1", "world 1"), ("tp2", "2 ranks, experts split (TP)"),
                ("ep2", "2 ranks, whole experts (EP)"), ("llama_t1", "llama-bench -t 1"),
                ("llama_t2", "llama-bench -t 2")]:
    if k not in by:
        continue
    c = by[k][-1].get("comm") or {}
    if k.startswith("llama"):
        print(f"| {name} | {med[k]:.1f} | {med[k] / med['world1']:.2f}x | | | | |")
        continue
    print(f"| {name} | {med[k]:.1f} | {med[k] / med['world1']:.2f}x | "
          f"{mem[k] / 2**20:.0f} MiB | {mem[k] / max(mem['world1'], 1):.2f}x | "
          f"{c.get('collectives_per_token', 0):.0f} | {c.get('bytes_per_token', 0):.0f} |")
print(f"EP / TP at 2 ranks: {med['ep2'] / med['tp2']:.2f}x")
if "llama_t2" in med:
    print(f"EP at 2 ranks / llama-bench -t 2: {med['ep2'] / med['llama_t2']:.2f}x; "
          f"world 1 (2 threads) / llama-bench -t 2: {med['world1'] / med['llama_t2']:.2f}x")
same = ids["world1"] == ids["tp2"] == ids["ep2"] and len(ids["world1"]) == 1
print(f"greedy ids equal across layouts and rounds: {same}")
if sys.argv[4]:
    print(sys.argv[4])
PY
