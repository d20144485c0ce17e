"""The compile checks of the Triton kernels: every kernel compiled ahead of time for sm_80 and sm_90 (no GPU needed),
over {bf16, fp16, fp32} x d in {64, 128} x {causal, bidirectional}, and the ``dq`` kernel again with its
slope-gradient switch on (``DIST_GRAD``), at the configurations the dispatch chooses (``BLOCK_TABLE``): no spills
in bf16/fp16 at d <= 128, shared memory within the architecture's limit, and no 32-bit offset added to a kernel
argument's pointer (the TTIR), so that no index wraps past 2^31 elements.

The kernels are compiled in a subprocess with ``TRITON_INTERPRET=0`` (this suite runs them interpreted):
``scripts/triton_resources.py``, the script whose table docs/implementation.md shows, with ``--no-sass``: no
instruction mix, and no disassembly of a kernel without stack or local memory (it has no spill instruction). The 96
compilations took 76 s with an empty Triton cache and 5 s from the cache (two cores; the disassembly took 13 s more).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from positional_lsh.ops._engine.triton.plan import block_config

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))  # the compile tooling is developer tooling in scripts/, not in the package
from triton_compile import SHARED_LIMIT  # noqa: E402

ENV = {**os.environ, "TRITON_INTERPRET": "0"}
KERNELS = ("fwd_kernel", "bwd_dq_kernel", "bwd_dkdv_kernel")


def test_every_kernel_compiles_without_spills_for_sm80_and_sm90(tmp_path):
    out = tmp_path / "resources.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "triton_resources.py"), "--json", str(out), "--no-sass",
           "--jobs", str(os.cpu_count() or 1)]  # fmt: skip
    run = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    variants = [(name, False) for name in KERNELS] + [("bwd_dq_kernel", True)]  # and dq with the slope gradient
    cases = itertools.product((80, 90), ("bfloat16", "float16", "float32"), (64, 128), (True, False))
    grid = {(*kernel, *case) for kernel, case in itertools.product(variants, cases)}
    keys = [(r["kernel"], r["dist_grad"], r["arch"], r["dtype"], r["head_dim"], r["causal"]) for r in rows]
    assert len(keys) == len(grid) and set(keys) == grid
    for r in rows:
        what = f"{r['kernel']} dist_grad={r['dist_grad']} sm_{r['arch']} {r['dtype']} d={r['head_dim']}"
        what += f" causal={r['causal']}"
        assert r["config"] == asdict(block_config(getattr(torch, r["dtype"]), r["head_dim"], r["arch"])), what
        assert 0 < r["registers"] <= 255, what
        assert r["shared"] <= SHARED_LIMIT[r["arch"]], f"{what}: {r['shared']} B shared"
        assert r["narrow_offsets"] == 0, f"{what}: 32-bit offsets on an argument's pointer"
        if r["dtype"] != "float32":
            assert r["stack"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{what} spills: {r}"


_OFFSETS = """
import os
os.environ["TRITON_INTERPRET"] = "0"
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import sys
sys.path.insert(0, {scripts!r})
from triton_compile import narrow_offsets

@triton.jit
def narrow(X, Y, stride, BLOCK: tl.constexpr):  # the old kernels' indexing: b * stride in int32
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    tl.store(Y + b * stride + offs, tl.load(X + b * stride + offs))

@triton.jit
def wide(X, Y, stride, BLOCK: tl.constexpr):  # the kernels' indexing now: the large part in int64
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    tl.store(Y + b * stride + offs, tl.load(X + b * stride + offs))

sig = {"X": "*bf16", "Y": "*bf16", "stride": "i32", "BLOCK": "constexpr"}
for fn in (narrow, wide):
    k = triton.compile(ASTSource(fn, sig, {"BLOCK": 64}), target=GPUTarget("cuda", 90, 32))
    print(len(narrow_offsets(k.asm["ttir"])))
"""


def test_the_offset_check_catches_32_bit_indexing(tmp_path):
    script = tmp_path / "offsets.py"  # triton reads a kernel's source from its file
    script.write_text(_OFFSETS.replace("{scripts!r}", repr(str(ROOT / "scripts"))))
    run = subprocess.run([sys.executable, str(script)], env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    narrow, wide = (int(x) for x in run.stdout.split())
    assert narrow == 2 and wide == 0  # the load's and the store's pointer
