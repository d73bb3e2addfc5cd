"""Copies chosen on the device but made by the copy engine (a probe for issue 41's graph rows):
per routed place, a CUDA SWITCH conditional node (CUDA 12.8+) whose body ``e`` copies expert
``e``'s members from pinned host memory into the place's stage slot; one kernel before them
sets every place's switch from the routing on the device (``switch_copy.cu``, built with
nvcc). Compared with the same bytes copied by plain memcpy nodes (fixed sources) and by
`copy_routed`, the Triton kernel graph mode copies with today (about 48 GB/s against the copy
engine's 55 in earlier runs), and checked: the stage holds the routed experts' bytes.

    PYTHONPATH=. python3 benchmarks/switch_copy.py [--layers 8] [--route so|ptx]

Two routes to the same graph: ``so`` builds ``switch_copy.cu`` with nvcc into a library whose
``add_routed_copies`` adds the nodes; ``ptx`` does the same through ctypes (torch's CUDA
runtime for the graph, the driver for the setter kernel, whose PTX nvcc made from
``switch_setter.cu`` and is kept here), so that no compiler is needed at run time.

Written in session 43 (2026-11-30) and compiled there with nvcc 13.0 on a machine without a
GPU: not yet run on one. It prints one line per measurement and "FAILED ..." where a step
fails (the CUDA error, and where: 1000 x the step + the error code).
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# `nvcc -ptx -arch=compute_75 switch_setter.cu` (nvcc 13.0; its comment lines left out): the
# setter kernel of the "ptx" route, loaded by the driver, no compiler needed at run time
SETTER_PTX = r"""
.version 9.0
.target sm_75
.address_size 64

	// .globl	set_switches
.extern .func cudaGraphSetConditional
(
	.param .b64 cudaGraphSetConditional_param_0,
	.param .b32 cudaGraphSetConditional_param_1
)
;

.visible .entry set_switches(
	.param .align 8 .b8 set_switches_param_0[256],
	.param .u64 set_switches_param_1,
	.param .u64 set_switches_param_2,
	.param .u32 set_switches_param_3,
	.param .u32 set_switches_param_4
)
{
	.reg .pred 	%p<5>;
	.reg .b16 	%rs<2>;
	.reg .b32 	%r<8>;
	.reg .b64 	%rd<16>;


	mov.b64 	%rd1, set_switches_param_0;
	ld.param.u64 	%rd2, [set_switches_param_1];
	ld.param.u64 	%rd3, [set_switches_param_2];
	ld.param.u32 	%r5, [set_switches_param_3];
	ld.param.u32 	%r7, [set_switches_param_4];
	mov.u32 	%r1, %tid.x;
	setp.ge.s32 	%p1, %r1, %r5;
	@%p1 bra 	$L__BB0_5;

	setp.eq.s64 	%p2, %rd3, 0;
	@%p2 bra 	$L__BB0_3;

	cvt.s64.s32 	%rd4, %r1;
	cvta.to.global.u64 	%rd5, %rd3;
	add.s64 	%rd6, %rd5, %rd4;
	ld.global.u8 	%rs1, [%rd6];
	setp.eq.s16 	%p3, %rs1, 0;
	@%p3 bra 	$L__BB0_4;

$L__BB0_3:
	cvta.to.global.u64 	%rd7, %rd2;
	mul.wide.s32 	%rd8, %r1, 8;
	add.s64 	%rd9, %rd7, %rd8;
	cvt.u64.u32 	%rd10, %r7;
	ld.global.u64 	%rd11, [%rd9];
	setp.lt.u64 	%p4, %rd11, %rd10;
	cvt.u32.u64 	%r6, %rd11;
	selp.b32 	%r7, %r6, %r7, %p4;

$L__BB0_4:
	mul.wide.s32 	%rd13, %r1, 8;
	add.s64 	%rd14, %rd1, %rd13;
	ld.param.u64 	%rd15, [%rd14];
	{ // callseq 0, 0
	.reg .b32 temp_param_reg;
	.param .b64 param0;
	st.param.b64 	[param0+0], %rd15;
	.param .b32 param1;
	st.param.b32 	[param1+0], %r7;
	call.uni
	cudaGraphSetConditional,
	(
	param0,
	param1
	);
	} // callseq 0

$L__BB0_5:
	ret;

}
"""


class _Cond(ctypes.Structure):  # cudaConditionalNodeParams (CUDA 13: 24 bytes)
    _fields_ = [("handle", ctypes.c_ulonglong), ("type", ctypes.c_int), ("size", ctypes.c_uint),
                ("phGraph_out", ctypes.c_void_p)]  # fmt: skip


class _NodeParams(ctypes.Structure):  # cudaGraphNodeParams (256 bytes, the union at 16)
    _fields_ = [("type", ctypes.c_int), ("reserved0", ctypes.c_int * 3), ("cond", _Cond),
                ("pad", ctypes.c_byte * (232 - 24)), ("reserved2", ctypes.c_longlong)]  # fmt: skip


assert ctypes.sizeof(_NodeParams) == 256 and _NodeParams.cond.offset == 16


class PtxRoute:
    """`add_routed_copies` of switch_copy.cu through ctypes: the CUDA runtime (torch's
    libcudart) for the graph, the driver for the PTX setter kernel."""

    def __init__(self):
        torch.cuda.init()
        self.rt = ctypes.CDLL("libcudart.so.13")
        self.drv = ctypes.CDLL("libcuda.so.1")
        self.mod = ctypes.c_void_p()
        self.fn = ctypes.c_void_p()
        torch.cuda.current_stream().synchronize()  # the primary context current on this thread
        self._ok(self.drv.cuModuleLoadData(ctypes.byref(self.mod), SETTER_PTX.encode() + b"\0"),
                 "cuModuleLoadData")  # fmt: skip
        self._ok(self.drv.cuModuleGetFunction(ctypes.byref(self.fn), self.mod, b"set_switches"),
                 "cuModuleGetFunction")  # fmt: skip

    @staticmethod
    def _ok(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: CUDA error {rc}")

    def _deps(self, stream):
        status, cid, graph = ctypes.c_int(), ctypes.c_ulonglong(), ctypes.c_void_p()
        deps, edges, n = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_void_p(), ctypes.c_size_t()
        self._ok(self.rt.cudaStreamGetCaptureInfo(stream, ctypes.byref(status), ctypes.byref(cid),
                                                  ctypes.byref(graph), ctypes.byref(deps),
                                                  ctypes.byref(edges), ctypes.byref(n)),
                 "cudaStreamGetCaptureInfo")  # fmt: skip
        if status.value != 1:
            raise RuntimeError("the stream is not capturing")
        return graph, [deps[i] for i in range(n.value)]

    def add_routed_copies(self, stream, k, experts, members, src, dst, nbytes, routed, miss,
                          chain) -> int:  # fmt: skip
        stream = ctypes.c_void_p(stream.value)
        graph, _ = self._deps(stream)
        handles = (ctypes.c_ulonglong * 32)()
        for r in range(k):
            h = ctypes.c_ulonglong()
            self._ok(self.rt.cudaGraphConditionalHandleCreate(ctypes.byref(h), graph,
                                                              ctypes.c_uint(experts),
                                                              ctypes.c_uint(1)),
                     "cudaGraphConditionalHandleCreate")  # fmt: skip
            handles[r] = h.value
        args = [handles, ctypes.c_void_p(routed.value), ctypes.c_void_p(miss.value),
                ctypes.c_int(k), ctypes.c_uint(experts)]  # fmt: skip
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p)
                                                 for a in args])  # fmt: skip
        self._ok(self.drv.cuLaunchKernel(self.fn, 1, 1, 1, 32, 1, 1, 0, stream, params, None),
                 "cuLaunchKernel")  # fmt: skip
        graph, after = self._deps(stream)
        ends: list = []
        for r in range(k):
            p = _NodeParams()
            p.type = 13  # cudaGraphNodeTypeConditional
            p.cond.handle, p.cond.type, p.cond.size = handles[r], 2, experts  # a SWITCH
            d = ends[-1:] if chain and ends else after
            deps = (ctypes.c_void_p * max(len(d), 1))(*d)
            node = ctypes.c_void_p()
            self._ok(self.rt.cudaGraphAddNode(ctypes.byref(node), graph, deps, None,
                                              ctypes.c_size_t(len(d)), ctypes.byref(p)),
                     "cudaGraphAddNode")  # fmt: skip
            bodies = ctypes.cast(p.cond.phGraph_out, ctypes.POINTER(ctypes.c_void_p))
            for e in range(experts):
                for m in range(members):
                    mn = ctypes.c_void_p()
                    self._ok(self.rt.cudaGraphAddMemcpyNode1D(
                        ctypes.byref(mn), ctypes.c_void_p(bodies[e]), None, ctypes.c_size_t(0),
                        ctypes.c_void_p(dst[r * members + m]),
                        ctypes.c_void_p(src[e * members + m]), ctypes.c_size_t(nbytes[m]),
                        ctypes.c_int(1)), "cudaGraphAddMemcpyNode1D")  # fmt: skip
            if chain and ends:
                ends[-1] = node.value
            else:
                ends.append(node.value)
        nodes = (ctypes.c_void_p * len(ends))(*ends)
        self._ok(self.rt.cudaStreamUpdateCaptureDependencies(stream, nodes, None,
                                                             ctypes.c_size_t(len(ends)),
                                                             ctypes.c_uint(1)),
                 "cudaStreamUpdateCaptureDependencies")  # fmt: skip
        return 0


def build(nvcc: str) -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp()) / "libswitch.so"
    src = Path(__file__).with_name("switch_copy.cu")
    cmd = [nvcc, "-O2", "-arch=sm_90", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared",
           "-o", str(out), str(src)]  # fmt: skip
    subprocess.run(cmd, check=True)
    torch.cuda.init()  # torch's libcudart.so.13 first: the library binds to the same one
    lib = ctypes.CDLL(str(out))
    lib.add_routed_copies.restype = ctypes.c_int
    return lib


def array(kind, values):
    return (kind * len(values))(*values)


def time_graph(g: torch.cuda.CUDAGraph, n: int = 20) -> float:
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(n):
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--route", choices=["so", "ptx"], default="so",
                   help="so: switch_copy.cu built with nvcc; ptx: ctypes and the PTX setter "
                        "(no compiler at run time)")  # fmt: skip
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 0
    if args.route == "so":
        lib = build(shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    else:
        lib = PtxRoute()
    dev = torch.device("cuda")
    E, K = args.experts, args.k
    sizes = [2 * args.width * args.hidden * 2, args.width * args.hidden * 2]  # gate_up, down
    expert = sum(sizes)
    host = torch.empty(E, expert, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.arange(E, dtype=torch.uint8).unsqueeze(1).expand(E, expert))
    stage = torch.zeros(K, expert, dtype=torch.uint8, device=dev)
    routed = torch.randperm(E)[:K].to(dev)
    miss = torch.ones(K, dtype=torch.uint8, device=dev)
    src = array(ctypes.c_ulonglong, [host[e].data_ptr() + off for e in range(E)
                                     for off in (0, sizes[0])])  # fmt: skip
    dst = array(ctypes.c_ulonglong, [stage[r].data_ptr() + off for r in range(K)
                                     for off in (0, sizes[0])])  # fmt: skip
    nbytes = array(ctypes.c_ulonglong, sizes)
    side = torch.cuda.Stream()
    print(f"{torch.__version__}, {torch.cuda.get_device_name()}, {E} experts of {expert} bytes, "
          f"{K} routed", flush=True)  # fmt: skip

    def capture(fn):
        side.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        with torch.cuda.graph(g, stream=side):
            fn()
        return g, time.perf_counter() - t0

    def switches(layers: int, chain: int, with_miss: bool = True):
        def fn():
            for _ in range(layers):
                rc = lib.add_routed_copies(
                    ctypes.c_void_p(side.cuda_stream), K, E, 2, src, dst, nbytes,
                    ctypes.c_void_p(routed.data_ptr()),
                    ctypes.c_void_p(miss.data_ptr() if with_miss else None), chain,
                )  # fmt: skip
                if rc:
                    raise RuntimeError(f"add_routed_copies: {rc}")
                stage[:, :1].add_(0)  # a kernel between layers, as a block's compute

        return fn

    def report(name, ms, layers=1):
        gbs = K * expert * layers / ms / 1e6
        print(f"{name}: {ms:.3f} ms, {gbs:.1f} GB/s of routed bytes", flush=True)

    try:
        chosen = routed.tolist()  # read before the capture (a read inside would sync)

        def plain():
            for r in range(K):
                stage[r].copy_(host[chosen[r]], non_blocking=True)

        g, _ = capture(plain)
        report("memcpy nodes, fixed sources (copy engine)", time_graph(g))
        from torchoffload.moe._kernels import copy_routed

        srcs = torch.tensor([[host[chosen[r]].data_ptr() + o for o in (0, sizes[0])]
                             for r in range(K)], dtype=torch.int64, device=dev)  # fmt: skip
        dsts = torch.tensor([[stage[r].data_ptr() + o for o in (0, sizes[0])] for r in range(K)],
                            dtype=torch.int64, device=dev)  # fmt: skip
        flag = torch.ones(K, dtype=torch.bool, device=dev)
        no = torch.zeros(K, dtype=torch.bool, device=dev)
        copy_routed(srcs, dsts, flag, dsts, no, sizes)  # compiled outside the capture
        g, _ = capture(lambda: copy_routed(srcs, dsts, flag, dsts, no, sizes))
        report("copy_routed, the Triton kernel (SMs read mapped host memory)", time_graph(g))
        for chain in (0, 1):
            stage.zero_()
            g, took = capture(switches(1, chain))
            ms = time_graph(g)
            ok = all(bool((stage[r] == int(routed[r])).all()) for r in range(K))
            report(f"switch nodes, 1 layer, {'chained' if chain else 'side by side'} "
                   f"(captured in {took:.2f} s; stage right: {ok})", ms)  # fmt: skip
            routed.copy_(torch.randperm(E)[:K].to(dev))
            g.replay()
            torch.cuda.synchronize()
            ok = all(bool((stage[r] == int(routed[r])).all()) for r in range(K))
            print(f"  routed again, replayed: stage right: {ok}", flush=True)
        g, took = capture(switches(args.layers, 0))
        report(f"switch nodes, {args.layers} layers (captured in {took:.2f} s)",
               time_graph(g, 5), args.layers)  # fmt: skip
        miss.zero_()
        ms = time_graph(g, 5)
        print(f"  no miss: {ms:.3f} ms ({ms / args.layers * 1e3:.1f} us a layer: the set kernel "
              "and the switches alone, and the kernel between)", flush=True)  # fmt: skip
    except Exception as e:  # a probe: report and stop
        print(f"FAILED: {type(e).__name__}: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
