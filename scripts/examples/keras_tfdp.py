"""The same script made data-parallel over every local GPU with tfdp (the 'after' of the README diff)."""

import argparse

import keras
import numpy as np
import tfdp


def load_data(n, seed=0):
  """CIFAR-shaped images with a learnable signal: a template per class plus noise."""
  rng = np.random.default_rng(seed)
  templates = rng.normal(size=(10, 32, 32, 3)).astype("float32")
  labels = rng.integers(0, 10, size=n)
  images = templates[labels] + rng.normal(size=(n, 32, 32, 3)).astype("float32")
  return images, labels


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
  x, y = load_data(args.num_examples)
  strategy = tfdp.make_strategy()
  with strategy.scope():
    model = make_model()
  model.fit(x, y, batch_size=64, epochs=args.epochs, callbacks=[tfdp.callbacks.BackupAndRestore(args.backup_dir)])


if __name__ == "__main__":
  main()
