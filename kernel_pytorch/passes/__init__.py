"""Graph and module passes; importing this package registers the built-in ones."""

from __future__ import annotations

from kernel_pytorch.passes import (activations, attention, context_parallel, decode_attention,  # noqa: F401
                                   decode_fusion, decode_linear, decode_rope_cache, fp8_linear, horizontal_gemm,
                                   linear_cross_entropy, normalize, norms, rope)  # (registers them)
from kernel_pytorch.passes.base import (Candidate, GraphPass, ModulePass, PassContext, PassResult, Rewrite, Skip,
                                       candidates, replace_module)
from kernel_pytorch.passes.manager import PassManager
from kernel_pytorch.passes.registry import get_pass, register_pass, registered_pass_names

__all__ = ["Candidate", "GraphPass", "ModulePass", "PassContext", "PassResult", "Rewrite", "Skip", "PassManager",
           "candidates", "get_pass", "register_pass", "registered_pass_names", "replace_module"]
