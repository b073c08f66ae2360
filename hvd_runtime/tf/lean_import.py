"""Import TensorFlow without the packages Keras 3 loads only for extras that no rank uses.

On `import tensorflow`, Keras 3 imports scikit-learn (for the estimators of `keras.wrappers`)
and matplotlib.pyplot (for the image galleries of `keras.visualization`) whenever they are
installed, and in a generated project both are: scikit-learn ships the default digits data,
matplotlib draws the pipeline timeline. Neither is used while training, yet the two cost every
rank about 2.4 s of its start-up (a 2-core CPU: `import tensorflow` 9.4 s with them, 7.0 s
without), which every job, every elastic restart and every test pays per rank.

So hvd_runtime.tf imports TensorFlow with those two hidden, then shows them again at once: an
entry of None in sys.modules makes an import raise ImportError, which Keras catches as "not
installed" (the language's documented behaviour, not a patch of Keras). A later `import sklearn`
or `import matplotlib` works as usual. Only Keras' own scikit-learn wrappers and image-gallery
plots are left saying their package is missing; a script that wants them imports scikit-learn
or matplotlib before hvd_runtime.tf, and then nothing is hidden.
"""

from __future__ import annotations

import sys

KERAS_EXTRAS = ("sklearn", "matplotlib")


def import_tensorflow() -> None:
    """Import TensorFlow (and Keras) once, hiding KERAS_EXTRAS that this process has not imported yet."""
    if "tensorflow" in sys.modules:
        return
    hidden = [name for name in KERAS_EXTRAS if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        import tensorflow  # noqa: F401
    finally:
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
