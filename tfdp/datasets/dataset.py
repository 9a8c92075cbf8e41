"""What every dataset kind shares: the `Dataset` record it returns and the per-example seeds it draws from."""

import dataclasses

import tensorflow as tf

from tfdp import data


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A source of examples plus what the model needs to know about them.

  Attributes:
    source: the examples, read through `tfdp.data`; its name is the identity
      of the data recorded in checkpoints.
    model_kwargs: shapes for the model builder (input_shape, num_classes,
      vocab_size, seq_len, max_predictions, vocab_sizes, num_dense).
    transform: `fn(batch, step) -> batch` applied per replica batch.
  """
  source: data.Source
  model_kwargs: dict
  transform: data.Transform | None = None

  @property
  def name(self) -> str:
    """Identity of the data, recorded in checkpoints."""
    return self.source.name

  @property
  def num_examples(self) -> int:
    """Examples in one epoch (all workers together)."""
    return self.source.num_examples

  def distribute(self, strategy: tf.distribute.Strategy, *, global_batch_size: int, seed: int,
                 start_step: int = 0) -> tf.distribute.DistributedDataset:
    """The distributed dataset whose element n is the batch of global step start_step + n."""
    return data.distribute(strategy, self.source, global_batch_size=global_batch_size,
                           seed=seed, start_step=start_step, transform=self.transform)


def index_seed(seed: int, index: int | tf.Tensor, salt: int) -> tf.Tensor:
  """The stateless-RNG seed of example (or step) `index` for one use (`salt`) under `seed`."""
  return tf.stack([tf.constant(seed, tf.int64) * 1000003 + salt, tf.cast(index, tf.int64)])
