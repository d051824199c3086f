"""Parameter-shape presets of real models, for gradient-exchange benchmarks and the simulator.

The files in ``data/`` are written from the EfficientNet application's own model
(``apps.efficientnet.model.param_shapes``); a test checks that they still agree.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

__all__ = ["MODELS", "param_shapes"]

MODELS = ("efficientnet-b0", "efficientnet-b4")


@cache
def param_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """``[(name, shape), ...]`` of ``model``'s parameters in registration order."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    text = resources.files("shoal.bench").joinpath(
        f"data/{model.replace('-', '_')}.json").read_text()
    return [(name, tuple(shape)) for name, shape in json.loads(text)["shapes"]]
