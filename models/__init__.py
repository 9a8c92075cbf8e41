"""Model registry: maps `--model` names to builders; models know nothing of distribution."""

import dataclasses
from typing import Callable

import keras

from models import bert
from models import cnn
from models import dlrm
from models import resnet

IMAGE_CLASSIFICATION = "image_classification"
MASKED_LM = "masked_lm"
RECOMMENDATION = "recommendation"
KERAS_APP_PREFIX = "keras_app:"


class SparseCategoricalCrossentropy(keras.losses.Loss):
  """Cross-entropy of integer labels and logits, with optional label smoothing.

  Keras's own sparse loss has no `label_smoothing`; this one smooths the
  one-hot target: (1 - s) * onehot + s / num_classes.
  """

  def __init__(self, label_smoothing=0.0, name="sparse_categorical_crossentropy", **kwargs):
    super().__init__(name=name, **kwargs)
    self.label_smoothing = label_smoothing

  def call(self, y_true, y_pred):
    if not self.label_smoothing:
      return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
    target = keras.ops.one_hot(keras.ops.cast(y_true, "int32"), keras.ops.shape(y_pred)[-1])
    return keras.losses.categorical_crossentropy(
        target, y_pred, from_logits=True, label_smoothing=self.label_smoothing)

  def get_config(self):
    return dict(super().get_config(), label_smoothing=self.label_smoothing)


def _classification_compile_args(label_smoothing=0.0):
  return dict(loss=SparseCategoricalCrossentropy(label_smoothing),
              metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])


def _masked_lm_compile_args(label_smoothing=0.0):
  # Padding predictions carry sample weight 0; the loss is the mean over real
  # masked tokens, so short sequences do not dilute it.
  return dict(
      loss=keras.losses.SparseCategoricalCrossentropy(
          from_logits=True, reduction="mean_with_sample_weight"),
      weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="masked_lm_accuracy")])


def _recommendation_compile_args(label_smoothing=0.0):
  return dict(loss=keras.losses.BinaryCrossentropy(from_logits=True,
                                                   label_smoothing=label_smoothing),
              metrics=[keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy"),
                       keras.metrics.AUC(from_logits=True, name="auc")])


_COMPILE_ARGS = {
    IMAGE_CLASSIFICATION: _classification_compile_args,
    MASKED_LM: _masked_lm_compile_args,
    RECOMMENDATION: _recommendation_compile_args,
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """How to build, compile and feed one model.

  Attributes:
    name: the `--model` name.
    build: `fn(seed=, **data_kwargs, **options) -> keras.Model`, uncompiled.
      `data_kwargs` come from the dataset (input_shape/num_classes,
      vocab_size/seq_len/max_predictions, vocab_sizes/num_dense).
    task: the kind of data: image_classification, masked_lm, recommendation.
    options: TrainConfig fields passed to `build` by name (e.g. bert_config).
    image_size: default side of synthetic images (image models).
    optimizer: default optimizer (sgd, adamw, adam) for `tfdp.app.optim`.
    learning_rate: default peak learning rate.
    scale_learning_rate: the default is per 256 examples and scales linearly
      with the global batch (Goyal et al.).
    weight_decay: default weight decay (L2 for sgd, decoupled for adamw).
  """
  name: str
  build: Callable
  task: str
  options: tuple = ()
  image_size: int | None = None
  optimizer: str = "sgd"
  learning_rate: float = 0.05
  scale_learning_rate: bool = False
  weight_decay: float = 0.0

  def compile_args(self, label_smoothing=0.0):
    """Keras `compile` kwargs other than the optimizer: loss and metrics of the task."""
    return _COMPILE_ARGS[self.task](label_smoothing=label_smoothing)


def _bert_build(bert_config="tiny", **kwargs):
  return bert.build(bert_config=bert_config, **kwargs)


_RESNET = dict(task=IMAGE_CLASSIFICATION, optimizer="sgd", learning_rate=0.1,
               scale_learning_rate=True, weight_decay=1e-4)

_REGISTRY = {
    "cnn": ModelSpec("cnn", cnn.build, IMAGE_CLASSIFICATION, image_size=32),
    "resnet20": ModelSpec("resnet20", resnet.resnet20, image_size=32, **_RESNET),
    "resnet56": ModelSpec("resnet56", resnet.resnet56, image_size=32, **_RESNET),
    "resnet50": ModelSpec("resnet50", resnet.resnet50, image_size=224, **_RESNET),
    "bert": ModelSpec("bert", _bert_build, MASKED_LM, options=("bert_config",),
                      optimizer="adamw", learning_rate=1e-3, weight_decay=0.01),
    "dlrm": ModelSpec("dlrm", dlrm.build, RECOMMENDATION, optimizer="adam",
                      learning_rate=1e-3),
}


def keras_app_names():
  """Model functions of `keras.applications` (ResNet50, MobileNetV2, ...)."""
  return sorted(n for n in dir(keras.applications)
                if n[:1].isupper() and callable(getattr(keras.applications, n)))


def _keras_app_spec(app):
  if app not in keras_app_names():
    raise KeyError(
        f"Unknown keras.applications model {app!r}; available: "
        f"{', '.join(keras_app_names())}.")

  def build(input_shape=(224, 224, 3), num_classes=1000, seed=0):
    del seed  # keras.applications takes none; keras.utils.set_random_seed rules.
    base = getattr(keras.applications, app)(
        weights=None, input_shape=tuple(input_shape), classes=num_classes,
        classifier_activation=None)
    # Float32 logits under a mixed-precision policy.
    logits = keras.layers.Activation("linear", dtype="float32", name="logits")(base.output)
    return keras.Model(base.inputs, logits, name=base.name)

  return ModelSpec(KERAS_APP_PREFIX + app, build, image_size=224, **_RESNET)


def names():
  """The registered model names (plus `keras_app:NAME` for any keras.applications model)."""
  return sorted(_REGISTRY) + [KERAS_APP_PREFIX + "NAME"]


def get(name):
  """The `ModelSpec` of `name`; KeyError lists the known names."""
  if name.startswith(KERAS_APP_PREFIX):
    return _keras_app_spec(name[len(KERAS_APP_PREFIX):])
  try:
    return _REGISTRY[name]
  except KeyError:
    raise KeyError(f"Unknown model {name!r}; known models: {', '.join(names())}.") from None
