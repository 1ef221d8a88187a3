"""The table of `scripts/bench-device.sh`: candle-tp world N x 1 thread against llama.cpp's
`llama-bench -t N` (native, and built without AMX where the run has it), medians over the
rounds of decode (tg32) and prefill (pp128) tokens/s, the ratios candle-tp / llama.cpp, the
issue's goals on the 16-core host (decode >= 1.2x, pp128 >= 1.0x), the host's read bandwidth
with N threads, and candle-tp's split of its pp128 and of a decode step into matmuls,
collectives and the rest (rank 0, `bench_generate --profile`). Ends with one JSON line
(`device_comparison`) holding the same numbers.

    python3 scripts/bench_device_table.py results.jsonl
"""
import json
import statistics
import sys

from tagged_jsonl import read_rows

rows = read_rows(sys.argv[1])
if not rows:
    sys.exit(f"{sys.argv[1]}: no measurements")

samples = {}  # (type, N, side, test) -> [tokens/s]
split = {}  # (type, N, test) -> [(matmul, collectives, rest) ms]
mem = {}  # N -> [GB/s]
for r in rows:
    side = r["side"]
    if side == "mem":
        mem.setdefault(r["t"], []).append(r["read_gb_s"])
        continue
    key = (r["type"], r["t"])
    if side == "candle-tp":
        samples.setdefault(key + (side, "tg"), []).append(r["tokens_per_s"])
        pp = r.get("prefill", {}).get("128")
        if pp:
            samples.setdefault(key + (side, "pp"), []).append(pp["tokens_per_s"])
            if "profile_ms" in pp:
                p = pp["profile_ms"]
                split.setdefault(key + ("pp",), []).append(
                    (p["matmul"], p["collectives"], p["rest"]))
        p = r.get("profile_ms_per_token")
        if p:
            split.setdefault(key + ("tg",), []).append(
                (p["matmul"], p["collectives"], p["rest"]))
    else:
        test = "tg" if r.get("n_gen", 0) > 0 else "pp"
        samples.setdefault(key + (side, test), []).append(r["avg_ts"])


def med(v):
    return statistics.median(v) if v else float("nan")


cells = sorted({k[:2] for k in samples}, key=lambda c: (c[0], c[1]))
noamx = any(k[2] == "llama.cpp-noamx" for k in samples)
goals = {"tg": 1.2, "pp": 1.0}
out = []
head = "type     N  mem GB/s | tg32: candle-tp llama.cpp ratio"
head += " | no-AMX ratio" if noamx else ""
head += " | pp128: candle-tp llama.cpp ratio"
head += " | no-AMX ratio" if noamx else ""
head += " | n"
print(head)
for ty, n in cells:
    line = f"{ty:<7} {n:>2} {med(mem.get(n, [])):>9.1f}"
    entry = {"type": ty, "threads": n, "read_gb_s": med(mem.get(n, []))}
    for test in ("tg", "pp"):
        c = med(samples.get((ty, n, "candle-tp", test), []))
        l = med(samples.get((ty, n, "llama.cpp", test), []))
        ratio = c / l if l else float("nan")
        mark = "" if ratio != ratio or ratio >= goals[test] else "*"
        line += f" | {c:>9.1f} {l:>9.1f} {ratio:>5.2f}{mark or ' '}"
        entry[test] = {"candle_tp": c, "llama_cpp": l, "ratio": ratio}
        if noamx:
            x = med(samples.get((ty, n, "llama.cpp-noamx", test), []))
            line += f" | {x:>6.1f} {c / x if x else float('nan'):>5.2f}"
            entry[test]["llama_cpp_noamx"] = x
    counts = [len(samples.get((ty, n, s, "tg"), [])) for s in ("candle-tp", "llama.cpp")]
    line += f" | {counts[0]},{counts[1]}"
    print(line)
    out.append(entry)
print("(* below the goal: decode >= 1.2x, pp128 >= 1.0x" + (
    "; no-AMX: llama.cpp built with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16, and "
    "candle-tp's ratio to it)" if noamx else ")"))
if split:
    print()
    print("candle-tp rank 0, median ms: pp128 matmul collectives rest | decode step matmul "
          "collectives rest")
    for ty, n in cells:
        parts = []
        for test in ("pp", "tg"):
            v = split.get((ty, n, test), [])
            if v:
                m = [med([x[i] for x in v]) for i in range(3)]
                parts.append(f"{m[0]:>8.1f} {m[1]:>8.1f} {m[2]:>8.1f}")
                for e in out:
                    if e["type"] == ty and e["threads"] == n:
                        e[test]["split_ms"] = dict(zip(("matmul", "collectives", "rest"), m))
            else:
                parts.append(" " * 26)
        print(f"{ty:<7} {n:>2} | " + " | ".join(parts))
print(json.dumps({"device_comparison": out}))
