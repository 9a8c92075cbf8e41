"""What tests read of TensorBoard log directories: their scalar events and the writers' pids."""

import glob
import os
import re


def scalars(folder):
  """Sorted (subfolder, tag, step, value) of the scalar events under log dir `folder`, and the writers' pids."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.core.util import event_pb2  # pylint: disable=g-import-not-at-top
  events, pids = [], set()
  for path in sorted(glob.glob(os.path.join(folder, "*", "*tfevents*"))):
    pids.add(int(re.search(r"\.(\d+)\.\d+\.v2$", path).group(1)))  # ...tfevents.TIME.HOST.PID.N.v2
    for record in tf.data.TFRecordDataset(path):
      event = event_pb2.Event.FromString(record.numpy())
      for v in event.summary.value:
        if v.metadata.plugin_data.plugin_name == "scalars":
          events.append((os.path.basename(os.path.dirname(path)), v.tag, event.step,
                         tf.make_ndarray(v.tensor).item()))
  return sorted(events), pids
