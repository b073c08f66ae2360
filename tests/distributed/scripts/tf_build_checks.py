"""What the Horovod wheel built against the installed TensorFlow must do, checked under -np 2.

Collectives in float32, float16 and int32; process sets; and Horovod's own DistributedGradientTape
fed the `tf.Variable` behind each Keras 3 variable. Prints `OK <name>` on rank 0 per check.
"""

import checks  # beside this script: report()
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
warnings.filterwarnings("ignore")

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

only_0, only_1 = hvd.ProcessSet([0]), hvd.ProcessSet([1])
hvd.init(process_sets=[only_0, only_1])
assert hvd.size() == 2, "run with -np 2"
R = hvd.rank()


def report(name: str, ok: bool, detail: str = "") -> None:
    checks.report(hvd, name, ok, detail)


for dtype in (tf.float32, tf.float16, tf.int32):
    name = dtype.name
    mine = tf.cast(tf.reshape(tf.range(6) + 10 * R, (2, 3)), dtype)       # rank 0: 0..5, rank 1: 10..15
    summed = hvd.allreduce(mine, op=hvd.Sum, name=f"sum_{name}").numpy()
    expected_sum = np.arange(6).reshape(2, 3) * 2 + 10
    gathered = hvd.allgather(mine, name=f"gather_{name}").numpy()
    expected_gather = np.concatenate([np.arange(6).reshape(2, 3), np.arange(6).reshape(2, 3) + 10])
    sent = hvd.broadcast(mine, root_rank=1, name=f"bcast_{name}").numpy()
    ok = (summed.dtype == dtype.as_numpy_dtype and np.array_equal(summed, expected_sum)
          and np.array_equal(gathered, expected_gather) and np.array_equal(sent, np.arange(6).reshape(2, 3) + 10))
    report(f"collectives_{name}", ok)

averaged = hvd.allreduce(tf.constant([1.0, 3.0]) * (R + 1), op=hvd.Average, name="avg").numpy()
report("allreduce_average_float32", np.allclose(averaged, [1.5, 4.5]))

mine_only = hvd.allreduce(tf.constant([float(R + 1)]), op=hvd.Sum, name="ps",
                          process_set=only_0 if R == 0 else only_1).numpy()
report("process_sets", mine_only[0] == R + 1 and only_0.included() == (R == 0), f"rank {R} got {mine_only}")

grouped = hvd.grouped_allreduce([tf.constant([float(R)]), tf.constant([[2.0 * R]])], op=hvd.Sum, name="grp")
report("grouped_allreduce", float(grouped[0][0]) == 1.0 and float(grouped[1][0][0]) == 2.0)

# Horovod's own tape on Keras 3: pass the tf.Variable behind each Keras variable (`.value`).
keras.utils.set_random_seed(3)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
x = np.full((1, 4), float(R + 1), np.float32)
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(model(x))
tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16)
grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
# d(sum(xW + b))/dW = x^T 1 per rank; averaged over ranks (x = 1 and x = 2): 1.5 everywhere.
report("distributed_gradient_tape_keras3", np.allclose(grads[0].numpy(), 1.5) and np.allclose(grads[1].numpy(), 1.0))

state = hvd.broadcast_object({"rank": R}, root_rank=0, name="obj")
report("broadcast_object", state == {"rank": 0})
