"""One worker's part of a checkpointable distributed iterator: a plain host `tf.data` iterator feeding the local replicas, and its TypeSpec.

It replaces TF's `OwnedMultiDeviceIterator` inside a `DistributedIterator`
(see tfdp.data.iterators): element k goes to local replica k mod n, as TF's
multi-device iterator hands them out, and nothing is buffered outside the
pipeline, so the one iterator's state is the worker's exact position.
"""

import tensorflow as tf
from tensorflow.python.data.ops import iterator_ops
from tensorflow.python.distribute import input_lib
from tensorflow.python.framework import ops


class HostFedWorkerIterator(input_lib._SingleWorkerOwnedDatasetIterator):  # pylint: disable=protected-access
  """One worker's iterator: a host `tf.data` iterator feeding the local replicas."""

  def _make_iterator(self):
    with ops.device(self._worker):
      self._iterator = iter(self._dataset)

  def _on_device(self, device, value):
    with ops.device(device):
      return tf.nest.map_structure(tf.identity, value, expand_composites=True)

  def get_next(self, device, name=None):
    del name
    with ops.device(self._worker):
      return self._on_device(device, self._iterator.get_next())

  def get_next_as_list(self, name=None):
    del name
    # Ops on one iterator resource run in program order (automatic control
    # dependencies), so replica j gets the j-th element, as with TF's
    # multi-device iterator.
    with ops.device(self._worker):
      return [self._on_device(d, self._iterator.get_next()) for d in self._devices]

  def get_next_as_optional_list(self):
    # TF's caller takes each value under its replica's device scope.
    with ops.device(self._worker):
      return [self._iterator.get_next_as_optional() for _ in self._devices]

  @property
  def _type_spec(self):
    return HostFedWorkerIteratorSpec(self._worker, self._devices, self._element_spec,
                                      self._options, self._canonicalize_devices)


class HostFedWorkerIteratorSpec(input_lib._SingleWorkerDatasetIteratorSpec):  # pylint: disable=protected-access
  """TypeSpec of `HostFedWorkerIterator` (one plain iterator resource)."""

  @property
  def value_type(self):
    return HostFedWorkerIterator

  @property
  def _component_specs(self):
    return [iterator_ops.IteratorSpec(element_spec=self._element_spec)]

  def _from_components(self, components):
    return HostFedWorkerIterator(
        dataset=None, worker=self._worker, devices=self._devices, components=components,
        element_spec=self._element_spec, options=self._options,
        canonicalize_devices=self._canonicalize_devices)

  @staticmethod
  def from_value(value):
    return value._type_spec  # pylint: disable=protected-access
