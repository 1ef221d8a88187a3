"""The table of `scripts/bench-llama-cpp.sh`: candle-tp against llama-bench, median tokens/s
over the rounds for every model, type, world size and test (tg N, pp N), the ratio
candle-tp / llama.cpp, and the issue's goals at world 2 (decode >= 1.2x, prefill >= 1.0x).
Then the decodes against the host's streaming read bandwidth (`bench_memory` with as many
threads, measured right before each side): each side's weight traffic (tokens/s x the file's
`weight_bytes_per_token`), its share of that bandwidth, and the ceiling this sets on the
decode ratio (1 / llama.cpp's share: no kernel decodes faster than the weights stream).
Ends with one JSON line (`llama_cpp_comparison`) holding the same numbers.

    python3 scripts/bench_llama_cpp_table.py target/bench-llama-cpp.jsonl
"""
import json
import statistics
import sys

from tagged_jsonl import read_rows

rows = read_rows(sys.argv[1])
if not rows:
    sys.exit(f"{sys.argv[1]}: no measurements")

# (model, type, world, impl, test) -> [tokens/s per round]
samples = {}
# (model, type, world, round, side measured after) -> host read GB/s; (model, type, world) ->
# weight bytes per decoded token
host = {}
weight_bytes = {}


def cell(r):
    """The (model, type, world) a line of the run belongs to."""
    return (r.get("bench_model") or r["model"], r["type"], r["world"])


def add(r, impl, test, tps):
    samples.setdefault(cell(r) + (impl, test), []).append(tps)


for r in rows:
    if r.get("impl") == "llama.cpp":
        test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        add(r, "llama.cpp", test, r["avg_ts"])
    elif r.get("impl") == "host":
        host[cell(r) + (r["round"], r["before"])] = r["read_gb_s"]
    elif r.get("impl") == "candle-tp":
        add(r, "candle-tp", f"tg{r['new_tokens'] - 1}", r["tokens_per_s"])
        if "weight_bytes_per_token" in r:
            weight_bytes[cell(r)] = r["weight_bytes_per_token"]
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

tg = [t for t in tests if t.startswith("tg")]
if tg and host:
    t = tg[0]
    n_gen = int(t[2:])
    # Per round: each side's decode traffic over the bandwidth measured right before it.
    shares = {}  # (model, type, world, impl) -> [(share, GB/s, host GB/s, round) per round]
    for r in rows:
        key = cell(r)
        if r.get("impl") == "llama.cpp" and r["n_gen"] == n_gen:
            impl, tps = "llama.cpp", r["avg_ts"]
        elif r.get("impl") == "candle-tp" and r["new_tokens"] - 1 == n_gen:
            impl, tps = "candle-tp", r["tokens_per_s"]
        else:
            continue
        h = host.get(key + (r["round"], "llama" if impl == "llama.cpp" else "candle"))
        wb = weight_bytes.get(key)
        if h and wb:
            gbs = tps * wb / 1e9
            shares.setdefault(key + (impl,), []).append((gbs / h, gbs, h, r["round"]))
    head = ["model", "type", "world / threads", "weight MB / token", "host read GB/s",
            "candle-tp GB/s", "share", "llama.cpp GB/s", "share", "ceiling on the ratio",
            "per round: ratio / ceiling"]
    print(f"\nDecode ({t}) against the host's streaming read bandwidth, measured right before "
          "each side (medians over rounds):\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for entry in summary:
        key = (entry["model"], entry["type"], entry["world"])
        ours, theirs = shares.get(key + ("candle-tp",)), shares.get(key + ("llama.cpp",))
        if not ours or not theirs:
            continue
        med = lambda xs, i: statistics.median(x[i] for x in xs)
        hs = [x[2] for x in ours + theirs]
        ceiling = 1 / med(theirs, 0)
        # Rounds in which both sides ran: that round's ratio and its own ceiling.
        by_round = {x[3]: x for x in theirs}
        rounds = [f"{a[1] / by_round[a[3]][1]:.2f} / {1 / by_round[a[3]][0]:.2f}"
                  for a in ours if a[3] in by_round]
        print("| " + " | ".join([
            entry["model"], entry["type"], f"{entry['world']} / {entry['world']}",
            f"{weight_bytes[key] / 1e6:.1f}",
            f"{statistics.median(hs):.1f} ({min(hs):.1f}-{max(hs):.1f})",
            f"{med(ours, 1):.1f}", f"{med(ours, 0):.0%}", f"{med(theirs, 1):.1f}",
            f"{med(theirs, 0):.0%}",
            f"{ceiling:.2f}" + (" (below the 1.2x goal)" if entry["world"] == 2 and ceiling < 1.2 else ""),
            ", ".join(rounds),
        ]) + " |")
        entry[t].update({"weight_bytes_per_token": weight_bytes[key],
                         "candle_tp_share": med(ours, 0), "llama_cpp_share": med(theirs, 0),
                         "ceiling": ceiling})
    print("\nshare: the decode's weight traffic (tokens/s x weight bytes per token) over the "
          "host's read bandwidth with as many threads, measured just before it; ceiling: 1 / "
          "llama.cpp's share, the most any implementation could reach against llama.cpp on the "
          "same host state. A host's bandwidth can move between runs, so a round's ratio follows "
          "its state.")
print(json.dumps({"llama_cpp_comparison": summary}))
