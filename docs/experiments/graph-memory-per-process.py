"""Can a rank count its CUDA graphs' driver memory per process (NVML) instead of device-wide?

engine/graphs.py counts an executable graph's driver memory as the fall in the device's free
memory (`torch.cuda.mem_get_info`) across its instantiate and upload, less the caching
allocator's growth. Another process allocating on the same GPU at that moment is counted too
(the 2026-12-07 GPU-suite failure: "I9 violated: rank 0 holds 86114304 graph bytes, above the
reserve of 23199744"). NVML's per-process used memory
(`nvmlDeviceGetComputeRunningProcesses`) would not see the neighbour, if it is reported at all
inside a container and if it moves with graph instantiate/upload.

Run on a GPU machine: `python3 docs/experiments/graph-memory-per-process.py [--neighbour]`.
With --neighbour a second process allocates and frees 64 MiB blocks in a loop meanwhile.
Prints, per graph: the device-wide measure, the NVML per-process measure, and NVML's
granularity.
"""

import argparse
import json
import multiprocessing as mp
import os
import time


def neighbour(stop) -> None:
    import torch

    while not stop.is_set():
        block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        del block
        torch.cuda.empty_cache()
        time.sleep(0.001)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--neighbour", action="store_true")
    parser.add_argument("--graphs", type=int, default=6)
    args = parser.parse_args()

    import pynvml
    import torch

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    pid = os.getpid()

    def mine() -> int | None:
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid:
                return p.usedGpuMemory
        return None

    spawn = mp.get_context("spawn")  # a CUDA process: no fork
    stop = spawn.Event()
    other = None
    if args.neighbour:
        other = spawn.Process(target=neighbour, args=(stop,))
        other.start()
        time.sleep(3)

    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    rows = []
    for i in range(args.graphs):
        kernels = 500 * (i + 1)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin()
            y = x
            for _ in range(kernels):
                y = y * 1.0001
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        free0, res0, nvml0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved(), mine()
        graph.instantiate()
        graph.replay()  # the first launch uploads
        torch.cuda.synchronize()
        free1, res1, nvml1 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved(), mine()
        rows.append({"kernels": kernels,
                     "device_wide_bytes": (free0 - free1) - (res1 - res0),
                     "nvml_process_bytes": None if nvml0 is None or nvml1 is None
                     else (nvml1 - nvml0) - (res1 - res0),
                     "nvml_used": nvml1})
    if other is not None:
        stop.set()
        other.join()
    print(json.dumps({"neighbour": args.neighbour, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
