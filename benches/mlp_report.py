"""Tables, CSV and SVG for scripts/bench-mlp.sh (no plotting library needed)."""
import csv, json, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
out, cores = sys.argv[2], int(sys.argv[3])
key = lambda r: (r["backend"], r["pass"], r["seq_len"], r["d_model"])
single1, singleall, tp = {}, {}, {}
for r in rows:
    if r["ranks"] == 1:
        (single1 if r["threads_per_rank"] == 1 else singleall)[key(r)] = r
    else:
        tp[key(r) + (r["ranks"],)] = r

with open(f"{out}/results.csv", "w", newline="") as f:
    w = csv.writer(f)
    cols = ["backend", "pass", "seq_len", "d_model", "ranks", "threads_per_rank", "median_ms", "comm_ms",
            "measured_comm_ratio", "model_comm_ratio", "lambda_compute", "lambda_comms"]
    w.writerow(cols)
    for r in rows:
        w.writerow([r.get(c) for c in cols])

print()
print("| backend | pass | S | d | 1 proc x 1 thr | 1 proc x %d thr | ranks | TP time | comm | TP / 1 proc x %d thr | TP efficiency | comm/compute measured | model |" % (cores, cores))
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
eff = {}
for k in sorted(tp):
    r = tp[k]
    base = k[:4]
    t1 = single1.get(base, {}).get("median_ms")
    ta = singleall.get(base, {}).get("median_ms")
    n = r["ranks"]
    ratio = r["median_ms"] / ta if ta else float("nan")
    e = t1 / (n * r["median_ms"]) if t1 else float("nan")
    eff.setdefault((r["backend"], r["pass"], r["seq_len"], n), []).append((r["d_model"], e))
    print(f"| {r['backend']} | {r['pass']} | {r['seq_len']} | {r['d_model']} | {t1:.3f} ms | {ta:.3f} ms | {n}x{r['threads_per_rank']} | "
          f"{r['median_ms']:.3f} ms | {r['comm_ms']:.3f} ms | {ratio:.2f} | {e:.2f} | {r['measured_comm_ratio']:.3f} | {r['model_comm_ratio']:.3f} |")

# TP efficiency T(1 rank, 1 thread) / (R * T(R ranks)) against d_model, one line per R.
W, H, L, B = 720, 420, 70, 50
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H * max(1, len(set((k[0], k[1], k[2]) for k in eff)))}" font-family="sans-serif" font-size="12">']
colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
panels = sorted(set((k[0], k[1], k[2]) for k in eff))
for p, (backend, pas, s) in enumerate(panels):
    oy = p * H
    svg.append(f'<text x="{W/2}" y="{oy+20}" text-anchor="middle">TP efficiency vs d_model ({backend}, {pas}, S={s}; 1 = perfect scaling)</text>')
    svg.append(f'<line x1="{L}" y1="{oy+H-B}" x2="{W-20}" y2="{oy+H-B}" stroke="black"/><line x1="{L}" y1="{oy+40}" x2="{L}" y2="{oy+H-B}" stroke="black"/>')
    ds = sorted({d for k, v in eff.items() if k[:3] == (backend, pas, s) for d, _ in v})
    xs = {d: L + (i + 0.5) * (W - L - 20) / max(1, len(ds)) for i, d in enumerate(ds)}
    y = lambda e: oy + H - B - min(max(e, 0), 1.2) / 1.2 * (H - B - 40)
    for t in [0, 0.25, 0.5, 0.75, 1.0]:
        svg.append(f'<text x="{L-8}" y="{y(t)+4}" text-anchor="end">{t}</text><line x1="{L}" y1="{y(t)}" x2="{W-20}" y2="{y(t)}" stroke="#ddd"/>')
    for d, x in xs.items():
        svg.append(f'<text x="{x}" y="{oy+H-B+18}" text-anchor="middle">{d}</text>')
    for i, ((b2, p2, s2, n), pts) in enumerate(sorted((k, v) for k, v in eff.items() if k[:3] == (backend, pas, s))):
        c = colors[i % len(colors)]
        pts = sorted(pts)
        svg.append('<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>' % (c, " ".join(f"{xs[d]},{y(e)}" for d, e in pts)))
        svg.append(f'<text x="{W-30}" y="{oy+50+16*i}" fill="{c}" text-anchor="end">R = {n}</text>')
svg.append("</svg>")
open(f"{out}/tp_efficiency.svg", "w").write("\n".join(svg))
print(f"\nwrote {out}/results.csv and {out}/tp_efficiency.svg")
