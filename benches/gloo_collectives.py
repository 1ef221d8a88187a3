"""PyTorch gloo collectives timed like examples/bench_collectives.rs (optional peer).

python3 benches/gloo_collectives.py --world 2 --ops all_reduce --sizes 4K,1M
"""
import argparse, json, os, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse(s):
    m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s)


def worker(rank, world, ops, sizes, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for op in ops:
        for b in sizes:
            n = b // 4
            if op != "all_reduce" and n % world:
                continue
            a = torch.zeros(n)
            out = torch.zeros(n)
            iters = max(5, min(1000, (256 << 20) // b))
            warm = max(2, iters // 10)
            t = torch.zeros(iters, dtype=torch.float64)
            for i in range(warm + iters):
                if i == warm:
                    dist.barrier()
                t0 = time.perf_counter()
                if op == "all_reduce":
                    dist.all_reduce(a)
                elif op == "all_gather":
                    dist.all_gather_into_tensor(out, a[: n // world])
                else:
                    dist.reduce_scatter_tensor(out[: n // world], a)
                if i >= warm:
                    t[i - warm] = (time.perf_counter() - t0) * 1e6
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rank == 0:
                s = sorted(t.tolist())
                med = s[len(s) // 2]
                algbw = b / (med * 1e-6) / 1e9
                f = (2.0 if op == "all_reduce" else 1.0) * (world - 1) / world
                print(json.dumps(dict(impl="gloo", op=op, dtype="f32", world_size=world, bytes=b, iters=iters,
                                      median_us=med, min_us=s[0], max_us=s[-1], algbw_gbps=algbw, busbw_gbps=algbw * f)),
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--ops", default="all_reduce")
    p.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M")
    p.add_argument("--port", type=int, default=29731)
    a = p.parse_args()
    mp.spawn(worker, args=(a.world, a.ops.split(","), [parse(s) for s in a.sizes.split(",")], a.port), nprocs=a.world)
