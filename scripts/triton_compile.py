"""Ahead-of-time compilation of the Triton kernels for a GPU target, on a machine without a GPU.

``triton.compile`` builds a kernel for any ``GPUTarget`` on the CPU, and the triton wheel ships NVIDIA's
``ptxas``, ``cuobjdump`` and ``nvdisasm`` (``triton/backends/nvidia/bin``). :func:`compile_report` compiles each
kernel of :mod:`positional_lsh.ops._engine.triton.kernels` exactly as a launch would specialize it — the arguments of
:func:`~positional_lsh.ops._engine.triton.host.forward_launch` / ``backward_launches`` for a representative call
(``Lq = Lk = 2048``, ``T = 64``, 4 query heads over 2 key/value heads, contiguous inputs) bound by triton's own
binder — and reads from the cubin:

* registers, stack (local memory per thread) and shared memory (``cuobjdump --dump-resource-usage``; the dynamic
  shared memory the launch needs is triton's ``metadata.shared``), and the spill instructions (``STL``/``LDL``);
* the 32-bit offsets added to a kernel argument's pointer in the TTIR (:func:`narrow_offsets`; none: every index
  that can pass ``2^31`` is 64-bit);
* the SASS instruction mix (``cuobjdump -sass``) of the kernel's main loop — the innermost loop holding the
  matrix instructions (``HMMA``/``HGMMA``; for float32, whose "ieee" dots are FFMA loops, the largest loop):
  static counts per class (matrix, integer/compare/select, float, special function, conversion, memory, other).

Triton's interpreter (``TRITON_INTERPRET=1``) replaces the kernels by Python functions, which cannot be compiled:
run this in a process without it (``scripts/triton_resources.py`` and ``tests/ops/engine/test_triton_compile.py`` do).

Developer tooling, not used at run time (not in the wheel): ``scripts/triton_resources.py`` imports it.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from positional_lsh.ops._engine.triton.host import Launch, backward_launches, forward_launch
from positional_lsh.ops._engine.triton.plan import BlockConfig, TritonLayout, block_config, build_layout

__all__ = [
    "ARCHS",
    "DKDV_CANDIDATES",
    "DTYPES",
    "HEAD_DIMS",
    "KERNELS_FWD_DQ",
    "SHARED_LIMIT",
    "TILE_CANDIDATES",
    "KernelReport",
    "compile_report",
    "narrow_offsets",
    "sass_classes",
    "search_config",
    "tool",
]

ARCHS = (80, 90)
"""The checked architectures: sm_80 (A100) and sm_90 (H100/H200)."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (64, 128)
SHARED_LIMIT = {80: 166912, 90: 232448}
"""The largest shared memory one block may use (bytes): 163 KiB on sm_80, 227 KiB on sm_90."""

_MMA = ("HMMA", "HGMMA", "IMMA", "DMMA", "WGMMA", "UTCHMMA")
_INT = (
    "IADD3", "IADD", "IMAD", "ISETP", "LOP3", "LOP", "SHF", "SHL", "SHR", "SEL", "IMNMX", "IABS", "LEA", "PRMT",
    "FLO", "POPC", "BMSK", "BREV", "VIADD", "VIMNMX", "VIADDMNMX", "ISCADD", "ICMP", "IDP", "PLOP3", "P2R", "R2P",
)  # fmt: skip
_FLOAT = ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK", "HADD2", "HMUL2", "HFMA2", "HMNMX2", "FSWZADD")
_MUFU = ("MUFU",)
_CONV = ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "FRND")
_MEM = ("LDG", "STG", "LDS", "STS", "LDSM", "LDGSTS", "LDL", "STL", "ATOM", "RED", "LD", "ST", "UTMALDG", "STSM")


@dataclass(frozen=True)
class KernelReport:
    """One compiled kernel (see the module docstring)."""

    kernel: str
    arch: int
    dtype: str
    head_dim: int
    causal: bool
    config: dict[str, int]
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    shared: int
    narrow_offsets: int = 0
    loop_mix: dict[str, int] = field(default_factory=dict)
    dist_grad: bool = False
    """The ``dq`` kernel with its ``DIST_GRAD`` switch on (the slope gradient's ``sum dS |i - j|``)."""

    @property
    def spills(self) -> bool:
        return self.stack > 0 or self.spill_stores > 0 or self.spill_loads > 0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def tool(name: str) -> str:
    """The path of one of the NVIDIA tools the triton wheel ships (``ptxas``, ``cuobjdump``, ``nvdisasm``)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


_N, _HQ, _HKV, _T = 2048, 4, 2, 64


@functools.lru_cache(maxsize=8)
def _layout(causal: bool, config: BlockConfig) -> TritonLayout:
    from positional_lsh.ops.partitions.partition import sample_partitions

    parts = sample_partitions(_N, None, _T, num_heads=_HQ, generator=0)
    return build_layout(parts, _N, causal, config, torch.device("cpu"))


def _launches(dtype: torch.dtype, head_dim: int, causal: bool, config: BlockConfig) -> list[tuple[str, bool, Launch]]:
    """``(kernel, dist_grad, launch)`` of a representative call: the three launches, and the ``dq`` launch with the
    slope gradient's switch on (CPU tensors: only their dtypes, shapes and alignment count)."""
    n, hq, hkv = _N, _HQ, _HKV
    layout = _layout(causal, config)
    q = torch.empty((1, hq, n, head_dim), dtype=dtype)
    k, v = (torch.empty((1, hkv, n, head_dim), dtype=dtype) for _ in range(2))
    out, lse = torch.empty_like(q), torch.empty((1, hq, n), dtype=torch.float32)
    delta = torch.empty_like(lse)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    dq_launch, dkdv_launch = backward_launches(layout, (q, k, v, out, lse), out, delta, grads, 0.1)
    dist = torch.empty((1, hq, layout.num_tiles), dtype=torch.float32)
    dq_dist, _ = backward_launches(layout, (q, k, v, out, lse), out, delta, grads, 0.1, dist)
    fwd = forward_launch(layout, q, k, v, out, lse, 0.1)
    return [("fwd_kernel", False, fwd), ("bwd_dq_kernel", False, dq_launch), ("bwd_dq_kernel", True, dq_dist),
            ("bwd_dkdv_kernel", False, dkdv_launch)]  # fmt: skip


def _compile(launch: Launch, arch: int) -> Any:
    """``triton.compile`` of a launch for ``sm_<arch>``, specialized by triton's binder as a launch would be."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = launch.kernel
    if not isinstance(fn, JITFunction):
        raise RuntimeError("the kernels are interpreted (TRITON_INTERPRET=1): compile them in a process without it")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**launch.constexprs, **launch.options}
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def _resources(cubin: bytes, sass: bool = True) -> dict[str, Any]:
    """Registers, stack, local and static shared memory of a cubin, and its SASS (``""`` when ``sass`` is false
    and the kernel has neither stack nor local memory: then it holds no spill instruction, ``STL``/``LDL`` being
    accesses to local memory, so the disassembly, most of the time of a cached compile, is skipped)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(cubin)
        path = fh.name
    try:
        usage = subprocess.run(
            [tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
        found = {key: int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
        text = ""
        if sass or found["STACK"] or found["LOCAL"]:
            text = subprocess.run([tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    return {"registers": found["REG"], "stack": found["STACK"], "static_shared": found["SHARED"], "sass": text}


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?\s*([^;]*);")


def _instructions(sass: str) -> list[tuple[int, str, str]]:
    """``(address, opcode, operands)`` of every SASS instruction."""
    return [(int(a, 16), op, rest) for a, op, _, rest in _LINE.findall(sass)]


def sass_classes(opcodes: list[str]) -> dict[str, int]:
    """Counts of SASS opcodes per class: ``mma``, ``int`` (integer, compare, select, predicate logic), ``float``,
    ``mufu`` (special functions: exp2, log2, rcp), ``conv`` (conversions), ``mem`` and ``other``; uniform-datapath
    (per-warp scalar) instructions are counted apart as ``uniform``."""
    out = dict.fromkeys(("mma", "int", "float", "mufu", "conv", "mem", "uniform", "other"), 0)
    for op in opcodes:
        if op.startswith("U") and op not in _MMA and op[1:] in (*_INT, "MOV", "IADD3", "ISETP", "SEL", "LOP3"):
            key = "uniform"
        elif op in _MMA:
            key = "mma"
        elif op in _INT:
            key = "int"
        elif op in _FLOAT:
            key = "float"
        elif op in _MUFU:
            key = "mufu"
        elif op in _CONV:
            key = "conv"
        elif op in _MEM:
            key = "mem"
        else:
            key = "other"
        out[key] += 1
    return out


_SSA = re.compile(r"^\s*(%[\w#]+)(?::\d+)? = ([\w.]+) (%[\w#]+)")


def narrow_offsets(ttir: str) -> list[str]:
    """The ``tt.addptr`` lines of a TTIR module that add a 32-bit offset to a kernel argument's pointer (directly or
    through ``tt.splat``/``tt.broadcast``/``tt.expand_dims``): the indexing that wraps around past ``2^31``
    elements. Pointers already moved by a 64-bit offset may take small 32-bit ones (a column within a row)."""
    base: set[str] = set()  # the arguments and their splats
    out = []
    for line in ttir.splitlines():
        if "tt.func" in line:
            base |= set(re.findall(r"(%[\w#]+): !tt\.ptr", line))
            continue
        m = _SSA.match(line)
        if not m:
            continue
        result, op, first = m.groups()
        if op in ("tt.splat", "tt.broadcast", "tt.expand_dims") and first in base:
            base.add(result)
        elif op == "tt.addptr" and first in base:
            offset_type = re.sub(r"\s+loc\(.*$", "", line).rsplit(", ", 1)[-1]
            if not re.search(r"i64>?$", offset_type.strip()):
                out.append(line.strip())
    return out


def _main_loop(instrs: list[tuple[int, str, str]]) -> list[str]:
    """Opcodes of the innermost loop (a backward branch's range) that holds matrix instructions."""
    loops = []
    for addr, op, rest in instrs:
        if op in ("BRA", "JMP"):
            m = re.search(r"0x([0-9a-f]+)", rest)
            if m and int(m.group(1), 16) < addr:
                loops.append((int(m.group(1), 16), addr))
    best = None
    for lo, hi in loops:
        ops = [op for a, op, _ in instrs if lo <= a <= hi]
        if any(op in _MMA for op in ops) and (best is None or hi - lo < best[1] - best[0]):
            best = (lo, hi)
    if best is None and loops:  # no matrix instructions (float32 "ieee" dots are FFMA loops): the largest loop
        best = max(loops, key=lambda span: span[1] - span[0])
    if best is None:
        return []
    return [op for a, op, _ in instrs if best[0] <= a <= best[1]]


def compile_report(
    arch: int,
    dtype: torch.dtype,
    head_dim: int,
    causal: bool,
    config: BlockConfig | None = None,
    kernels: tuple[str, ...] = ("fwd_kernel", "bwd_dq_kernel", "bwd_dkdv_kernel"),
    dist_grad: bool = False,
    sass: bool = True,
) -> list[KernelReport]:
    """Compile ``kernels`` for ``sm_<arch>`` at ``config`` (default: the block table's for this arch, dtype and head
    dim) and read their resources and main-loop instruction mix; with ``dist_grad`` also the ``dq`` kernel with
    the slope gradient's switch on (a report with ``dist_grad=True``, after the plain one). ``sass=False``: no
    instruction mix (``loop_mix`` empty), and no disassembly of a kernel without stack or local memory (it has no
    spill instruction: its spill counts are 0); the other fields are the same."""
    config = config or block_config(dtype, head_dim, arch)
    reports = []
    for name, dist, launch in _launches(dtype, head_dim, causal, config):
        if name not in kernels or (dist and not dist_grad):
            continue
        compiled = _compile(launch, arch)
        res = _resources(compiled.asm["cubin"], sass)
        instrs = _instructions(res["sass"])
        ops = [op for _, op, _ in instrs]
        reports.append(
            KernelReport(
                kernel=name,
                arch=arch,
                dtype=str(dtype).removeprefix("torch."),
                head_dim=head_dim,
                causal=causal,
                config=asdict(config),
                registers=res["registers"],
                stack=res["stack"],
                spill_stores=ops.count("STL"),
                spill_loads=ops.count("LDL"),
                shared=int(compiled.metadata.shared),
                narrow_offsets=len(narrow_offsets(compiled.asm["ttir"])),
                loop_mix=sass_classes(_main_loop(instrs)) if sass else {},
                dist_grad=dist,
            )
        )
    return reports


def _near_for(block_n: int) -> int:
    """The near width for ``block_n``: the smallest multiple of it that is at least 96 keys."""
    return -(-96 // block_n) * block_n


TILE_CANDIDATES = ((64, 64, 4, 2), (64, 32, 4, 2), (64, 32, 4, 1), (64, 16, 4, 1), (32, 16, 4, 1))
"""``(block_m, block_n, num_warps, num_stages)`` of the forward and ``dq`` kernels, in order of preference."""
DKDV_CANDIDATES = (
    (64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 4, 2), (64, 32, 8, 2), (32, 64, 8, 2), (32, 32, 8, 2), (32, 32, 4, 2),
    (32, 32, 8, 1), (16, 32, 4, 1), (32, 16, 8, 2), (32, 16, 4, 2), (16, 16, 2, 1), (16, 16, 4, 1),
)  # fmt: skip
"""``(dkdv_m, dkdv_n, dkdv_warps, dkdv_stages)`` of the ``dk, dv`` kernel, in order of preference."""


def _cost(reports: list[KernelReport], arch: int) -> tuple[int, int]:
    """``(0, 0)`` for clean kernels; else how far from it: over-limit shared memory first, then stack bytes."""
    return (sum(max(0, r.shared - SHARED_LIMIT[arch]) for r in reports), sum(r.stack for r in reports))


def search_config(arch: int, dtype: torch.dtype, head_dim: int, log: object = None) -> tuple[BlockConfig, bool]:
    """The first configuration of :data:`TILE_CANDIDATES` x :data:`DKDV_CANDIDATES` whose kernels compile for
    ``sm_<arch>`` without spills and within shared memory, causal and bidirectional: ``(config, True)``; where none
    does, the candidates with the least spilling and ``False``."""
    say = log if callable(log) else (lambda _msg: None)
    best: tuple[tuple[int, int], tuple[int, int, int, int]] | None = None
    for cand in TILE_CANDIDATES:
        bm, bn, warps, stages = cand
        cfg = BlockConfig(bm, bn, _near_for(bn), warps, stages)
        reports = [
            r for c in (True, False) for r in compile_report(arch, dtype, head_dim, c, cfg, KERNELS_FWD_DQ, sass=False)
        ]
        say(f"sm_{arch} {dtype} d={head_dim} tile {cand}: {_summary(reports)}")
        cost = _cost(reports, arch)
        if best is None or cost < best[0]:
            best = (cost, cand)
        if cost == (0, 0):
            break
    assert best is not None
    bm, bn, warps, stages = best[1]
    sub_best: tuple[tuple[int, int], tuple[int, int, int, int]] | None = None
    for sub in DKDV_CANDIDATES:
        sm, sn, dw, ds = sub
        if bm % sm or bn % sn:
            continue
        cfg = BlockConfig(bm, bn, _near_for(bn), warps, stages, sm, sn, dw, ds)
        reports = [
            r
            for c in (True, False)
            for r in compile_report(arch, dtype, head_dim, c, cfg, ("bwd_dkdv_kernel",), sass=False)
        ]
        say(f"sm_{arch} {dtype} d={head_dim} dkdv {sub}: {_summary(reports)}")
        cost = _cost(reports, arch)
        if sub_best is None or cost < sub_best[0]:
            sub_best = (cost, sub)
        if cost == (0, 0):
            break
    assert sub_best is not None
    cfg = BlockConfig(bm, bn, _near_for(bn), warps, stages, *sub_best[1])
    return cfg, best[0] == (0, 0) and sub_best[0] == (0, 0)


KERNELS_FWD_DQ = ("fwd_kernel", "bwd_dq_kernel")


def _summary(reports: list[KernelReport]) -> str:
    return ", ".join(
        f"{r.kernel}{'' if r.causal else '(bidir)'} {r.registers} regs {r.stack} B stack {r.shared // 1024} KiB"
        for r in reports
    )
