"""The table of `scripts/bench-generate.sh --gguf`: median decode tokens/s over the rounds,
ratios against the targets of issue 13, the world-2 decode profile, and a JSON summary."""
import json
import statistics
import sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]


def med(t, impl, world=None):
    v = [r["tokens_per_s"] for r in rows if r["type"] == t and r["impl"] == impl
         and (world is None or r["world_size"] == world)]
    return statistics.median(v) if v else None


f32 = med("F32", "candle-tp", 2)
summary = []
print("\n| type | candle-tp w1 | candle-tp w2 | quantized_llama | llama.cpp (2 thr) | f32 w2 | w1/qllama | w2/w1 | w2/f32 w2 | w2/llama.cpp | w2 matmul / collectives / rest ms per token |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for t in dict.fromkeys(r["type"] for r in rows if r["type"] != "F32"):
    w1, w2, ql, lc = med(t, "candle-tp", 1), med(t, "candle-tp", 2), med(t, "quantized_llama"), med(t, "llama.cpp")
    prof = [r["profile_ms_per_token"] for r in rows if r["type"] == t and "profile_ms_per_token" in r]
    p = {k: statistics.median(x[k] for x in prof) for k in ("matmul", "collectives", "rest", "total")} if prof else None
    ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"
    fmt = lambda v: f"{v:.1f}" if v else "-"
    ps = f"{p['matmul']:.2f} / {p['collectives']:.2f} / {p['rest']:.2f} (of {p['total']:.2f})" if p else "-"
    print(f"| {t} | {fmt(w1)} | {fmt(w2)} | {fmt(ql)} | {fmt(lc)} | {fmt(f32)} | {ratio(w1, ql)} | {ratio(w2, w1)} | {ratio(w2, f32)} | {ratio(w2, lc)} | {ps} |")
    summary.append({"type": t, "candle_tp_w1": w1, "candle_tp_w2": w2, "quantized_llama": ql,
                    "llama_cpp": lc, "f32_w2": f32, "profile_w2_ms": p})
print(json.dumps({"gguf_decode_tokens_per_s": summary}))
