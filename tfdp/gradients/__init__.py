"""The gradient path of data parallelism: all-reduce in buckets, then clip and check the reduced gradients.

Owns: its settings (settings.py, no TensorFlow), the buckets and compression
(buckets.py), the optimizer path that reduces first (path.py).
May import: tfdp.errors.
"""
