"""The CUDA driver API through ctypes, as much of it as the hazard probes need.

ctypes releases the GIL for the whole of every foreign call, so a probe thread blocked inside
the driver never stops the probe's other threads (the one that releases the spinning kernel,
the one that times the call): what a probe measures is the driver, not Python. Nothing here
runs at import: `Driver()` loads libcuda.so.1, so this module imports on a machine without CUDA.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile

# A kernel that spins, bounded in the kernel itself, and an empty kernel for probe graphs.
# spin(flag, out, max_ns): writes 1 to out[0:4] once running, then spins until the u32 at
# `flag` (pinned host memory, set by the host to release it) is non-zero (reason 2) or
# %globaltimer says max_ns nanoseconds passed (reason 3: the in-kernel bound, so no probe can
# wedge the GPU past it); then writes the ns spun to out[8:16] and the reason to out[4:8].
PTX = r"""
.version 8.0
.target sm_90
.address_size 64

.visible .entry spin(.param .u64 flag, .param .u64 out, .param .u64 max_ns)
{
    .reg .pred p;
    .reg .b32 r<4>;
    .reg .b64 rd<10>;
    ld.param.u64 rd1, [flag];
    ld.param.u64 rd2, [out];
    ld.param.u64 rd3, [max_ns];
    mov.u64 rd4, %globaltimer;
    mov.u32 r1, 1;
    st.volatile.u32 [rd2], r1;
    membar.sys;
LOOP:
    ld.volatile.u32 r2, [rd1];
    setp.ne.u32 p, r2, 0;
    @p bra RELEASED;
    mov.u64 rd5, %globaltimer;
    sub.u64 rd6, rd5, rd4;
    setp.ge.u64 p, rd6, rd3;
    @p bra BOUND;
    nanosleep.u32 500;
    bra LOOP;
RELEASED:
    mov.u32 r3, 2;
    bra DONE;
BOUND:
    mov.u32 r3, 3;
DONE:
    mov.u64 rd7, %globaltimer;
    sub.u64 rd8, rd7, rd4;
    st.volatile.u64 [rd2+8], rd8;
    membar.sys;
    st.volatile.u32 [rd2+4], r3;
    membar.sys;
    ret;
}

.visible .entry noop()
{
    ret;
}
"""

STREAM_NON_BLOCKING = 0x1       # CU_STREAM_NON_BLOCKING: no implicit sync with stream 0
CAPTURE_THREAD_LOCAL = 1        # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, as the engine captures
HOSTALLOC_PORTABLE_DEVICEMAP = 0x1 | 0x2  # CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
SUCCESS = 0
NOT_READY = 600                 # CUDA_ERROR_NOT_READY (cuStreamQuery on a busy stream)


class DriverError(RuntimeError):
    """A driver call returned an error; the message names the call and the error."""


def cubin_from_ptx(ptx: str) -> bytes | None:
    """Compile `ptx` for sm_90 with the ptxas that Triton ships (or one on PATH); None if
    there is none, and the caller loads the PTX text instead (the driver JIT-compiles it)."""
    candidates = [os.environ.get("TRITON_PTXAS_PATH")]
    try:
        import triton
        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                       "bin", "ptxas"))
    except ImportError:
        pass
    candidates.append(shutil.which("ptxas"))
    for exe in filter(None, candidates):
        if not os.access(exe, os.X_OK):
            continue
        with tempfile.TemporaryDirectory() as d:
            src, dst = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
            with open(src, "w") as f:
                f.write(ptx)
            done = subprocess.run([exe, "-arch=sm_90", src, "-o", dst], capture_output=True)
            if done.returncode == 0:
                with open(dst, "rb") as f:
                    return f.read()
    return None


class Driver:
    """libcuda.so.1 with checked calls. Every method raises DriverError on a non-zero result,
    except `query` and `try_call`, which return the code."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.check("cuInit", 0)

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(name))
        return (name.value or b"?").decode()

    def try_call(self, fn: str, *args) -> int:
        return getattr(self.lib, fn)(*args)

    def check(self, fn: str, *args) -> None:
        code = getattr(self.lib, fn)(*args)
        if code != SUCCESS:
            raise DriverError(f"{fn} failed: {self.error_name(code)} ({code})")

    # contexts: the primary context, which the runtime (torch) shares
    def primary_context(self, device: int) -> ctypes.c_void_p:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check("cuDeviceGet", ctypes.byref(dev), device)
        self.check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        return ctx

    def set_context(self, ctx: ctypes.c_void_p) -> None:
        self.check("cuCtxSetCurrent", ctx)

    def driver_version(self) -> int:
        v = ctypes.c_int()
        self.check("cuDriverGetVersion", ctypes.byref(v))
        return v.value

    # memory
    def mem_get_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def mem_alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self.check("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return ptr.value

    def mem_free(self, ptr: int) -> None:
        self.check("cuMemFree_v2", ctypes.c_uint64(ptr))

    def host_alloc(self, nbytes: int) -> tuple[int, int]:
        """Pinned, mapped host memory: (host address, device address)."""
        host, dev = ctypes.c_void_p(), ctypes.c_uint64()
        self.check("cuMemHostAlloc", ctypes.byref(host), ctypes.c_size_t(nbytes),
                   HOSTALLOC_PORTABLE_DEVICEMAP)
        ctypes.memset(host, 0, nbytes)
        self.check("cuMemHostGetDevicePointer_v2", ctypes.byref(dev), host, 0)
        return host.value, dev.value

    def host_free(self, host: int) -> None:
        self.check("cuMemFreeHost", ctypes.c_void_p(host))

    # modules and launches
    def module_load(self, image: bytes) -> ctypes.c_void_p:
        mod = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(image)  # NUL-terminated for PTX text
        self.check("cuModuleLoadData", ctypes.byref(mod), buf)
        return mod

    def module_unload(self, mod: ctypes.c_void_p) -> None:
        self.check("cuModuleUnload", mod)

    def function(self, mod: ctypes.c_void_p, name: str) -> ctypes.c_void_p:
        fn = ctypes.c_void_p()
        self.check("cuModuleGetFunction", ctypes.byref(fn), mod, name.encode())
        return fn

    def launch(self, fn: ctypes.c_void_p, stream: ctypes.c_void_p, *u64_args: int) -> None:
        """One block of one thread; every argument is a 64-bit value."""
        vals = [ctypes.c_uint64(a) for a in u64_args]
        params = (ctypes.c_void_p * max(1, len(vals)))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        self.check("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, stream,
                   params if vals else None, None)

    # streams
    def stream(self) -> ctypes.c_void_p:
        s = ctypes.c_void_p()
        self.check("cuStreamCreate", ctypes.byref(s), STREAM_NON_BLOCKING)
        return s

    def stream_destroy(self, s: ctypes.c_void_p) -> None:
        self.check("cuStreamDestroy_v2", s)

    def query(self, s: ctypes.c_void_p) -> int:
        return self.lib.cuStreamQuery(s)

    def sync(self, s: ctypes.c_void_p) -> None:
        self.check("cuStreamSynchronize", s)

    # graphs
    def begin_capture(self, s: ctypes.c_void_p) -> None:
        self.check("cuStreamBeginCapture_v2", s, CAPTURE_THREAD_LOCAL)

    def end_capture(self, s: ctypes.c_void_p) -> ctypes.c_void_p:
        g = ctypes.c_void_p()
        self.check("cuStreamEndCapture", s, ctypes.byref(g))
        return g

    def instantiate(self, graph: ctypes.c_void_p) -> ctypes.c_void_p:
        e = ctypes.c_void_p()
        self.check("cuGraphInstantiateWithFlags", ctypes.byref(e), graph, ctypes.c_ulonglong(0))
        return e

    def upload(self, exec_: ctypes.c_void_p, s: ctypes.c_void_p) -> None:
        self.check("cuGraphUpload", exec_, s)

    def graph_launch(self, exec_: ctypes.c_void_p, s: ctypes.c_void_p) -> None:
        self.check("cuGraphLaunch", exec_, s)

    def exec_destroy(self, exec_: ctypes.c_void_p) -> None:
        self.check("cuGraphExecDestroy", exec_)

    def graph_destroy(self, graph: ctypes.c_void_p) -> None:
        self.check("cuGraphDestroy", graph)

    def capture_graph(self, s: ctypes.c_void_p, fn: ctypes.c_void_p, nodes: int
                      ) -> ctypes.c_void_p:
        """A graph of `nodes` launches of the argument-less kernel `fn`, captured on `s`."""
        self.begin_capture(s)
        try:
            for _ in range(nodes):
                self.launch(fn, s)
        finally:
            g = self.end_capture(s)
        return g


def open_device(index: int, watchdog_s: float):
    """Check ``index`` names a CUDA device, arm the process watchdog (``watchdog_s`` seconds,
    then the process dies with a traceback), make the device current with torch's context
    created, and return (torch device, Driver, that device's primary context).

    Raises:
        SystemExit: the device index is out of range on this machine.
    """
    import faulthandler

    import torch

    if not 0 <= index < torch.cuda.device_count():
        raise SystemExit(f"device {index} out of range: this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    faulthandler.dump_traceback_later(watchdog_s, exit=True)
    dev = torch.device("cuda", index)
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    drv = Driver()
    return dev, drv, drv.primary_context(index)
