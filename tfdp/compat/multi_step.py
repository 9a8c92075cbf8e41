"""The multi-step loop of fix steps_per_execution_inline: upstream's `tf.while_loop` with the step traced inline."""

import tensorflow as tf

from keras.src.backend.tensorflow import trainer as tf_trainer


def inline_multi_step_function(trainer, step_function):
  """Upstream's `_make_function` loop with the step traced inline (see steps_per_execution_inline).

  Args:
    trainer: the model (a Keras TensorFlowTrainer).
    step_function: its `train_step` or `test_step`.

  Returns:
    The train or test function: `function(iterator) -> logs`.
  """

  @tf.autograph.experimental.do_not_convert
  def one_step_on_data(data):
    outputs = trainer.distribute_strategy.run(step_function, args=(data,))
    # Looked up at call time so the "reduce_mean_axis" fix applies here too.
    return tf_trainer.reduce_per_replica(
        outputs, trainer.distribute_strategy, reduction="auto")

  # Upstream's function for `train_on_batch`-style generators, one step per
  # call; the inline one for the loop.
  one_step_function = trainer._autoconvert_optionals(  # pylint: disable=protected-access
      tf.function(one_step_on_data, reduce_retracing=True))
  one_step_on_data = trainer._autoconvert_optionals(one_step_on_data)  # pylint: disable=protected-access

  @tf.autograph.experimental.do_not_convert
  def multi_step_on_iterator(iterator):
    steps = trainer.steps_per_execution
    # The spec is set while `tf.while_loop` traces the body, as upstream does.
    empty_outputs = tf.experimental.Optional.empty(None)

    def cond(execution_step, optional_outputs, next_optional_inputs):
      del optional_outputs
      return tf.logical_and(
          tf.less(execution_step, steps), next_optional_inputs.has_value())

    def inner_body(execution_step, optional_outputs, next_optional_inputs):

      def has_next():
        next_optional_outputs = tf.experimental.Optional.from_value(
            one_step_on_data(next_optional_inputs.get_value()))
        empty_outputs._element_spec = next_optional_outputs.element_spec  # pylint: disable=protected-access
        return next_optional_outputs

      def no_has_next():
        optional_outputs._element_spec = empty_outputs._element_spec  # pylint: disable=protected-access
        return optional_outputs

      next_optional_outputs = tf.cond(
          tf.logical_and(
              tf.less(execution_step, steps),
              next_optional_inputs.has_value()),
          has_next,
          no_has_next,
      )
      return (
          execution_step + 1,
          next_optional_outputs,
          tf.cond(
              tf.less(execution_step + 1, steps),
              iterator.get_next_as_optional,
              lambda: next_optional_inputs,
          ),
      )

    def body(execution_step, optional_outputs, next_optional_inputs):
      for _ in range(min(trainer.unrolled_steps_per_execution, steps)):
        execution_step, optional_outputs, next_optional_inputs = inner_body(
            execution_step, optional_outputs, next_optional_inputs)
      return execution_step, optional_outputs, next_optional_inputs

    _, final_optional_outputs, _ = tf.while_loop(
        cond,
        body,
        loop_vars=[
            tf.constant(0), empty_outputs, iterator.get_next_as_optional()
        ],
    )
    final_optional_outputs._element_spec = empty_outputs.element_spec  # pylint: disable=protected-access
    return final_optional_outputs

  multi_step_on_iterator = tf.function(
      multi_step_on_iterator, reduce_retracing=True)

  def function(iterator):
    if isinstance(iterator,
                  (tf.data.Iterator, tf.distribute.DistributedIterator)):
      opt_outputs = multi_step_on_iterator(iterator)
      if not opt_outputs.has_value():
        raise StopIteration
      return opt_outputs.get_value()
    outputs = None
    for _, data in zip(range(trainer.steps_per_execution), iterator):
      outputs = one_step_function(data)
    return outputs

  return function
