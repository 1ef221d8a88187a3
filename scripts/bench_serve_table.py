#!/usr/bin/env python3
"""The summary of `scripts/bench-serve.sh`: reads the runs (one JSON object per line, each
scripts/bench_serve.py's output plus `server`, `round` and the load average around it) and a
JSON object of facts about the run, prints one JSON object (the facts, every run, and per
concurrency level the median over the rounds of each figure, side by side with the ratio
candle-tp / llama.cpp when both ran) on stdout and a Markdown table on stderr.

usage: bench_serve_table.py RUNS.jsonl META.json
"""
import json
import statistics
import sys

runs = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
meta = json.load(open(sys.argv[2]))
servers = list(dict.fromkeys(r["server"] for r in runs))


def med(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def summary(server, streams):
    lvs = [lv for r in runs if r["server"] == server for lv in r["levels"] if lv["streams"] == streams]
    if not lvs:
        return None
    pick = lambda key, p: med(lv[key][p] if lv[key] else None for lv in lvs)
    return {
        "tokens_per_s": med(lv["tokens_per_s"] for lv in lvs),
        "speedup_vs_1_stream": med(lv["speedup_vs_1_stream"] for lv in lvs),
        "ttft_ms": {"p50": pick("ttft_ms", "p50"), "p99": pick("ttft_ms", "p99")},
        "itl_ms": {"p50": pick("itl_ms", "p50"), "p99": pick("itl_ms", "p99")},
        "generated_tokens": [lv["generated_tokens"] for lv in lvs],
        "short_requests": sum(lv["short_requests"] for lv in lvs),
        "errors": sum(len(lv["errors"]) for lv in lvs),
        "token_count": "/".join(sorted({lv["token_count"] or "-" for lv in lvs})),
    }


levels = list(dict.fromkeys(lv["streams"] for r in runs for lv in r["levels"]))
side = []
for n in levels:
    row = {"streams": n}
    for s in servers:
        row[s] = summary(s, n)
    if "candle-tp" in row and "llama.cpp" in row and row["candle-tp"] and row["llama.cpp"]:
        a, b = row["candle-tp"]["tokens_per_s"], row["llama.cpp"]["tokens_per_s"]
        row["tokens_per_s_ratio_candle_tp_over_llama_cpp"] = round(a / b, 2) if a and b else None
    elif len(servers) == 2 and row[servers[0]] and row[servers[1]]:
        # Two candle-tp layouts (--pp-vs-tp): the second over the first.
        a, b = row[servers[1]]["tokens_per_s"], row[servers[0]]["tokens_per_s"]
        row["tokens_per_s_ratio"] = round(a / b, 2) if a and b else None
    side.append(row)

print(json.dumps({**meta, "per_level": side, "runs": runs}, indent=1))

f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"
lat = lambda s, key: f"{f(s[key]['p50'], 0)} / {f(s[key]['p99'], 0)}" if s else "-"
head = ["streams"]
for s in servers:
    head += [f"{s} tok/s"]
ratio_key = ("tokens_per_s_ratio_candle_tp_over_llama_cpp" if "llama.cpp" in servers
             else "tokens_per_s_ratio")
if len(servers) == 2:
    head += ["candle-tp / llama.cpp" if "llama.cpp" in servers else f"{servers[1]} / {servers[0]}"]
for s in servers:
    head += [f"{s} TTFT p50 / p99 (ms)", f"{s} ITL p50 / p99 (ms)"]
lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
for row in side:
    cells = [str(row["streams"])]
    cells += [f(row[s]["tokens_per_s"]) if row[s] else "-" for s in servers]
    if len(servers) == 2:
        cells += [f(row.get(ratio_key), 2)]
    for s in servers:
        cells += [lat(row[s], "ttft_ms"), lat(row[s], "itl_ms")]
    lines.append("| " + " | ".join(cells) + " |")
print("\n".join(lines), file=sys.stderr)
