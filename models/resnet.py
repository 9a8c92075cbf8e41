"""ResNets: ResNet-50 v1.5 (ImageNet shape) and ResNet-20/56 (CIFAR shape)."""

import keras

_BN = dict(momentum=0.9, epsilon=1e-5)


def _conv(x, filters, kernel, strides, init, name):
  return keras.layers.Conv2D(filters, kernel, strides=strides, padding="same",
                             use_bias=False, kernel_initializer=init(),
                             name=name)(x)


def _bn(x, name, sync, zero=False):
  # Goyal et al.: the last BN of each residual branch starts at gamma = 0, so
  # every block begins as the identity and large-batch warmup is stable.
  return keras.layers.BatchNormalization(
      gamma_initializer="zeros" if zero else "ones", synchronized=sync,
      name=name, **_BN)(x)


def _bottleneck(x, filters, strides, init, name, sync):
  """v1.5: the stride sits on the 3x3 conv, not on the first 1x1."""
  shortcut = x
  if strides != 1 or x.shape[-1] != 4 * filters:
    shortcut = _conv(x, 4 * filters, 1, strides, init, f"{name}_proj")
    shortcut = _bn(shortcut, f"{name}_proj_bn", sync)
  y = _conv(x, filters, 1, 1, init, f"{name}_1_conv")
  y = keras.layers.ReLU(name=f"{name}_1_relu")(_bn(y, f"{name}_1_bn", sync))
  y = _conv(y, filters, 3, strides, init, f"{name}_2_conv")
  y = keras.layers.ReLU(name=f"{name}_2_relu")(_bn(y, f"{name}_2_bn", sync))
  y = _conv(y, 4 * filters, 1, 1, init, f"{name}_3_conv")
  y = _bn(y, f"{name}_3_bn", sync, zero=True)
  return keras.layers.ReLU(name=f"{name}_out")(keras.layers.Add(name=f"{name}_add")([shortcut, y]))


def _basic(x, filters, strides, init, name, sync):
  shortcut = x
  if strides != 1 or x.shape[-1] != filters:
    shortcut = _conv(x, filters, 1, strides, init, f"{name}_proj")
    shortcut = _bn(shortcut, f"{name}_proj_bn", sync)
  y = _conv(x, filters, 3, strides, init, f"{name}_1_conv")
  y = keras.layers.ReLU(name=f"{name}_1_relu")(_bn(y, f"{name}_1_bn", sync))
  y = _conv(y, filters, 3, 1, init, f"{name}_2_conv")
  y = _bn(y, f"{name}_2_bn", sync, zero=True)
  return keras.layers.ReLU(name=f"{name}_out")(keras.layers.Add(name=f"{name}_add")([shortcut, y]))


def _initializer(seed):
  count = [0]

  def init():
    count[0] += 1
    return keras.initializers.VarianceScaling(2.0, "fan_out", "truncated_normal",
                                              seed=seed * 1000 + count[0])
  return init


def _head(x, num_classes, seed, name):
  x = keras.layers.GlobalAveragePooling2D(name="avg_pool")(x)
  # Logits in float32 even under a mixed-precision policy: the softmax and the
  # loss need the range.
  return keras.layers.Dense(
      num_classes, kernel_initializer=keras.initializers.RandomNormal(0.0, 0.01, seed=seed),
      dtype="float32", name="logits")(x)


def resnet50(input_shape=(224, 224, 3), num_classes=1000, seed=0,
             sync_batch_norm=False):
  """ResNet-50 v1.5 (25.6M parameters at 1000 classes); outputs logits.

  Args:
    input_shape: (height, width, channels); any size >= 32.
    num_classes: number of classes.
    seed: seed of the initialisers.
    sync_batch_norm: batch statistics over the global batch.

  Returns:
    An uncompiled `keras.Model`.
  """
  init = _initializer(seed)
  inputs = keras.Input(shape=input_shape, name="image")
  x = _conv(inputs, 64, 7, 2, init, "stem_conv")
  x = keras.layers.ReLU(name="stem_relu")(_bn(x, "stem_bn", sync_batch_norm))
  x = keras.layers.MaxPooling2D(3, 2, padding="same", name="stem_pool")(x)
  for stage, (filters, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)]):
    for b in range(blocks):
      strides = 2 if b == 0 and stage > 0 else 1
      x = _bottleneck(x, filters, strides, init, f"s{stage + 1}b{b + 1}", sync_batch_norm)
  return keras.Model(inputs, _head(x, num_classes, seed, "logits"), name="resnet50")


def cifar_resnet(depth, input_shape=(32, 32, 3), num_classes=10, seed=0,
                 sync_batch_norm=False):
  """He et al.'s CIFAR ResNet of `depth` = 6n + 2 layers (16/32/64 filters); outputs logits."""
  if (depth - 2) % 6:
    raise ValueError(f"CIFAR ResNet depth must be 6n + 2, got {depth}.")
  n = (depth - 2) // 6
  init = _initializer(seed)
  inputs = keras.Input(shape=input_shape, name="image")
  x = _conv(inputs, 16, 3, 1, init, "stem_conv")
  x = keras.layers.ReLU(name="stem_relu")(_bn(x, "stem_bn", sync_batch_norm))
  for stage, filters in enumerate([16, 32, 64]):
    for b in range(n):
      strides = 2 if b == 0 and stage > 0 else 1
      x = _basic(x, filters, strides, init, f"s{stage + 1}b{b + 1}", sync_batch_norm)
  return keras.Model(inputs, _head(x, num_classes, seed, "logits"), name=f"resnet{depth}")


def resnet20(**kwargs):
  """ResNet-20 for 32x32 images (0.27M parameters)."""
  return cifar_resnet(20, **kwargs)


def resnet56(**kwargs):
  """ResNet-56 for 32x32 images (0.85M parameters)."""
  return cifar_resnet(56, **kwargs)
