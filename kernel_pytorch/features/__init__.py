"""Optional capabilities of ``optimize``, each one :class:`Feature` (``features/base.py`` gives the hooks).

Registration order is the order ``optimize`` runs their hooks in, and the order their wrappers nest around the
compiled call: the memory wrappers inside, then shape buckets (pad in, slice out), context parallelism (shard in,
gather out) outermost. Generation wraps ``model.generate``, not the call.
"""

from kernel_pytorch.features.base import Feature, OptimizeRun, enabled_features, register_feature, registered_features
from kernel_pytorch.features.memory import MemoryFeature
from kernel_pytorch.features.fp8 import Float8Feature
from kernel_pytorch.features.sparse_attention import SparseAttentionFeature
from kernel_pytorch.features.shape_buckets import ShapeBucketsFeature
from kernel_pytorch.features.context_parallel import ContextParallelFeature
from kernel_pytorch.features.generation import GenerationFeature

__all__ = ["Feature", "OptimizeRun", "enabled_features", "register_feature", "registered_features", "MemoryFeature",
           "Float8Feature", "SparseAttentionFeature", "ShapeBucketsFeature", "ContextParallelFeature",
           "GenerationFeature"]
