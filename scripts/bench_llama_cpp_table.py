"""The table of `scripts/bench-llama-cpp.sh`: candle-tp against llama-bench, median tokens/s
over the rounds for every model, type, world size and test (tg N, pp N), the ratio
candle-tp / llama.cpp, and the issue's goals at world 2 (decode >= 1.2x, prefill >= 1.0x).
Ends with one JSON line (`llama_cpp_comparison`) holding the same numbers.

    python3 scripts/bench_llama_cpp_table.py target/bench-llama-cpp.jsonl
"""
import json
import statistics
import sys

def first_wins(pairs):
    """The script's tags (`model`: smollm2, ...) come first on each line; bench_generate's own
    `model` (the file name) after them must not replace them."""
    obj = {}
    for k, v in pairs:
        obj.setdefault(k, v)
    return obj


rows = [json.loads(line, object_pairs_hook=first_wins)
        for line in open(sys.argv[1]) if line.startswith("{")]
if not rows:
    sys.exit(f"{sys.argv[1]}: no measurements")

# (model, type, world, impl, test) -> [tokens/s per round]
samples = {}


def add(r, impl, test, tps):
    samples.setdefault((r.get("bench_model") or r["model"], r["type"], r["world"], impl, test), []).append(tps)


for r in rows:
    if r.get("impl") == "llama.cpp":
        test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        add(r, "llama.cpp", test, r["avg_ts"])
    elif r.get("impl") == "candle-tp":
        add(r, "candle-tp", f"tg{r['new_tokens'] - 1}", r["tokens_per_s"])
        for n, p in r.get("prefill", {}).items():
            add(r, "candle-tp", f"pp{n}", p["tokens_per_s"])

tests = sorted({k[4] for k in samples}, key=lambda t: (t[:2] != "tg", int(t[2:])))
keys = list(dict.fromkeys((m, t, w) for (m, t, w, _, _) in samples))
head = ["model", "type", "world / threads"]
for t in tests:
    head += [f"{t} candle-tp", f"{t} llama.cpp", f"{t} ratio"]
print("\n| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
summary = []
for m, ty, w in keys:
    cells = [m, ty, f"{w} / {w}"]
    entry = {"model": m, "type": ty, "world": w}
    for t in tests:
        ours = samples.get((m, ty, w, "candle-tp", t))
        theirs = samples.get((m, ty, w, "llama.cpp", t))
        a = statistics.median(ours) if ours else None
        b = statistics.median(theirs) if theirs else None
        ratio = a / b if a and b else None
        goal = 1.2 if t.startswith("tg") else 1.0
        mark = "" if ratio is None or w != 2 else (" ✓" if ratio >= goal else " ✗")
        cells += [f"{a:.1f}" if a else "-", f"{b:.1f}" if b else "-",
                  (f"{ratio:.2f}{mark}" if ratio else "-")]
        entry[t] = {"candle_tp": a, "llama_cpp": b, "ratio": ratio,
                    "rounds": [len(ours or []), len(theirs or [])]}
    print("| " + " | ".join(cells) + " |")
    summary.append(entry)
n = max(len(v) for v in samples.values())
print(f"\nMedians of up to {n} rounds, tokens/s. ✓/✗ at world 2: the goal (decode >= 1.2x, "
      "prefill >= 1.0x llama.cpp) met or not.")
print(json.dumps({"llama_cpp_comparison": summary}))
