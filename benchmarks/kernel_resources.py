"""Registers, spills and shared memory of the decode kernels on an H100 (sm_90a), without a GPU: each variant is
compiled by Triton for that target here and assembled by the ``ptxas`` Triton ships (``-v``: its resource report).

    python benchmarks/kernel_resources.py [--out DIR]

What it answers: whether a tile fits the register file without spilling and how many programs an SM can hold
(65536 registers per SM: a 4-warp program of R registers per thread leaves room for 65536 // (128 R) programs),
which bounds the loads in flight of a memory-bound kernel. METHOD.md's "read what costs no device time". Writes
kernel_resources.json (``--out``, default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import environment  # noqa: E402
from kernel_pytorch.ops import decode_linear as DL  # noqa: E402

__all__ = ["Variant", "VARIANTS", "resources", "main"]

_TARGET = ("cuda", 90, 32)  # an H100: compute capability 9.0, 32-thread warps
_REGISTERS_PER_SM = 65536


@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel: its module and name, constexpr values, pointer dtypes (others are i32
    scalars, or fp32 where named in ``floats``), warps and stages."""

    name: str
    module: str
    kernel: str
    constexprs: dict
    pointers: dict
    floats: tuple = ()
    num_warps: int = 4
    num_stages: int = 3
    notes: str = field(default="", compare=False)


def _gemv(name: str, notes: str = "", num_stages: int = 3, num_warps: int = 4, **constexprs) -> Variant:
    base = dict(NUM_W=3, HAS_BIAS=False, USE_DOT=False, IEEE=False, UPCAST=False, NORM=False, HAS_RESIDUAL=False,
                GATED=False, KIND=0, BLOCK_M=16, BLOCK_N=8, BLOCK_K=512)
    pointers = {p: "*bf16" for p in ("X", "R", "H", "NW", "W0", "W1", "W2", "B0", "B1", "B2", "OUT")}
    return Variant(name, "kernel_pytorch.ops.decode_linear", "_grouped_gemv_kernel", {**base, **constexprs}, pointers,
                   floats=("eps",), num_warps=num_warps, num_stages=num_stages, notes=notes)


def _committed_gated_gemv(name: str, rows: int) -> Variant:
    """The fused norm + SwiGLU launch at the tile ``decode_linear.gemv_tile`` gives it for ``rows`` token rows of the
    1b model (5632 gate rows)."""
    tile = DL.gemv_tile(rows, 5632, gated=True, normed=True)
    return _gemv(name, "the committed tile", num_stages=tile.num_stages, num_warps=tile.num_warps, NUM_W=2,
                 NORM=True, HAS_RESIDUAL=True, GATED=True, USE_DOT=rows > 1, BLOCK_N=tile.block_n,
                 BLOCK_K=tile.block_k)


VARIANTS = (
    _gemv("GEMV, 1 row, 3 weights (q/k/v)", "decode_linear's one-row tile"),
    _gemv("GEMV, 1 row, 1 weight (o, down)", NUM_W=1),
    _gemv("fused GEMV, 1 row, norm + residual (q/k/v)", NORM=True, HAS_RESIDUAL=True),
    _gemv("fused GEMV, 1 row, norm + SwiGLU, 8 rows of each weight", "the first fused gate/up tile",
          NUM_W=2, NORM=True, HAS_RESIDUAL=True, GATED=True, BLOCK_N=8),
    _committed_gated_gemv("fused GEMV, 1 row, norm + SwiGLU, the committed tile", 1),
    _gemv("GEMV, 8 rows (tl.dot), 3 weights", USE_DOT=True, BLOCK_N=32),
    _gemv("fused GEMV, 8 rows (tl.dot), norm + SwiGLU, K tile 512", "spills", USE_DOT=True, BLOCK_N=16, NUM_W=2,
          NORM=True, HAS_RESIDUAL=True, GATED=True),
    _committed_gated_gemv("fused GEMV, 8 rows (tl.dot), norm + SwiGLU, the committed tile", 8),
    _gemv("fused GEMV, 8 rows (tl.dot), norm + residual, K tile 128", USE_DOT=True, BLOCK_N=32, NORM=True,
          HAS_RESIDUAL=True, BLOCK_K=128),
    Variant("decode attention split, GQA 4, head dim 128, bool mask", "kernel_pytorch.ops.decode_attention",
            "_decode_split_kernel", dict(GROUP=4, HEAD_DIM=128, MASK_KIND=1, IEEE=False, UPCAST=False, BLOCK_G=16,
                                         BLOCK_N=64, BLOCK_D=128),
            {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "MASK": "*i1", "M_OUT": "*fp32", "L_OUT": "*fp32",
             "ACC_OUT": "*fp32"}, floats=("scale_log2",)),
    Variant("decode attention combine, 128 features per program", "kernel_pytorch.ops.decode_attention",
            "_decode_combine_kernel", dict(HEAD_DIM=128, BLOCK_S=128, BLOCK_D=128),
            {"M_IN": "*fp32", "L_IN": "*fp32", "ACC_IN": "*fp32", "OUT": "*bf16"}, notes="the first combine"),
    Variant("decode attention combine, 32 features per program", "kernel_pytorch.ops.decode_attention",
            "_decode_combine_kernel", dict(HEAD_DIM=128, BLOCK_S=128, BLOCK_D=32),
            {"M_IN": "*fp32", "L_IN": "*fp32", "ACC_IN": "*fp32", "OUT": "*bf16"}, notes="the current combine"),
    Variant("RoPE + KV-cache write, head dim 128", "kernel_pytorch.ops.decode_rope_cache", "_rope_cache_kernel",
            dict(HAS_PASS=False, BLOCK_H=64, BLOCK_P=1, BLOCK_D=128),
            {p: "*bf16" for p in ("Q", "K", "V", "QO", "KC", "VC", "COS", "SIN")} | {"POS": "*i64"}, num_warps=1),
)


def _ptxas() -> list[Path]:
    """Triton's bundled ptxas binaries, newest first (PTX from a newer Triton may need the newer one)."""
    import triton

    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return [path for path in (folder / "ptxas-blackwell", folder / "ptxas") if path.exists()]


def resources(variant: Variant) -> dict:
    """{registers, spill_bytes, stack_bytes, shared_bytes, programs_per_sm} of ``variant`` on sm_90a."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(variant.module), variant.kernel)
    signature = {name: "constexpr" if name in variant.constexprs else variant.pointers.get(name) or
                 ("fp32" if name in variant.floats else "i32") for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=variant.constexprs),
                              target=GPUTarget(*_TARGET),
                              options={"num_warps": variant.num_warps, "num_stages": variant.num_stages})
    report = _assemble(compiled.asm["ptx"])
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    threads = 32 * variant.num_warps
    return {"registers": registers,
            "spill_bytes": sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)),
            "stack_bytes": int(re.search(r"(\d+) bytes stack frame", report).group(1)),
            "shared_bytes": compiled.metadata.shared,
            "programs_per_sm": _REGISTERS_PER_SM // (registers * threads)}


def _assemble(ptx: str) -> str:
    """ptxas -v's report on ``ptx`` for sm_90a, from the first bundled ptxas that accepts it."""
    errors = []
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        Path(source).write_text(ptx)
        for ptxas in _ptxas():
            done = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", source, "-o",
                                   os.path.join(folder, "kernel.cubin")], capture_output=True, text=True, check=False)
            if done.returncode == 0:
                return done.stdout + done.stderr
            why = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit code {done.returncode}"
            errors.append(f"{ptxas.name}: {why}")
    raise RuntimeError("no bundled ptxas assembled the kernel: " + "; ".join(errors or ["none found"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    rows = {}
    for variant in VARIANTS:
        rows[variant.name] = {**resources(variant), "num_warps": variant.num_warps, "num_stages": variant.num_stages,
                              "constexprs": variant.constexprs, "notes": variant.notes}
        r = rows[variant.name]
        print(f"{variant.name:58s} {r['registers']:4d} registers, {r['spill_bytes']} B spilled, "
              f"{r['shared_bytes']} B shared, {r['programs_per_sm']} programs per SM", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    device = "no GPU (compiled for sm_90a, an H100, by Triton and its ptxas)"
    payload = {"environment": {**environment(), "device": device},
               "command": " ".join(["python", "benchmarks/kernel_resources.py", *(argv or sys.argv[1:])]),
               "variants": rows}
    (args.out / "kernel_resources.json").write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
