"""Tables, CSV and the TP-efficiency points (plotted by benches/mlp_plot.py) for scripts/bench-mlp.sh."""
import csv, json, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
out, cores = sys.argv[2], int(sys.argv[3])
key = lambda r: (r["backend"], r["pass"], r["seq_len"], r["d_model"])


def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


# Per round: single-process runs by key, TP runs by key + ranks.
single1, singleall, tp = {}, {}, {}
for r in rows:
    rnd = r.get("round", 1)
    if r["ranks"] == 1:
        (single1 if r["threads_per_rank"] == 1 else singleall).setdefault(key(r), {})[rnd] = r
    else:
        tp.setdefault(key(r) + (r["ranks"],), {})[rnd] = r

with open(f"{out}/results.csv", "w", newline="") as f:
    w = csv.writer(f)
    cols = ["round", "backend", "pass", "seq_len", "d_model", "ranks", "threads_per_rank", "median_ms", "comm_ms",
            "measured_comm_ratio", "model_comm_ratio", "lambda_compute", "lambda_comms"]
    w.writerow(cols)
    for r in rows:
        w.writerow([r.get(c, 1 if c == "round" else None) for c in cols])

rounds = max((r.get("round", 1) for r in rows), default=1)
print()
print(f"Times are medians over {rounds} round(s); each ratio is taken within a round (same-round runs), "
      "then its median over rounds, with its range when there are several.")
print("| backend | pass | S | d | 1 proc x 1 thr | 1 proc x %d thr | ranks | TP time | comm | TP / 1 proc x %d thr | range | TP efficiency | comm/compute measured | model |" % (cores, cores))
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
eff = {}
nan = float("nan")
for k in sorted(tp):
    per_round = tp[k]
    base = k[:4]
    n = k[4]
    s1, sa = single1.get(base, {}), singleall.get(base, {})
    ratios = [r["median_ms"] / sa[i]["median_ms"] for i, r in per_round.items() if i in sa]
    effs = [s1[i]["median_ms"] / (n * r["median_ms"]) for i, r in per_round.items() if i in s1]
    any_r = next(iter(per_round.values()))
    t1 = median([r["median_ms"] for r in s1.values()]) if s1 else nan
    ta = median([r["median_ms"] for r in sa.values()]) if sa else nan
    ttp = median([r["median_ms"] for r in per_round.values()])
    comm = median([r["comm_ms"] for r in per_round.values()])
    meas = median([r["measured_comm_ratio"] for r in per_round.values()])
    model = median([r["model_comm_ratio"] for r in per_round.values()])
    ratio = median(ratios) if ratios else nan
    rng = f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else ""
    e = median(effs) if effs else nan
    eff.setdefault((k[0], k[1], k[2], n), []).append((k[3], e, 1 / ratio if ratio else nan))
    print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {t1:.3f} ms | {ta:.3f} ms | {n}x{any_r['threads_per_rank']} | "
          f"{ttp:.3f} ms | {comm:.3f} ms | {ratio:.2f} | {rng} | {e:.2f} | {meas:.3f} | {model:.3f} |")

# MKL against gemm, mode by mode, when both backends ran (ratio within a round, then median).
backends = sorted({r["backend"] for r in rows})
if len(backends) > 1 and "gemm" in backends:
    runs = {}
    for r in rows:
        mode = (r["ranks"], r["threads_per_rank"])
        runs.setdefault((r["pass"], r["seq_len"], r["d_model"], mode), {}).setdefault(r["backend"], {})[r.get("round", 1)] = r["median_ms"]
    print("\n| pass | S | d | ranks x threads | " + " | ".join(backends) + " | " +
          " | ".join(f"speed-up of {b} over gemm" for b in backends if b != "gemm") + " |")
    print("|---" * (4 + 2 * len(backends) - 1) + "|")
    for (pas, s, d, mode), by in sorted(runs.items()):
        if "gemm" not in by:
            continue
        times = [f"{median(list(by[b].values())):.3f} ms" if b in by else "" for b in backends]
        ups = []
        for b in backends:
            if b == "gemm":
                continue
            sp = [by["gemm"][i] / t for i, t in by.get(b, {}).items() if i in by["gemm"]]
            ups.append(f"{median(sp):.2f}" if sp else "")
        print(f"| {pas} | {s} | {d} | {mode[0]}x{mode[1]} | " + " | ".join(times) + " | " + " | ".join(ups) + " |")

# GEMM rate of one process with 1 thread against the core's FMA peak (benches/fma_peak.c).
try:
    peak = json.load(open(f"{out}/peak.json"))
    top = max(peak["fma_gmacs_256"], peak["fma_gmacs_512"])
    print(f"\nOne core's FMA peak: {top:.1f} G multiply-adds/s (~{peak['ghz_est']:.2f} GHz). "
          "The MLP's GEMM with 1 thread (lambda_compute):")
    lams = {}
    for k, per_round in single1.items():
        lams.setdefault((k[0], k[2], k[3]), []).extend(r["lambda_compute"] for r in per_round.values())
    for (backend, s, d), v in sorted(lams.items()):
        lam = median(v) / 1e9
        print(f"  {backend} S={s} d={d}: {lam:.1f} G/s = {100 * lam / top:.0f} % of peak")
except (OSError, ValueError, KeyError):
    pass

# Per point, for benches/mlp_plot.py: TP efficiency T(1 rank, 1 thread) / (R * T(R ranks)) and
# the speed-up T(1 process, all cores) / T(R ranks) (the same cores either way).
points = [
    {"backend": b, "pass": pas, "seq_len": s, "ranks": n, "d_model": d, "efficiency": e,
     "speedup": sp, "cores": cores}
    for (b, pas, s, n), v in sorted(eff.items())
    for d, e, sp in v
    if e == e and sp == sp  # not NaN
]
json.dump(points, open(f"{out}/tp_efficiency.json", "w"), indent=1)
print(f"\nwrote {out}/results.csv and {out}/tp_efficiency.json")
