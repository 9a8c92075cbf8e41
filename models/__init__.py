"""Model registry: maps `--model` names to builders; models know nothing of distribution."""

import dataclasses
from typing import Callable

from models import cnn


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """How to build one model and which kind of data it eats.

  Attributes:
    name: the `--model` name.
    build: `fn(**kwargs) -> keras.Model`, uncompiled.
    task: the kind of data: `image_classification`, ...
  """
  name: str
  build: Callable
  task: str


_REGISTRY = {
    "cnn": ModelSpec("cnn", cnn.build, "image_classification"),
}


def names():
  """The registered model names."""
  return sorted(_REGISTRY)


def get(name):
  """The `ModelSpec` of `name`; KeyError lists the known names."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise KeyError(f"Unknown model {name!r}; known models: {', '.join(names())}.") from None
