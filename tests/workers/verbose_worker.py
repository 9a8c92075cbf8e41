"""fit, evaluate and predict with Keras's default verbose ("auto") under tfdp; prints DONE <worker>."""

import keras
import numpy as np
import tfdp

strategy = tfdp.make_strategy()
with strategy.scope():
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  model.compile("sgd", "mse")
x, y = np.ones((32, 4), "float32"), np.ones((32, 1), "float32")
model.fit(x, y, batch_size=16, epochs=1)
model.evaluate(x, y, batch_size=16)
model.predict(x, batch_size=16)
model.evaluate(x, y, batch_size=16, verbose=2)  # asked for: printed on every worker
print("DONE", tfdp.cluster.resolve(strategy).index, flush=True)
