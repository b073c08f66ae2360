"""Import TensorFlow without the packages Keras 3 loads only for extras that no rank uses.

On `import tensorflow`, Keras 3 imports scikit-learn (for the estimators of `keras.wrappers`),
matplotlib.pyplot (for the image galleries of `keras.visualization`) and pandas (to accept a
DataFrame or Series as `model.fit`'s data) whenever they are installed, and in a generated
project all three are: scikit-learn ships the default digits data, matplotlib draws the pipeline
timeline, MLflow brings pandas. None is used while training, yet they cost every rank seconds of
its start-up, which every job, every elastic restart and every test pays per rank
(docs/architecture.md measures them).

So hvd_runtime.tf imports TensorFlow with those hidden, then shows them again at once: an entry
of None in sys.modules makes an import raise ImportError, which Keras catches as "not installed"
(the language's documented behaviour, not a patch of Keras). A later `import sklearn`, `import
matplotlib` or `import pandas` works as usual (MLflow's, on rank 0). Only Keras' own extras are
left without their package: its scikit-learn wrappers, image-gallery plots, and a DataFrame
taken as a DataFrame by `model.fit`; a script that wants them imports that package before
hvd_runtime.tf, and then it is not hidden.
"""

from __future__ import annotations

import sys

from hvd_runtime.tf.native_logs import quiet_native_notices

KERAS_EXTRAS = ("sklearn", "matplotlib", "pandas")


def import_tensorflow() -> None:
    """Import TensorFlow (and Keras) once, hiding KERAS_EXTRAS that this process has not imported yet,
    and its native start-up notices (hvd_runtime.tf.native_logs)."""
    if "tensorflow" in sys.modules:
        return
    hidden = [name for name in KERAS_EXTRAS if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        with quiet_native_notices():
            import tensorflow  # noqa: F401
    finally:
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
