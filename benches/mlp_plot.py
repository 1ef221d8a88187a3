"""Plots of scripts/bench-mlp.sh with matplotlib, as PNG and SVG, from OUT_DIR/tp_efficiency.json
(written by benches/mlp_report.py):

    python benches/mlp_plot.py OUT_DIR [NOTE]    # NOTE: a line under the title (e.g. the load)

- tp_speedup.{png,svg}: the headline. For each d_model, how much faster R ranks x 1 thread run
  the MLP than one process using every core (T(1 process, all cores) / T(R ranks)); above 1
  tensor parallelism wins with the same cores. One panel per (pass, sequence length).
- tp_efficiency.{png,svg}: TP efficiency T(1 process, 1 thread) / (R * T(R ranks)) against
  d_model, one line per R: 1 is perfect scaling, above 1/R (dotted) R ranks beat one thread.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

out = sys.argv[1]
note = sys.argv[2] if len(sys.argv) > 2 else ""
points = json.load(open(f"{out}/tp_efficiency.json"))
if not points:
    sys.exit("no TP runs to plot")
plt.rcParams.update({"font.size": 12, "axes.titlesize": 13, "axes.labelsize": 12,
                     "legend.fontsize": 11, "xtick.labelsize": 11, "ytick.labelsize": 11})
backends = sorted({p["backend"] for p in points})
passes = sorted({p["pass"] for p in points}, key=lambda p: (p != "fwd", p))
seqs = sorted({p["seq_len"] for p in points})
ranks = sorted({p["ranks"] for p in points})
cores = points[0].get("cores", "all")
pass_name = {"fwd": "forward", "fwd_bwd": "forward + backward"}
colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def grid():
    fig, axes = plt.subplots(len(passes), len(seqs), figsize=(7.2 * len(seqs), 4.4 * len(passes) + 1.2),
                             squeeze=False)
    return fig, axes


def finish(fig, title, name, legend_title):
    # One legend for all panels, under the title, so that it hides no bar or line.
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.suptitle(title + (f"\n{note}" if note else ""), fontsize=14)
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), title=legend_title,
               bbox_to_anchor=(0.5, 0.935), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.895))
    for ext in ("png", "svg"):
        fig.savefig(f"{out}/{name}.{ext}", dpi=110)
    print(f"wrote {out}/{name}.png and {out}/{name}.svg")


def mine(backend, pas, s):
    return [p for p in points if (p["backend"], p["pass"], p["seq_len"]) == (backend, pas, s)]


# 1. Speed-up over one process with every core: grouped bars, one group per d_model.
for backend in backends:
    fig, axes = grid()
    for i, pas in enumerate(passes):
        for j, s in enumerate(seqs):
            ax, sel = axes[i][j], mine(backend, pas, s)
            ds = sorted({p["d_model"] for p in sel})
            width = 0.8 / max(1, len(ranks))
            for k, n in enumerate(ranks):
                pts = {p["d_model"]: p["speedup"] for p in sel if p["ranks"] == n}
                xs = [x + (k - (len(ranks) - 1) / 2) * width for x, d in enumerate(ds) if d in pts]
                ys = [pts[d] for d in ds if d in pts]
                bars = ax.bar(xs, ys, width, color=colors[k % len(colors)],
                              label=f"{n} ranks x 1 thread" + (" (oversubscribed)" if isinstance(cores, int) and n > cores else ""))
                ax.bar_label(bars, fmt="%.2f", fontsize=9, padding=2)
            ax.axhline(1.0, color="black", linewidth=1.2, linestyle="--")
            ax.set_xticks(range(len(ds)), [str(d) for d in ds])
            ax.set_xlabel("d_model (MLP is d -> 4d -> d)")
            ax.set_ylabel(f"speed-up vs 1 process x {cores} threads")
            top = max([p["speedup"] for p in sel] + [1.0])
            ax.set_ylim(0, top * 1.2)
            ax.set_title(f"{pass_name.get(pas, pas)}, {s} token{'s' if s != 1 else ''}")
            ax.grid(axis="y", alpha=0.3)
    finish(fig, f"candle-tp tensor-parallel MLP on {cores} CPU cores ({backend} GEMM): "
                "R ranks against one process with the same cores",
           "tp_speedup" + ("" if len(backends) == 1 else f"_{backend}"),
           "above the dashed line (1.0) tensor parallelism is faster")

# 2. TP efficiency against d_model, one line per rank count.
fig, axes = grid()
for i, pas in enumerate(passes):
    for j, s in enumerate(seqs):
        ax = axes[i][j]
        for b, backend in enumerate(backends):
            sel = mine(backend, pas, s)
            ds = sorted({p["d_model"] for p in sel})
            for k, n in enumerate(ranks):
                line = sorted((p["d_model"], p["efficiency"]) for p in sel if p["ranks"] == n)
                if not line:
                    continue
                c = colors[k % len(colors)]
                ax.plot([ds.index(d) for d, _ in line], [e for _, e in line], marker="o", color=c,
                        linestyle="-" if b == 0 else "--",
                        label=f"{n} ranks" + (f" ({backend})" if len(backends) > 1 else ""))
                if b == 0:
                    ax.axhline(1 / n, color=c, linestyle=":", linewidth=1)
            ax.set_xticks(range(len(ds)), [str(d) for d in ds])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("d_model (MLP is d -> 4d -> d)")
        ax.set_ylabel("TP efficiency")
        ax.set_ylim(0, max([1.2] + [p["efficiency"] * 1.1 for p in points]))
        ax.set_title(f"{pass_name.get(pas, pas)}, {s} token{'s' if s != 1 else ''}")
        ax.grid(alpha=0.3)
finish(fig, "TP efficiency T(1 process x 1 thread) / (R * T(R ranks x 1 thread)); 1 = perfect scaling",
       "tp_efficiency", "dotted: 1/R, above it R ranks beat one thread")
