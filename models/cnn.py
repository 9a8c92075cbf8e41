"""A small convnet for image classification (the foundation's test and demo model)."""

import keras


def build(input_shape=(32, 32, 3), num_classes=10, width=16, dropout=0.1, seed=0,
          sync_batch_norm=False):
  """Conv-BN-ReLU x2, pooling, dropout and a dense classifier; outputs logits.

  Args:
    input_shape: (height, width, channels) of the images.
    num_classes: number of classes.
    width: filters of the first conv layer (the second has twice as many).
    dropout: dropout rate before the classifier (its seed makes it resumable).
    seed: seed of the initialisers and of dropout.
    sync_batch_norm: compute batch statistics over the global batch (all
      replicas) instead of each replica's slice.

  Returns:
    An uncompiled `keras.Model`.
  """
  init = lambda i: keras.initializers.HeNormal(seed=seed + i)
  inputs = keras.Input(shape=input_shape, name="image")
  x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False,
                          kernel_initializer=init(1))(inputs)
  x = keras.layers.BatchNormalization(synchronized=sync_batch_norm)(x)
  x = keras.layers.ReLU()(x)
  x = keras.layers.MaxPooling2D()(x)
  x = keras.layers.Conv2D(2 * width, 3, padding="same", use_bias=False,
                          kernel_initializer=init(2))(x)
  x = keras.layers.BatchNormalization(synchronized=sync_batch_norm)(x)
  x = keras.layers.ReLU()(x)
  x = keras.layers.GlobalAveragePooling2D()(x)
  x = keras.layers.Dropout(dropout, seed=seed + 3)(x)
  outputs = keras.layers.Dense(num_classes, kernel_initializer=init(4),
                               name="logits")(x)
  return keras.Model(inputs, outputs, name="cnn")
