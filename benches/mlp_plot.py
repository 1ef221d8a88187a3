"""Plots of scripts/bench-mlp.sh with matplotlib: TP efficiency against d_model, one panel per
(backend, pass, sequence length), one line per rank count, as PNG and SVG.

    python benches/mlp_plot.py OUT_DIR     # reads OUT_DIR/tp_efficiency.json (mlp_report.py)

TP efficiency is T(1 process, 1 thread) / (R * T(R ranks, 1 thread each)): 1 is perfect
scaling, and above 1/R a run on R ranks is faster than one process with one thread.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

out = sys.argv[1]
points = json.load(open(f"{out}/tp_efficiency.json"))
panels = sorted({(p["backend"], p["pass"], p["seq_len"]) for p in points})
if not panels:
    sys.exit("no TP runs to plot")
fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
for ax, (backend, pas, s) in zip(axes[0], panels):
    mine = [p for p in points if (p["backend"], p["pass"], p["seq_len"]) == (backend, pas, s)]
    ds = sorted({p["d_model"] for p in mine})
    for n in sorted({p["ranks"] for p in mine}):
        line = sorted((p["d_model"], p["efficiency"]) for p in mine if p["ranks"] == n)
        ax.plot([ds.index(d) for d, _ in line], [e for _, e in line], marker="o", label=f"{n} ranks")
        ax.axhline(1 / n, color=ax.lines[-1].get_color(), linestyle=":", linewidth=1)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(ds)), [str(d) for d in ds])
    ax.set_xlabel("d_model (hidden size of the MLP)")
    ax.set_ylabel("TP efficiency  T(1 proc) / (R · T(R ranks))")
    ax.set_ylim(0, max(1.2, max(p["efficiency"] for p in mine) * 1.1))
    ax.set_title(f"{pas}, S = {s} ({backend})")
    ax.grid(alpha=0.3)
    ax.legend(title="dotted: 1/R (break-even)", fontsize=9, title_fontsize=8)
fig.suptitle("candle-tp MLP (column → GELU → row parallel): scaling over ranks, 1 thread each")
fig.tight_layout()
for ext in ("png", "svg"):
    fig.savefig(f"{out}/tp_efficiency.{ext}", dpi=130)
print(f"wrote {out}/tp_efficiency.png and {out}/tp_efficiency.svg")
