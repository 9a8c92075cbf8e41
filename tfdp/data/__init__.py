"""Input that resumes exactly: sources, checkpointable iterators, one iterator's state.

Owns: position-addressable sources and the per-replica pipeline (sources.py),
checkpointable distributed iterators (iterators.py), one tf.data iterator's
state as bytes (iterator_state.py).
May import: tfdp.errors.
"""

from tfdp.data.iterators import checkpointable
from tfdp.data.pipeline import distribute, per_replica_batch_size, replica_dataset
from tfdp.data.sources import (ArraySource, DatasetSource, FunctionSource, RandomAccessSource, Source,
                               Transform, example_indices, steps_per_epoch, synthetic_images)
from tfdp.data.tfrecords import TFRecordSource, tfrecord_index

__all__ = ["ArraySource", "DatasetSource", "FunctionSource", "RandomAccessSource", "Source",
           "TFRecordSource", "Transform", "checkpointable", "distribute", "example_indices",
           "per_replica_batch_size", "replica_dataset", "steps_per_epoch", "synthetic_images",
           "tfrecord_index"]
