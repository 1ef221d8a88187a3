#!/usr/bin/env bash
# GPU smoke test: NCCL collectives, TP layers on CUDA against the CPU, the examples on GPUs,
# every multi-rank test the GPU count allows. Results as JSON.
#
# Two steps, because the GPU machine has CUDA 13 (driver 580, the CUDA libraries in Python
# packages such as nvidia-cublas, nvidia-nccl-cu13) but no Rust toolchain:
#
#   scripts/gpu-smoke.sh build        # here (no GPU needed): release binaries with cuda,nccl
#                                     # (CUDA_COMPUTE_CAP=90: H100/H200), via check-gpu-build.sh
#   scripts/gpu-smoke.sh [run] [OUT]  # on the GPU machine, from the repository root with the
#                                     # target dir carried over; writes OUT (gpu-smoke.json)
#
# What `build` makes ($CARGO_TARGET_DIR or target, release profile): tprun, examples/* and the
# GPU test binary copied to release/gpu-tests. `run` needs only those files (and the demo
# models under $CANDLE_TP_HOME for the model steps, skipped when absent).
#
# Steps of `run` (each is pass / fail / skip with a reason and its time in the JSON):
#   nccl_one_rank      1-rank NCCL communicator: every collective, f32/f16/bf16, host slices
#   layers_match_cpu   TP layers + mappings on CUDA (fwd+bwd) vs the CPU, plain and NCCL group
#   mlp_1              examples/mlp --device cuda vs the dense CPU MLP (errors <= 1e-4)
#   mlp_N              the same under tprun with N = 2..min(GPUs, 4) ranks, one GPU each
#   nccl_multi_rank    the multi-rank collective/layer tests of tests/gpu.rs under tprun
#   embed_cuda_vs_cpu  examples/embed on MiniLM: CUDA embeddings vs CPU (max |diff| <= 1e-3)
#   generate_N         examples/generate --device cuda (if built), tokens/s, 1 and N ranks
#   generate_ids_cuda_vs_cpu  greedy ids: CUDA f32 equal to the CPU's; CUDA bf16 reported (on
#                      trained weights: a random model's near-tied logits may part; for one,
#                      make_synthetic_llama --seed N gives the same model every call)
#   quantized_layers_match_cpu  GGUF block types on CUDA (candle's QMatMul) vs the exact product
#   nccl_zero_elements zero-element tensors and empty slices through a 1-rank NCCL group
#   parallel_2d_matches_cpu  2D SUMMA layers on CUDA tensors (2 x 2 threads) vs the CPU grid
#   cuda_libraries     the shared libraries the binaries load (ldd), for the docs
#   gguf_ids_cuda_vs_cpu  GGUF_MODEL=F.gguf: greedy ids on CUDA against the CPU's (first equal)
#   decode_<model>_<dtype>  GPU_BENCH_MODELS="DIR F.gguf" (and GPU_BENCH_RANDOM_MODELS):
#                      bench_generate on CUDA against candle-transformers' llama (f32, bf16) or
#                      quantized_llama (.gguf); same ids needed in f32 and .gguf on trained weights
# NCCL refuses two ranks on one GPU: with one GPU the multi-rank steps are skipped, not faked.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}"
rel="$target/release"
mode="${1:-run}"

if [ "$mode" = build ]; then
  env_file=$(scripts/check-gpu-build.sh --env-only | tail -n 1)
  # shellcheck disable=SC1090
  . "$env_file"
  export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
  cargo build --release --features cuda,nccl --bin tprun --examples
  exe=$(cargo test --release --features cuda,nccl --test gpu --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])')
  cp "$exe" "$rel/gpu-tests"
  du -sh "$rel/tprun" "$rel/gpu-tests" "$rel/examples/mlp" | sed 's/^/   /'
  echo "==> built for compute capability $CUDA_COMPUTE_CAP; carry $rel to the GPU machine and run scripts/gpu-smoke.sh"
  exit 0
fi
[ "$mode" = run ] && shift || true
out_json="${1:-gpu-smoke.json}"

# --- CUDA libraries from the Python packages (nvidia-cublas, nvidia-nccl-cu13, ...) ----------------
libs=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site, sys
roots = set(site.getsitepackages() + [site.getusersitepackages()] + sys.path)
dirs = []
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        if d not in dirs:
            dirs.append(d)
print(":".join(dirs))
PY
)
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || true)
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)
echo "==> $gpus GPU(s): ${gpu_name:-none} (driver ${driver:-?})"
for f in "$rel/tprun" "$rel/gpu-tests" "$rel/examples/mlp"; do
  [ -x "$f" ] || { echo "missing $f: run 'scripts/gpu-smoke.sh build' on a machine with Rust and carry $rel here" >&2; exit 2; }
done

results=$(mktemp)
log_dir=$(mktemp -d)
fails=0
# record NAME STATUS SECONDS DETAIL [EXTRA_JSON]
record() {
  python3 - "$@" >>"$results" <<'PY'
import json, sys
name, status, secs, detail = sys.argv[1:5]
extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] else {}
print(json.dumps({"step": name, "status": status, "seconds": round(float(secs), 2), "detail": detail[-2000:], **extra}))
PY
  printf '   %s: %s (%.1f s) %s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | tr '\n' ' ' | tail -c 160)"
  [ "$2" = fail ] && fails=$((fails + 1))
  return 0
}
skip() { record "$1" skip 0 "$2"; }
# run_step NAME CMD...: pass when the command exits 0; the output tail is the detail.
run_step() {
  local name=$1; shift
  local t0 t1 rc=0
  t0=$(date +%s.%N)
  "$@" >"$log_dir/$name.log" 2>&1 || rc=$?
  t1=$(date +%s.%N)
  local secs; secs=$(python3 -c "print($t1 - $t0)")
  if [ $rc -eq 0 ] && grep -q '^skipped:' "$log_dir/$name.log"; then
    record "$name" skip "$secs" "$(grep -m 1 '^skipped:' "$log_dir/$name.log")"
  elif [ $rc -eq 0 ]; then record "$name" pass "$secs" "$(tail -c 600 "$log_dir/$name.log")"
  else record "$name" fail "$secs" "exit $rc: $(tail -c 1500 "$log_dir/$name.log")"; fi
  return 0
}

echo "==> steps"
libs_of() { # the CUDA and NCCL libraries a binary loads, as the dynamic linker resolves them
  ldd "$rel/examples/mlp" | grep -E 'cuda|nccl|cublas|curand|nvrtc|not found' || true
  ! ldd "$rel/examples/mlp" | grep -q 'not found'
}
if [ "$gpus" -lt 1 ]; then
  skip all "no GPU visible (nvidia-smi -L)"
else
  run_step cuda_libraries libs_of
  run_step nccl_one_rank "$rel/gpu-tests" --exact nccl_one_rank --nocapture
  run_step layers_match_cpu "$rel/gpu-tests" --exact layers_match_cpu --nocapture
  run_step quantized_layers_match_cpu "$rel/gpu-tests" --exact quantized_layers_match_cpu --nocapture
  run_step nccl_zero_elements "$rel/gpu-tests" --exact nccl_zero_elements --nocapture
  run_step parallel_2d_matches_cpu "$rel/gpu-tests" --exact parallel_2d_matches_cpu --nocapture

  check_mlp() { # N: run the mlp example on N ranks and check its JSON line
    local n=$1 out
    # (errexit is off inside run_step's `||`: every command checks its own status)
    if [ "$n" -eq 1 ]; then out=$("$rel/examples/mlp" --device cuda) || return 1
    else out=$("$rel/tprun" --standalone --nproc-per-node "$n" "$rel/examples/mlp" --device cuda) || return 1; fi
    echo "$out"
    printf '%s\n' "$out" | sed -n 's/^\(\[rank 0\] \)\{0,1\}\({.*}\)$/\2/p' | tail -n 1 | python3 -c '
import json, sys
v = json.loads(sys.stdin.read())
keys = ["max_abs_err_out", "max_abs_err_grad_input", "max_abs_err_grad_weight", "max_abs_err_grad_bias"]
bad = [k for k in keys if not v[k] <= 1e-4]
print({k: v[k] for k in keys})
sys.exit(1 if bad else 0)'
  }
  run_step mlp_1 check_mlp 1
  max_n=$(( gpus < 4 ? gpus : 4 ))
  if [ "$gpus" -lt 2 ]; then
    skip mlp_multi "1 GPU: NCCL refuses two ranks on one GPU"
    skip nccl_multi_rank "1 GPU: NCCL refuses two ranks on one GPU"
  else
    for n in $(seq 2 "$max_n"); do run_step "mlp_$n" check_mlp "$n"; done
    run_step nccl_multi_rank "$rel/gpu-tests" --exact nccl_multi_rank --nocapture
  fi

  home="${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}"
  minilm="$home/models/all-minilm-l6-v2"
  if [ -x "$rel/examples/embed" ] && [ -f "$minilm/model.safetensors" ]; then
    embed_cmp() {
      local texts=(--text "Tensor parallelism splits layers across GPUs." --text "The cat sat on the mat.")
      "$rel/examples/embed" --model "$minilm" "${texts[@]}" --device cpu >"$log_dir/embed_cpu.jsonl" || return 1
      "$rel/examples/embed" --model "$minilm" "${texts[@]}" --device cuda >"$log_dir/embed_cuda.jsonl" || return 1
      python3 - "$log_dir/embed_cpu.jsonl" "$log_dir/embed_cuda.jsonl" <<'PY'
import json, sys
a = [json.loads(l)["embedding"] for l in open(sys.argv[1])]
b = [json.loads(l)["embedding"] for l in open(sys.argv[2])]
assert len(a) == len(b) == 2, (len(a), len(b))
d = max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))
print(f"max |cuda - cpu| = {d:.2e}")
sys.exit(0 if d <= 1e-3 else 1)
PY
    }
    run_step embed_cuda_vs_cpu embed_cmp
  else
    skip embed_cuda_vs_cpu "examples/embed or $minilm/model.safetensors missing (scripts/fetch-models.sh)"
  fi

  if [ -x "$rel/examples/generate" ]; then
    # GENERATE_MODEL_ARGS: the model and its flags (default: the example's own, SmolLM2 from
    # the models directory); GENERATE_ARGS overrides the whole CUDA command line.
    read -r -a model_args <<<"${GENERATE_MODEL_ARGS:-}"
    read -r -a gen_args <<<"${GENERATE_ARGS:-${model_args[*]} --device cuda}"
    gen() {
      local n=$1
      if [ "$n" -eq 1 ]; then "$rel/examples/generate" "${gen_args[@]}"
      else "$rel/tprun" --standalone --nproc-per-node "$n" "$rel/examples/generate" "${gen_args[@]}"; fi
    }
    for n in 1 $( [ "$gpus" -ge 2 ] && echo "$max_n" ); do
      t0=$(date +%s.%N); rc=0
      gen "$n" >"$log_dir/generate_$n.log" 2>&1 || rc=$?
      secs=$(python3 -c "print($(date +%s.%N) - $t0)")
      # The example's JSON line: "tokens_per_s":N.
      tps=$(grep -oE '"tokens_per_s": ?[0-9.eE+-]+' "$log_dir/generate_$n.log" | tail -n 1 | grep -oE '[0-9.eE+-]+$' || true)
      if [ $rc -eq 0 ] && [ -n "$tps" ]; then
        record "generate_$n" pass "$secs" "$(tail -c 400 "$log_dir/generate_$n.log")" "{\"ranks\": $n, \"tokens_per_s\": $tps}"
      else
        record "generate_$n" fail "$secs" "exit $rc, tokens/s ${tps:-not found}: $(tail -c 1200 "$log_dir/generate_$n.log")"
      fi
    done
    # Greedy ids: CUDA f32 must equal the CPU's; CUDA bf16 is reported against them (the share
    # of ids equal before the first difference), not required to match.
    ids_cmp() {
      local d t
      for d in cpu cuda; do for t in f32 bf16; do
        [ "$d$t" = cpubf16 ] && continue
        "$rel/examples/generate" "${model_args[@]}" --device "$d" --dtype "$t" --max-new-tokens 32 \
          >"$log_dir/ids_${d}_$t.log" 2>&1 || return 1
      done; done
      python3 - "$log_dir" <<'PY'
import json, sys
ids = {}
for k in ("cpu_f32", "cuda_f32", "cuda_bf16"):
    line = [l for l in open(f"{sys.argv[1]}/ids_{k}.log") if l.startswith("{")][-1]
    ids[k] = json.loads(line)["token_ids"]
def first_equal(k):
    return next((i for i, (a, b) in enumerate(zip(ids["cpu_f32"], ids[k])) if a != b), len(ids["cpu_f32"]))
print(f"cpu f32 {ids['cpu_f32']}")
if ids["cuda_f32"] != ids["cpu_f32"]:
    # Where they part says whether it is a near-tie late in the run or a wrong first token.
    print(f"cuda f32 {ids['cuda_f32']}")
print(f"cuda f32 equal: {ids['cuda_f32'] == ids['cpu_f32']} (the first {first_equal('cuda_f32')}); "
      f"cuda bf16 equal for the first {first_equal('cuda_bf16')} of {len(ids['cpu_f32'])}")
sys.exit(0 if ids["cuda_f32"] == ids["cpu_f32"] else 1)
PY
    }
    run_step generate_ids_cuda_vs_cpu ids_cmp
  else
    skip generate "$rel/examples/generate is not built (the generate example lives on another branch)"
  fi

  # A GGUF file (GGUF_MODEL) through candle's CUDA quantized matmul: greedy ids against the
  # CPU's (the crate's exact kernels). CUDA's q8_1 activations move each product by up to ~1 %
  # (tests/gpu.rs quantized_layers_match_cpu), which compounds over generated tokens, so the
  # ids may part after a few: the first id (one forward over the prompt) must be the CPU's,
  # the rest is reported. Equality with candle-transformers' quantized Llama on the same
  # kernels is the decode step's check (GPU_BENCH_MODELS).
  if [ -n "${GGUF_MODEL:-}" ] && [ -f "$GGUF_MODEL" ] && [ -x "$rel/examples/generate" ]; then
    gguf_cmp() {
      local d
      for d in cpu cuda; do
        "$rel/examples/generate" --model "$GGUF_MODEL" --device "$d" --max-new-tokens 32 \
          >"$log_dir/gguf_$d.log" 2>&1 || { tail -n 20 "$log_dir/gguf_$d.log"; return 1; }
      done
      python3 - "$log_dir" <<'PY'
import json, sys
ids = {d: json.loads([l for l in open(f"{sys.argv[1]}/gguf_{d}.log") if l.startswith("{")][-1])
       for d in ("cpu", "cuda")}
a, b = ids["cpu"]["token_ids"], ids["cuda"]["token_ids"]
same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
print(f"cpu  {a}\ncuda {b}\nequal for the first {same} of {len(a)}; "
      f"cuda {ids['cuda'].get('tokens_per_s')} tok/s")
sys.exit(0 if same >= 1 else 1)
PY
    }
    run_step gguf_ids_cuda_vs_cpu gguf_cmp
  else
    skip gguf_ids_cuda_vs_cpu "GGUF_MODEL is not set to a .gguf file"
  fi

  # Decode tokens/s against candle-transformers on the same card (GPU_BENCH_MODELS: checkpoint
  # directories, each in f32 and bf16 against candle-transformers' llama, and .gguf files
  # against its quantized_llama). One step per model and dtype. Trained weights need the same
  # greedy ids as the reference in f32 and from a .gguf (same CUDA kernels on both sides);
  # random weights (GPU_BENCH_RANDOM_MODELS, e.g. examples/make_synthetic_llama's) give
  # near-equal logits that rounding reorders, so their ids are reported only.
  read -r -a bench_models <<<"${GPU_BENCH_MODELS:-} ${GPU_BENCH_RANDOM_MODELS:-}"
  if [ -x "$rel/examples/bench_generate" ] && [ ${#bench_models[@]} -gt 0 ]; then
    for m in "${bench_models[@]}"; do
      need_ids=0
      case " ${GPU_BENCH_MODELS:-} " in *" $m "*) need_ids=1 ;; esac
      if [ "${m%.gguf}" != "$m" ]; then pairs="gguf:quantized_llama"; else pairs="f32:candle-transformers bf16:candle-transformers"; fi
      for pair in $pairs; do
        dt=${pair%%:*}; ref=${pair#*:}
        name="decode_$(basename "${m%.gguf}" | tr -c 'A-Za-z0-9_\n' _)_$dt"
        dargs=(--model "$m" --device cuda --prompt-len 32 --new-tokens 64)
        [ "$dt" = gguf ] || dargs+=(--dtype "$dt")
        t0=$(date +%s.%N); rc=0
        { "$rel/examples/bench_generate" --impl candle-tp "${dargs[@]}" &&
          "$rel/examples/bench_generate" --impl "$ref" "${dargs[@]}"; } >"$log_dir/$name.log" 2>&1 || rc=$?
        secs=$(python3 -c "print($(date +%s.%N) - $t0)")
        extra=$(python3 - "$log_dir/$name.log" "$dt" <<'PY' || true
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
if len(runs) != 2:
    sys.exit(1)
ours, ref = runs
same = next((i for i, (x, y) in enumerate(zip(ours["token_ids"], ref["token_ids"])) if x != y),
            len(ours["token_ids"]))
print(json.dumps({"candle_tp_tokens_per_s": ours["tokens_per_s"],
                  "reference": ref["impl"], "reference_tokens_per_s": ref["tokens_per_s"],
                  "ratio": round(ours["tokens_per_s"] / ref["tokens_per_s"], 3),
                  "same_ids": same, "of": len(ours["token_ids"]),
                  "prefill_ms": ours.get("prefill_ms"), "reference_prefill_ms": ref.get("prefill_ms")}))
PY
)
        if [ $rc -eq 0 ] && [ -n "$extra" ] &&
           { [ $need_ids = 0 ] || [ "$dt" = bf16 ] || python3 -c 'import json,sys; v=json.loads(sys.argv[1]); sys.exit(v["same_ids"]!=v["of"])' "$extra"; }; then
          record "$name" pass "$secs" "$extra" "$extra"
        else
          record "$name" fail "$secs" "exit $rc ${extra:-no JSON}: $(tail -c 1200 "$log_dir/$name.log")"
        fi
      done
    done
  else
    skip decode_vs_candle_transformers "GPU_BENCH_MODELS is not set (or examples/bench_generate is not built)"
  fi
fi

python3 - "$results" "$out_json" "$gpus" "$gpu_name" "$driver" <<'PY'
import json, sys, platform, datetime
steps = [json.loads(l) for l in open(sys.argv[1])]
doc = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "host": platform.node(),
    "gpus": int(sys.argv[3] or 0),
    "gpu": sys.argv[4],
    "driver": sys.argv[5],
    "passed": sum(s["status"] == "pass" for s in steps),
    "failed": sum(s["status"] == "fail" for s in steps),
    "skipped": sum(s["status"] == "skip" for s in steps),
    "steps": steps,
}
json.dump(doc, open(sys.argv[2], "w"), indent=2)
print(f"==> {doc['passed']} passed, {doc['failed']} failed, {doc['skipped']} skipped: {sys.argv[2]}")
PY
rm -rf "$results"
[ "$fails" -eq 0 ]
