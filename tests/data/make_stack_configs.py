"""Write this stack's layer configs for tests/test_itex_configs.py.

Run once per stack from the repository root (the file name says which stack):
    .venv/bin/python tests/data/make_stack_configs.py        # Keras 3
    .venv-itex/bin/python tests/data/make_stack_configs.py   # Keras 2.15 + ITEX
"""

import json
import os

import keras

import keras_amp_plus as kap
from keras_amp_plus import _compat


def layers():
    return {
        "LayerNormalization": kap.layers.LayerNormalization(
            epsilon=1e-4, center=False, name="ln", dtype="mixed_bfloat16"
        ),
        "InstanceNormalization": kap.layers.InstanceNormalization(
            axis=-1, gamma_initializer="zeros", name="inorm", dtype="mixed_float16"
        ),
        "Swish": kap.layers.Swish(beta=0.5, trainable_beta=True, name="swish"),
    }


def main():
    configs = {name: keras.layers.serialize(layer) for name, layer in layers().items()}
    stack = "keras3" if _compat.IS_KERAS_3 else "keras2"
    path = os.path.join(os.path.dirname(__file__), f"stack_configs_{stack}.json")
    with open(path, "w") as f:
        json.dump(
            {"keras": keras.__version__, "configs": configs},
            f,
            indent=1,
            sort_keys=True,
        )
        f.write("\n")
    print(path)


if __name__ == "__main__":
    main()
