"""The gradient path of data parallelism: all-reduce in buckets, then clip and check the reduced gradients.

Installed by tfdp.compat's fix `gradient_path` (tfdp/compat/gradient_path.py),
which probes the upstream code it replaces; the path itself lives here.

Owns:
- settings.py: its settings, `configure_gradients` (no TensorFlow);
- buckets.py: the buckets and their compression;
- path.py: the optimizer methods that all-reduce first, then clip and check.
May import: tfdp.errors.
"""

# The settings are the package's face (TF-free): `tfdp.gradients.reset()`.
from tfdp.gradients.settings import GradientConfig
from tfdp.gradients.settings import configure_gradients
from tfdp.gradients.settings import current
from tfdp.gradients.settings import reset

__all__ = ["GradientConfig", "configure_gradients", "current", "reset"]
