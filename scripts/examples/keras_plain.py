"""The README's conversion example: keras_plain.py as Keras users write it, keras_tfdp.py with tfdp."""

import argparse

import keras
import numpy as np
import tensorflow as tf

BATCH_SIZE = 64


def load_data(n, seed=0):
  """CIFAR-shaped images with a learnable signal: a template per class plus noise."""
  rng = np.random.default_rng(seed)
  templates = rng.normal(size=(10, 32, 32, 3)).astype("float32")
  labels = rng.integers(0, 10, size=n)
  images = templates[labels] + rng.normal(size=(n, 32, 32, 3)).astype("float32")
  return images, labels


def make_datasets(n):
  """A tf.data pipeline as scripts build it: shuffled training batches and a held-out split."""
  images, labels = load_data(n)
  split = n * 7 // 8
  train = (tf.data.Dataset.from_tensor_slices((images[:split], labels[:split]))
           .shuffle(1024, seed=1).batch(BATCH_SIZE).prefetch(tf.data.AUTOTUNE))
  val = tf.data.Dataset.from_tensor_slices((images[split:], labels[split:])).batch(BATCH_SIZE)
  return train, val


def make_model():
  model = keras.Sequential([
      keras.Input((32, 32, 3)),
      keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
      keras.layers.MaxPooling2D(),
      keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
      keras.layers.GlobalAveragePooling2D(),
      keras.layers.Dense(10),
  ])
  model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
  return model


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--num_examples", type=int, default=4096)
  parser.add_argument("--backup_dir", default="/tmp/keras_example_backup")
  args = parser.parse_args()
  train, val = make_datasets(args.num_examples)
  model = make_model()
  model.fit(train, validation_data=val, epochs=args.epochs,
            callbacks=[keras.callbacks.BackupAndRestore(args.backup_dir)])


if __name__ == "__main__":
  main()
