#!/usr/bin/env python3
"""Tables of scripts/bench-hosts.sh's JSON lines: medians over rounds, ratios from one run.

usage: bench_hosts_table.py results.jsonl
"""
import collections
import json
import statistics
import sys


def size(b):
    for unit, shift in (("M", 20), ("K", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}iB"
    return f"{b} B"


def main(path):
    rows = [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    coll = collections.defaultdict(list)
    cross = {}
    dec = collections.defaultdict(list)
    srv = collections.defaultdict(list)
    mem = collections.defaultdict(list)  # (model, rate, threads) -> host read GB/s per round
    for r in rows:
        if "serve" in r:
            srv[(r["rate"], r["serve"])].append(r)
        elif "op" in r:
            impl = "Open MPI" if r["impl"] == "mpi" else f"candle-tp {r.get('backend', '?')}"
            if r.get("unchecked"):
                impl += ", unchecked"
            coll[(r["rate"], r["bytes"], impl)].append(r["median_us"])
            if "cross_host_bytes" in r:
                cross[(r["rate"], r["bytes"], impl)] = r["cross_host_bytes"]
        elif "read_gb_s" in r:
            mem[(r["model"], r.get("rate", "unlimited"), r["threads"])].append(r["read_gb_s"])
        elif "tokens_per_s" in r:
            dec[(r["model"], r.get("rate", "unlimited"), r["layout"])].append(r)
        elif "avg_ts" in r:  # llama-bench's jsonl
            r["tokens_per_s"] = r["avg_ts"]
            dec[(r["model"], r.get("rate", "unlimited"), r["layout"])].append(r)
    if coll:
        print("\nall-reduce f32, 2 hosts x 2 ranks: median microseconds (median over rounds)\n")
        impls = ["Open MPI", "candle-tp hierarchical", "candle-tp hierarchical, unchecked",
                 "candle-tp mpi"]
        print("| link | size | " + " | ".join(impls)
              + " | Open MPI / hierarchical | Open MPI / unchecked"
              + " | bytes to the network per rank, hierarchical / flat |")
        print("|---|---|" + "---|" * (len(impls) + 3))
        for rate, b in sorted({(k[0], k[1]) for k in coll}, key=lambda k: (k[0], k[1])):
            med = {i: statistics.median(coll[(rate, b, i)]) for i in impls if (rate, b, i) in coll}
            cells = [f"{med[i]:.0f}" if i in med else "-" for i in impls]
            ratio = " | ".join(
                f"{med['Open MPI'] / med[i]:.2f}" if "Open MPI" in med and i in med else "-"
                for i in impls[1:3])
            h = cross.get((rate, b, "candle-tp hierarchical"))
            f = cross.get((rate, b, "candle-tp mpi"))
            nb = f"{size(int(h))} / {size(int(f))}" if h is not None and f is not None else "-"
            print(f"| {rate} | {size(b)} | " + " | ".join(cells) + f" | {ratio} | {nb} |")
    if dec:
        print("\ndecode, 1 thread per rank: tokens/s (median over rounds); x 1 host x 1: against"
              " the same engine's one host, one thread\n")
        print("| model | link | layout | tokens/s | x 1 host x 1 | collectives / token "
              "| bytes crossing hosts / token, rank 0 / all ranks | same ids as 1 x 1 |")
        print("|---|---|---|---|---|---|---|---|")
        layouts = [("1 host x 1", "1 host x 1"), ("1 host x 2", "1 host x 1"),
                   ("2 hosts x 1", "1 host x 1"), ("2 hosts x 2", "1 host x 1"),
                   ("2 hosts x 1, pp 2", "1 host x 1"), ("2 hosts x 2, pp 2 x tp 2", "1 host x 1"),
                   ("2 hosts x 1, ep (whole experts per rank)", "1 host x 1"),
                   ("2 hosts x 2, ep (whole experts per rank)", "1 host x 1"),
                   ("2 hosts x 2, ep 2 x etp 2", "1 host x 1"),
                   ("llama.cpp 1 host x 1 thread(s)", "llama.cpp 1 host x 1 thread(s)"),
                   ("llama.cpp 1 host x 2 thread(s)", "llama.cpp 1 host x 1 thread(s)"),
                   ("llama.cpp RPC 2 hosts x 1 thread", "llama.cpp 1 host x 1 thread(s)"),
                   ("distributed-llama 1 host(s) x 1 thread",
                    "distributed-llama 1 host(s) x 1 thread"),
                   ("distributed-llama 2 host(s) x 1 thread",
                    "distributed-llama 1 host(s) x 1 thread")]
        tps = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in dec.items()}
        for model, rate in sorted({(k[0], k[1]) for k in dec}):
            for layout, base in layouts:
                rs = dec.get((model, rate, layout))
                if not rs:
                    continue
                b = tps.get((model, rate, base))
                comm = rs[0].get("comm")
                cpt = f"{comm['collectives_per_token']:.0f}" if comm else "-"
                bpt = (f"{comm['cross_host_bytes_per_token']:.0f} / "
                       f"{comm.get('job_cross_host_bytes_per_token', float('nan')):.0f}"
                       if comm else "-")
                ones = dec.get((model, rate, "1 host x 1"))
                same = (all(r["token_ids"] == ones[0]["token_ids"] for r in rs)
                        if ones and "token_ids" in rs[0] else "-")
                t = tps[(model, rate, layout)]
                print(f"| {model} | {rate} | {layout} | {t:.1f} | "
                      + (f"{t / b:.2f}" if b else "-") + f" | {cpt} | {bpt} | {same} |")
        # The emulated hosts share this machine's memory: a decode streams every weight once
        # per token, so two ranks together cannot pass the machine's two-thread read bandwidth.
        ceilings = []
        for model, rate in sorted({(k[0], k[1]) for k in dec}):
            one = dec.get((model, rate, "1 host x 1"))
            m1, m2 = mem.get((model, rate, 1)), mem.get((model, rate, 2))
            if not one or not m1 or not m2 or "weight_bytes_per_token" not in one[0]:
                continue
            traffic = tps[(model, rate, "1 host x 1")] * one[0]["weight_bytes_per_token"] / 1e9
            h1, h2 = statistics.median(m1), statistics.median(m2)
            ceilings.append(f"| {model} | {rate} | {h1:.1f} | {h2:.1f} ({min(m2):.1f}-{max(m2):.1f}) "
                            f"| {traffic:.1f} "
                            f"| {traffic / h1:.0%} | {h2 / traffic:.2f} |")
        if ceilings:
            print("\nThe machine's ceiling (all emulated hosts share its memory): host read GB/s"
                  " (bench_memory, medians), 1 host x 1's weight traffic (tokens/s x weight bytes"
                  " per token), and the most that any layout of 2 single-threaded ranks on this"
                  " machine can reach against 1 host x 1 (2-thread read / 1 x 1's traffic)\n")
            print("| model | link | read, 1 thread | read, 2 threads | 1 host x 1 GB/s "
                  "| share of 1 thread | ceiling x 1 host x 1 |")
            print("|---|---|---|---|---|---|---|")
            print("\n".join(ceilings))

    if srv:
        print("\nserving SmolLM2 Q4_1 from ctp-h1, 1 thread per rank: total tokens/s at N concurrent"
              " streams (median over rounds); pp / tp: the pipeline against tensor parallelism on"
              " the same 2 hosts\n")
        levels = sorted({lv["streams"] for v in srv.values() for r in v for lv in r["levels"]})
        print("| link | layout | " + " | ".join(f"{n} streams" for n in levels)
              + " | bytes crossing hosts / generated token (rank 0) |")
        print("|---|---|" + "---|" * (len(levels) + 1))
        med = {}
        for (rate, label), rs in sorted(srv.items()):
            for n in levels:
                xs = [lv["tokens_per_s"] for r in rs for lv in r["levels"] if lv["streams"] == n]
                med[(rate, label, n)] = statistics.median(xs) if xs else None
            bpt = [r["rank0_cross_host_bytes_per_token"] for r in rs
                   if r.get("rank0_cross_host_bytes_per_token") is not None]
            cells = [f"{med[(rate, label, n)]:.1f}" if med[(rate, label, n)] else "-"
                     for n in levels]
            b = f"{statistics.median(bpt):.0f}" if bpt else "-"
            print(f"| {rate} | {label} | " + " | ".join(cells) + f" | {b} |")
        for rate in sorted({k[0] for k in srv}):
            tp = [med.get((rate, "2 hosts x 1, tp 2", n)) for n in levels]
            pp = [med.get((rate, "2 hosts x 1, pp 2", n)) for n in levels]
            if all(tp) and all(pp):
                print(f"| {rate} | pp / tp | "
                      + " | ".join(f"{p / t:.2f}" for p, t in zip(pp, tp)) + " | |")


if __name__ == "__main__":
    main(sys.argv[1])
