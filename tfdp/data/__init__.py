"""Input that resumes exactly: sources, their per-replica pipeline, checkpointable iterators, one iterator's state.

Owns:
- sources.py: the Source protocol, sources read by index or as a stream, which examples a step reads;
- tfrecords.py: TFRecord files read by example index;
- pipeline.py: the per-replica pipeline of a Source and the distributed dataset;
- iterators.py: checkpointable distributed iterators of any tf.data pipeline;
- worker_iterator.py: one worker's host-fed iterator inside them, and its TypeSpec;
- iterator_state.py: one tf.data iterator's position as a variant, as bytes, restored or replayed.
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
