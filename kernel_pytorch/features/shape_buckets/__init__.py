"""Shape buckets: ``optimize(model, shape_buckets="auto")`` serves calls of varying batch size and sequence length from
a bounded set of captured graphs. Each call is padded up to the next (batch, length) bucket, with the padding masked,
runs that bucket's static-shape graph (compiled once; CUDA graphs with ``compile="reduce-overhead"``), and its
outputs are sliced back to the call's shape. Padding that cannot be shown harmless is refused, with the reason in
the report.

- ``ladder``: the bucket ladders (``auto_batch_buckets``, ``auto_length_buckets``);
- ``padding``: which argument dims are batch and sequence, the pad values, slicing outputs back;
- ``mixing_ops`` and ``safety``: the check that padding leaves the real outputs as they were;
- ``plan``, ``wrapper``, ``feature``: the decision per model, the call wrapper, the ``Feature``;
- ``warm_up``: capture every bucket ahead of time.
"""

from kernel_pytorch.features.shape_buckets.feature import ShapeBucketsFeature
from kernel_pytorch.features.shape_buckets.ladder import Ladder, auto_batch_buckets, auto_length_buckets
from kernel_pytorch.features.shape_buckets.warm_up import warm_up
from kernel_pytorch.features.shape_buckets.wrapper import ShapeBucketCall, ShapeBucketError

__all__ = ["ShapeBucketsFeature", "ShapeBucketCall", "ShapeBucketError", "Ladder", "auto_batch_buckets",
           "auto_length_buckets", "warm_up"]
