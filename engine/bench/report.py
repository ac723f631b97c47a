"""Turn the measurements into the stdout table, the JSON document and the PNG plot."""

from __future__ import annotations

import json
import subprocess

from protocol.keys import SHORT

MiB = 1024**2


def versions() -> dict:
    """torch, triton, transformers, CUDA, driver and GPU name (missing ones are None)."""
    out: dict = {}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    for mod in ("triton", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    try:
        out["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip() or None
    except (OSError, subprocess.SubprocessError):
        out["driver"] = None
    return out


def build_document(opts, ranks: list[dict], hf: list[dict], command: str) -> dict:
    """One JSON-able document: options, versions, per-rank raw results, and per-point rows
    with the HBM floor (rank 0's bytes over rank 0's measured read bandwidth) and, where rank 0
    measured its matmul rate, the roofline floor (`engine.bench.floor.roofline_seconds`)."""
    from engine.bench.floor import roofline_seconds

    r0 = ranks[0]
    bw = r0["read_bandwidth_Bps"]
    rate = r0.get("matmul_Fps")
    hf_by = {(h["batch"], h["context"]): h for h in hf}
    rows = []
    for p in r0["points"]:
        wbytes = p.get("weight_bytes", r0["weight_bytes"])
        floor_s = (wbytes + p["kv_bytes"]) / bw
        row = {"batch": p["batch"], "bucket": p["bucket"], "context": p["context"],
               "floor_ms": 1e3 * floor_s, "weight_bytes": wbytes,
               "kv_bytes": p["kv_bytes"]}
        if rate and "gemm_flops" in p:
            row.update(gemm_flops=p["gemm_flops"], attention_flops=p["attention_flops"],
                       roofline_ms=1e3 * roofline_seconds(wbytes, p["kv_bytes"],
                                                          p["gemm_flops"],
                                                          p["attention_flops"], bw, rate))
        for mode in ("graphs", "eager"):
            if mode in p:
                row[mode] = p[mode]
                row[f"{mode}_tokens_per_s"] = p["batch"] / (p[mode]["median_ms"] / 1e3)
                row[f"{mode}_x_floor"] = p[mode]["median_ms"] / row["floor_ms"]
                if "roofline_ms" in row:
                    row[f"{mode}_x_roofline"] = p[mode]["median_ms"] / row["roofline_ms"]
        if "graphs" in p and "eager" in p:
            row["graphs_over_eager"] = p["graphs"]["median_ms"] / p["eager"]["median_ms"]
        for k in ("graph", "short_fused", "short_tail", "graph_vs_eager_max_abs",
                  "logits_finite", "allreduce", "profile"):
            if k in p:
                row[k] = p[k]
        h = hf_by.get((p["batch"], p["context"]))
        if h is not None:
            row["hf_compiled"] = h
            best = row.get("graphs", row.get("eager"))
            row["hf_over_engine"] = h["median_ms"] / best["median_ms"]
        rows.append(row)
    return {"command": command, "versions": versions(),
            "options": {k: v for k, v in vars(opts).items()},
            "read_bandwidth_TBps": bw / 1e12,
            "matmul_TFLOPps": rate / 1e12 if rate else None,
            "tensor_parallel_size": len(ranks),
            "capture": [r.get("capture") for r in ranks],
            "graph_source": r0.get("graph_source"), "rows": rows, "ranks": ranks}


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def format_table(doc: dict) -> str:
    """The human-readable summary printed on stdout."""
    v = doc["versions"]
    lines = [f"lockstep bench: {doc['options'].get('preset') or doc['options'].get('model')}"
             f" | TP {doc['tensor_parallel_size']} | {v.get('gpu')} | torch {v.get('torch')}"
             f" triton {v.get('triton')} transformers {v.get('transformers')}"
             f" driver {v.get('driver')}",
             f"read bandwidth {doc['read_bandwidth_TBps']:.2f} TB/s (sum over 2 GiB bf16); "
             + (f"matmul {doc['matmul_TFLOPps']:.0f} TFLOP/s (bf16 8192^3); "
                if doc.get("matmul_TFLOPps") else "")
             + f"weights {doc['ranks'][0]['weight_bytes'] / 1e9:.3f} GB per rank",
             "floor: HBM bytes / read bandwidth; roofline: max(bytes / bandwidth, FLOPs / "
             "matmul rate) for the GEMMs, plus the same for the attention"]
    head = ("batch  ctx  graphs med/p90 ms   eager med ms  g/e    tok/s(graphs)  floor ms  "
            "x floor  roofline ms  x roof  HF compiled ms  HF/engine  HF compile s")
    lines += [head, "-" * len(head)]
    for r in doc["rows"]:
        g, e, h = r.get("graphs"), r.get("eager"), r.get("hf_compiled")
        best = g or e
        lines.append(
            f"{r['batch']:>5} {r['context']:>4}  "
            f"{_f(g and g['median_ms']):>8} / {_f(g and g['p90_ms']):<8} "
            f"{_f(e and e['median_ms']):>11}  {_f(r.get('graphs_over_eager'), '{:.2f}'):>5}  "
            f"{_f(r.get('graphs_tokens_per_s', r.get('eager_tokens_per_s')), '{:,.0f}'):>13}  "
            f"{r['floor_ms']:>8.3f}  {best['median_ms'] / r['floor_ms']:>7.2f}  "
            f"{_f(r.get('roofline_ms')):>11}  "
            f"{_f(r.get('roofline_ms') and best['median_ms'] / r['roofline_ms'], '{:.2f}'):>6}  "
            f"{_f(h and h['median_ms']):>14}  {_f(r.get('hf_over_engine'), '{:.2f}'):>9}  "
            f"{_f(h and h['compile_s'], '{:.1f}'):>12}")
    for rank, cap in enumerate(doc["capture"]):
        if cap:
            lines.append(f"rank {rank}: captured {cap.get('graphs', cap['buckets'])} graphs of "
                         f"{cap['buckets']} buckets in "
                         f"{cap['seconds']:.3f} s; graph memory (engine) {cap['graph_memory_bytes'] / MiB:.0f}"
                         f" MiB, device free memory dropped "
                         f"{cap['device_free_drop_bytes'] / MiB:.0f} MiB")
    if doc.get("graph_source"):
        lines.append(f"graphs: {doc['graph_source']}")
    short = [r for r in doc["rows"] if (r.get("graph") or "").startswith(SHORT + "@")]
    def short_form(r):
        return ("fused" if r.get("short_fused", False)
                else "tail" if r.get("short_tail", False) else "decode")

    for form, how in (("fused", "attention fused into o_proj"),
                      ("tail", "attention in the QKV launch's tail"),
                      ("decode", "no rope epilogue or unfused: the decode path's kernels")):
        rows = [r for r in short if short_form(r) == form]
        if rows:
            lines.append(f"short path ({how}) replayed at: " + ", ".join(
                f"batch {r['batch']} ctx {r['context']}" for r in rows))
    ar = [(r["batch"], r["allreduce"]) for r in doc["rows"] if "allreduce" in r]
    if ar:
        lines.append("all-reduce (graph-captured) per call: " + ", ".join(
            f"batch {b}: {a['median_us']:.1f} us ({a['bytes'] / 1024:.0f} KiB)" for b, a in ar))
    profiled = [r for r in doc["rows"] if r.get("profile")]
    if profiled:
        from engine.bench.kernel_profile import format_profile

        layers = doc["ranks"][0]["config"]["num_layers"]
        lines.append("kernel profile of rank 0 (torch profiler; GEMM times from eager "
                     "forwards, one label per GEMM module):")
        for r in profiled:
            lines += format_profile(r, layers)
    bad = [r for r in doc["rows"] if r.get("logits_finite") is False
           or (r.get("graph_vs_eager_max_abs") or 0) > 1e-2]
    for r in bad:
        lines.append(f"WARNING: batch {r['batch']}: graph logits differ from eager by "
                     f"{r.get('graph_vs_eager_max_abs')} or are not finite")
    return "\n".join(lines)


def write_json(doc: dict, path: str) -> None:
    """Write the document as indented JSON."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
        f.write("\n")


def write_plot(doc: dict, path: str) -> bool:
    """Step time vs batch (graphs, eager, HF compiled, the floors), log-log; False without
    matplotlib (nothing written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ctx in sorted({r["context"] for r in doc["rows"]}):
        rows = [r for r in doc["rows"] if r["context"] == ctx]
        b = [r["batch"] for r in rows]
        for key, style, label in (("graphs", "o-", "engine, graphs"),
                                  ("eager", "s--", "engine, eager"),
                                  ("hf_compiled", "^-", "HF StaticCache + compile")):
            pts = [(r["batch"], r[key]["median_ms"]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{label} (ctx {ctx})")
        ax.plot(b, [r["floor_ms"] for r in rows], "k:", label=f"HBM floor (ctx {ctx})")
        roof = [(r["batch"], r["roofline_ms"]) for r in rows if "roofline_ms" in r]
        if roof:
            ax.plot(*zip(*roof), "k-.", label=f"roofline floor (ctx {ctx})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (rows per decode step)")
    ax.set_ylabel("decode step, median ms")
    name = doc["options"].get("preset") or doc["options"].get("model")
    ax.set_title(f"{name}, TP {doc['tensor_parallel_size']}, {doc['versions'].get('gpu')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
