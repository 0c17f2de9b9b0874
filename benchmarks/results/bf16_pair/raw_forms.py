"""The two forms of a bf16 all-reduce at two ranks as raw C calls (issue 35):
oneCCL's own bf16 all-reduce, the float32 one of the same elements alone and
between the float32 form's two copies, and the pair form's all-gather alone
and followed by its one torch add. 9 rounds, interleaved; the slowest
rank's median per call and its ratio to oneCCL's own bf16::

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 benchmarks/results/bf16_pair/raw_forms.py
"""
import time, statistics, torch, streamcoll
from streamcoll.bench.cases import Context
torch.set_num_threads(1)
comm = streamcoll.init(device="cpu")
rank, size = comm.rank, comm.size
cpu = torch.device("cpu")
ctx = {dt: Context(comm, rank, size, cpu, dt, False) for dt in (torch.bfloat16, torch.float32)}
SUM = comm._backend.ops["SUM"]
res = {}
for nbytes in (4096, 16384, 65536, 1 << 20, 8 << 20):
    n = nbytes // 2
    NC = 1000 if nbytes <= 65536 else (40 if nbytes <= 1 << 20 else 8)
    xb = torch.randn(n).to(torch.bfloat16); g = torch.empty(size * n, dtype=torch.bfloat16)
    xf = torch.zeros(n); xc = xb.clone()
    cb, cf = ctx[torch.bfloat16], ctx[torch.float32]
    rb = cb.bound("all_reduce", {"send": cb.ptr(xb), "recv": cb.ptr(xb), "count": n, "op": SUM})
    rf = cf.bound("all_reduce", {"send": cf.ptr(xf), "recv": cf.ptr(xf), "count": n, "op": SUM})
    ag = cb.bound("all_gather_into_tensor", {"send": cb.ptr(xc), "recv": cb.ptr(g), "count": n})
    g0, g1 = g[:n], g[n:]
    def agadd():
        ag(); torch.add(g0, g1, out=xc)
    def copies():
        xf.copy_(xc); rf(); xc.copy_(xf)
    V = {"raw bf16": rb, "raw f32": rf, "f32+copies": copies, "ag": ag, "ag+add": agadd}
    for f in V.values():
        for _ in range(50): f()
    T = {k: [] for k in V}
    for r in range(9):
        for k, f in V.items():
            comm.barrier(); t0 = time.perf_counter()
            for _ in range(NC): f()
            T[k].append((time.perf_counter() - t0) / NC * 1e6)
    fl = torch.tensor([x for k in V for x in T[k]], dtype=torch.float64)
    comm.all_reduce(fl, streamcoll.ReduceOp.MAX); it = iter(fl.tolist())
    T = {k: [next(it) for _ in range(9)] for k in V}
    if rank == 0:
        base = statistics.median(T["raw bf16"])
        print(nbytes, "  ".join(f"{k} {statistics.median(v):.1f} ({statistics.median(v)/base:.2f})" for k, v in T.items()), flush=True)
comm.destroy()
