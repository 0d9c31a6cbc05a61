"""Verification: is the optimized computation the original one, within tolerance?

* :mod:`~kernel_pytorch.verify.numerics`: comparing runs (relative errors, per-dtype tolerances, the float32
  referee for low precision), re-exported here;
* :mod:`~kernel_pytorch.verify.referee`: where a float32 referee run fits (the GPU, else the host);
* :mod:`~kernel_pytorch.verify.graphs`: one captured graph against its rewrite (``capture.GraphOptimizer``);
* :mod:`~kernel_pytorch.verify.model`: the optimized model against the original, end to end (``optimize``).
"""

from kernel_pytorch.verify.numerics import (Comparison, Run, relative_error, compare, compare_against_float32,
                                            compared_counts, NoiseAwareCheck, NOISE_FACTOR, NOTHING_COMPARED,
                                            LOW_PRECISION, is_low_precision, to_float32, run_reference,
                                            flatten_tensors, call_arguments, unless_out_of_memory)
from kernel_pytorch.verify.referee import float32_fits, referee_device

__all__ = ["Comparison", "Run", "relative_error", "compare", "compare_against_float32", "compared_counts",
           "NoiseAwareCheck", "NOISE_FACTOR", "NOTHING_COMPARED", "LOW_PRECISION", "is_low_precision", "to_float32",
           "float32_fits", "referee_device", "run_reference", "flatten_tensors", "call_arguments",
           "unless_out_of_memory"]
