"""The command lines: thin entry points over the packages that do the work.

Owns:
- train.py: `tfdp-train` (absl flags -> TrainConfig -> tfdp.app.trainer.run);
- ckpt.py: `tfdp-ckpt` (its parser, paths, export); ckpt_list.py: `ls` and `verify`
  through the format's records (no TensorFlow for `ls`); ckpt_inspect.py: `inspect`.
May import: tfdp.app, tfdp.checkpoint, tfdp.distribute, tfdp.liveness, tfdp.launch, tfdp.errors.
"""
