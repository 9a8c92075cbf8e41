"""The run beyond the variables: what a backup holds of a Keras run and where it continues.

Owns: the Resume value and the data position (position.py), callbacks' and
metrics' state (callback_state.py, run_state.py), the hooks into a running
`model.fit` (fit_hooks.py), the training state TrainState (train_state.py).
May import: tfdp.checkpoint.format, tfdp.data, tfdp.distribute, tfdp.compat, tfdp.errors.
"""
