"""A saved model as `runner evaluate` and `runner predict` compute it, for the tests that check their answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _float32(config: Any) -> Any:
    """The config with every mixed policy (`mixed_bfloat16`, `mixed_float16`) made float32; inputs' dtypes kept."""
    if isinstance(config, dict):
        if config.get("class_name") == "DTypePolicy" and str(config["config"]["name"]).startswith("mixed_"):
            return {**config, "config": {**config["config"], "name": "float32"}}
        return {key: _float32(value) for key, value in config.items()}
    if isinstance(config, list):
        return [_float32(value) for value in config]
    return config


def as_evaluated(path: str | Path) -> Any:
    """The model saved at `path` (a .keras file), computing as `runner evaluate` and `runner predict` compute it.

    Those commands build the spec's model under Keras's float32 policy (runner/job/predict.py `load_trained`
    applies no train.mixed_precision) and load the weights into it; `keras.models.load_model` keeps each
    layer's saved policy instead. A job that trained in bfloat16 (`auto` on a CPU with avx512_bf16, or
    RUNNER_CPU_BF16=1) answers from load_model in bfloat16, some 1e-3 from the runner's float32 answers in a
    probability (0.0504 against 0.0491): compared at 1e-5, that is a difference of precision, not of weights."""
    import keras

    saved = keras.models.load_model(path, compile=False)
    model = saved.__class__.from_config(_float32(saved.get_config()))
    model.set_weights(saved.get_weights())
    return model
