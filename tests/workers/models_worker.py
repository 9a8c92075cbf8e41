"""Worker of the model tests: under one strategy, trains each named model a few steps, prints a RESULT line."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

# Smallest configs that still show each model learning on CPU: per model, the
# TrainConfig fields of a short run.
CASES = {
    "resnet20": dict(image_size=16, global_batch_size=16, num_examples=256,
                     learning_rate=0.1),
    "resnet56": dict(image_size=16, global_batch_size=8, num_examples=64),
    "resnet50": dict(image_size=32, global_batch_size=4, num_examples=64),
    "keras_app:MobileNet": dict(image_size=32, global_batch_size=4, num_examples=64),
    "bert": dict(bert_config="tiny", seq_len=32, global_batch_size=16, num_examples=256),
    "dlrm": dict(global_batch_size=64, num_examples=1024, learning_rate=0.03),
}


def train(strategy, name, train_steps, run_eagerly=False, **overrides):
  """Builds, compiles and fits CASES[name] (`name+bf16`: mixed precision) as tfdp.app.trainer does.

  One strategy serves every model: a process can hold only one
  MultiWorkerMirroredStrategy safely (a second one reuses collective
  instance keys of the first).

  Returns:
    A JSON-able summary: step, per-epoch losses, dtype policy, variable dtypes.
  """
  import models  # pylint: disable=g-import-not-at-top
  from tfdp import cluster  # pylint: disable=g-import-not-at-top
  from tfdp.app import trainer  # pylint: disable=g-import-not-at-top
  from tfdp.callbacks import fit as training  # pylint: disable=g-import-not-at-top
  model_name = name.split("+")[0]
  config = trainer.TrainConfig(model=model_name, train_steps=train_steps,
                               mixed_precision=name.endswith("+bf16"),
                               **dict(CASES[model_name], **overrides))
  config.validate()
  spec = models.get(model_name)
  num_workers = cluster.resolve(strategy).count
  source = trainer._source(config, spec, num_workers)  # pylint: disable=protected-access
  with strategy.scope():
    model = trainer._build(config, spec, source)  # pylint: disable=protected-access
    trainer._compile(model, config, spec)  # pylint: disable=protected-access
    if run_eagerly:
      model.compile(optimizer=model.optimizer, run_eagerly=True,
                    **spec.compile_args(config.label_smoothing))
  histories = training.fit(
      model, lambda first: source.distribute(strategy, global_batch_size=config.global_batch_size,
                                             seed=config.seed, start_step=first),
      start_step=0, train_steps=train_steps,
      steps_per_epoch=config.steps_per_epoch or train_steps, verbose=0)
  return {
      "step": int(model.optimizer.iterations.numpy()),
      "losses": [l for h in histories for l in h.history["loss"]],
      "policy": model.dtype_policy.name,
      "variable_dtypes": sorted({v.dtype for v in model.variables}),
  }


def main():
  from tfdp.distribute import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  names = sys.argv[1].split(",")
  steps = int(sys.argv[2])
  strategy = strategy_lib.make_strategy("multi_worker")
  out = {name: train(strategy, name, steps) for name in names}
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
