"""The gradient path of data parallelism: all-reduce in buckets, then clip and check the reduced gradients.

Installed by tfdp.compat's fix `gradient_path` (tfdp/compat/gradient_path.py),
which probes the upstream code it replaces; the path itself lives here.

Owns:
- settings.py: its settings, `configure_gradients` (no TensorFlow);
- buckets.py: the buckets and their compression;
- path.py: the optimizer methods that all-reduce first, then clip and check.
May import: tfdp.errors.
"""
