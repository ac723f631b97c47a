"""Stand-alone experiment behind docs/benchmarks.md, 2026-12-04 third session: Qwen3-4B's four
decode GEMMs at 32 and 64 rows, cuBLAS against two Triton kernels with both operands through
tensor descriptors and the weight rows on the MMA's M side: data-parallel (split-K with an
atomic fix-up) and stream-K. Timed as gemm_sweep times: a graph cycling >= 128 MB of weight
copies, median of 20 replays, us per call. On a CUDA GPU from the repository root:

    python docs/experiments/both-descriptors-gemm.py    # writes $OUT/m64.json (or ./m64.json)

Its output is docs/benchmarks-both-descriptors-gemm-h200.json."""
import itertools, json, os, sys
import torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
sys.path.insert(0, os.getcwd())
from engine.bench.gemm_sweep import time_graph

@triton.jit
def dp_kernel(w_desc, x_desc, out_ptr, N, M, stride_om, K_SPLIT,
              BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr):
    pid_n = tl.program_id(0); pid_k = tl.program_id(1)
    acc = tl.zeros([BN, BM], tl.float32)
    k_begin = pid_k * K_SPLIT
    for k0 in range(k_begin, k_begin + K_SPLIT, BK):
        w = w_desc.load([pid_n * BN, k0])
        x = x_desc.load([0, k0])
        acc = tl.dot(w, tl.trans(x), acc)
    n = pid_n * BN + tl.arange(0, BN); mm = tl.arange(0, BM)
    offs = out_ptr + mm[None, :] * stride_om + n[:, None]
    mask = (n[:, None] < N) & (mm[None, :] < M)
    if SPLIT == 1:
        tl.store(offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(offs, acc, mask=mask)

@triton.jit
def sk_kernel(w_desc, x_desc, out_ptr, N, M, stride_om, KITERS, TOTAL, PER,
              BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr):
    pid = tl.program_id(0)
    it = pid * PER
    end = tl.minimum(it + PER, TOTAL)
    nn = tl.arange(0, BN); mm = tl.arange(0, BM)
    while it < end:
        tile = it // KITERS
        k_lo = it - tile * KITERS
        k_hi = tl.minimum(KITERS, k_lo + (end - it))
        acc = tl.zeros([BN, BM], tl.float32)
        for ki in range(k_lo, k_hi):
            w = w_desc.load([tile * BN, ki * BK])
            x = x_desc.load([0, ki * BK])
            acc = tl.dot(w, tl.trans(x), acc)
        n = tile * BN + nn
        offs = out_ptr + mm[None, :] * stride_om + n[:, None]
        mask = (n[:, None] < N) & (mm[None, :] < M)
        if k_lo == 0 and k_hi == KITERS:
            tl.store(offs, acc, mask=mask)
        else:
            tl.atomic_add(offs, acc, mask=mask)
        it += k_hi - k_lo

def run_dp(x, w, out, bn, bk, stages, split, warps=4):
    M, K = x.shape; N = w.shape[0]; bm = max(16, triton.next_power_of_2(M))
    wd = TensorDescriptor.from_tensor(w, [bn, bk]); xd = TensorDescriptor.from_tensor(x, [bm, bk])
    ks = K // split
    dp_kernel[(triton.cdiv(N, bn), split)](wd, xd, out, N, M, out.stride(0), ks, BN=bn, BK=bk,
                                         BM=bm, SPLIT=split, num_warps=warps, num_stages=stages)

def run_sk(x, w, out, bn, bk, stages, progs, warps=4):
    M, K = x.shape; N = w.shape[0]; bm = max(16, triton.next_power_of_2(M))
    wd = TensorDescriptor.from_tensor(w, [bn, bk]); xd = TensorDescriptor.from_tensor(x, [bm, bk])
    kit = K // bk; total = triton.cdiv(N, bn) * kit; per = triton.cdiv(total, progs)
    sk_kernel[(triton.cdiv(total, per),)](wd, xd, out, N, M, out.stride(0), kit, total, per,
                                          BN=bn, BK=bk, BM=bm, num_warps=warps, num_stages=stages)

SHAPES = [("qkv", 6144, 2560, False), ("o_proj", 2560, 4096, False),
          ("gate_up", 19456, 2560, True), ("down", 2560, 9728, False)]
res = {}
torch.manual_seed(0)
for name, N, K, sw in SHAPES:
    copies = max(2, -(-(128 << 20) // (N * K * 2)))
    wl = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    floor_us = N * K * 2 / 4.15e12 * 1e6
    for M in (32, 64):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = (x.float() @ wl[0].float().T)
        r = {"floor_us": floor_us}
        r["cublas"] = time_graph(lambda: [torch.nn.functional.linear(x, w) for w in wl], 20) * 1e3 / copies
        out32 = torch.zeros(M, N, device="cuda", dtype=torch.float32)
        outb = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        best = {}
        for bn, bk, st in itertools.product((64, 128, 256), (64, 128), (3, 4, 5)):
            bm = max(16, triton.next_power_of_2(M))
            if (bn * bk + bm * bk) * 2 * st > 220 * 1024:
                continue
            for split in (1, 2, 4):
                if K // split % bk: continue
                key = f"dp bn{bn} bk{bk} st{st} split{split}"
                try:
                    o = outb if split == 1 else out32
                    o.zero_(); run_dp(x, wl[0], o, bn, bk, st, split)
                    err = (o.float() - ref).abs().max().item()
                    if err > 0.05 * ref.abs().max().item():
                        r[key] = f"wrong {err}"; continue
                    r[key] = time_graph(lambda: [run_dp(x, w, o, bn, bk, st, split) for w in wl], 20) * 1e3 / copies
                except Exception as e:
                    r[key] = "error " + str(e)[:120]
            for progs in (132, 264):
                key = f"sk bn{bn} bk{bk} st{st} p{progs}"
                try:
                    out32.zero_(); run_sk(x, wl[0], out32, bn, bk, st, progs)
                    err = (out32 - ref).abs().max().item()
                    if err > 0.05 * ref.abs().max().item():
                        r[key] = f"wrong {err}"; continue
                    r[key] = time_graph(lambda: [run_sk(x, w, out32, bn, bk, st, progs) for w in wl], 20) * 1e3 / copies
                except Exception as e:
                    r[key] = "error " + str(e)[:120]
        nums = {k: v for k, v in r.items() if isinstance(v, float) and k not in ("floor_us", "cublas")}
        top = sorted(nums.items(), key=lambda a: a[1])[:6]
        print(f"{name} M={M}: floor {floor_us:.2f} cublas {r['cublas']:.2f} | " +
              "; ".join(f"{k} {v:.2f}" for k, v in top), flush=True)
        res[f"{name} {M}"] = r
json.dump(res, open(os.environ.get("OUT", ".") + "/m64.json", "w"), indent=1)
