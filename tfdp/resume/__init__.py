"""The run beyond the variables: what a backup holds of a Keras run and where it continues.

Owns:
- position.py: the Resume value and the run's position (epoch, step, callbacks, metrics);
- data_position.py: DataPosition, the data position a backup holds;
- trackables.py: the per-worker trackables of callbacks' and metrics' state;
- callback_state.py: Keras callbacks' state and the get_state/set_state hook;
- fit_hooks.py: the hooks into a running `model.fit` (its epoch iterator, its data);
- train_state.py: TrainState (variables, step, RNG, run config) and when a saved one fits.
May import: tfdp.checkpoint.format, tfdp.data, tfdp.distribute, tfdp.errors.
"""
