"""Is a norm op slower inside a compiled graph than called eagerly? GPU-only times (CUDA graphs) of the
compiled op, the eager op and the launcher at 16384 x 8192 bf16, and Inductor's generated code for it
(found this way: unused kernel pointers aliasing the output made Inductor copy two full buffers).

    TORCH_LOGS=output_code python benchmarks/inspect_compiled_norm.py 2> output_code.txt
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import measure, measure_gpu_time  # noqa: E402

R = importlib.import_module("kernel_pytorch.ops.rms_norm")
L = importlib.import_module("kernel_pytorch.ops.layer_norm")


def main():
    hidden = 8192
    x = torch.randn(16384, hidden, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    cases = {
        "compiled op": torch.compile(lambda x, w: R.rms_norm(x, w, 1e-6)),
        "compiled op, residual": torch.compile(lambda x, w: R.rms_norm(x, w, 1e-6, r)[0]),
        "eager op": lambda x, w: R.rms_norm(x, w, 1e-6),
        "launcher": lambda x, w: R.rms_norm_fwd(x, w, None, 1e-6)[0],
        "compiled F.rms_norm": torch.compile(lambda x, w: torch.nn.functional.rms_norm(x, (hidden,), w, 1e-6)),
        "compiled layer_norm op": torch.compile(lambda x, w: L.layer_norm(x, w, w, 1e-6)),
        "eager layer_norm op": lambda x, w: L.layer_norm(x, w, w, 1e-6),
    }
    for name, fn in cases.items():
        gpu = measure_gpu_time(lambda fn=fn: fn(x, w))
        wall = measure(lambda fn=fn: fn(x, w), runs=20).median_ms
        print(f"{name:24s} gpu {gpu * 1e3:8.1f} us   per call (L2 flushed) {wall * 1e3:8.1f} us", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            cases["compiled layer_norm op"](x, w)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main()
