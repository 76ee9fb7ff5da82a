"""The MLP gate activations of transformers' `ACT2FN`, by their `hidden_act` names, in Paddle.

Each one computes what the transformers class of the same name computes (same formula, same
constants), so a checkpoint trained with e.g. `gelu_pytorch_tanh` runs as it did there. The names
are `fastdeploy_lp.config.HIDDEN_ACTIVATIONS`, which the config parser checks before a model is built.
"""

from __future__ import annotations

import math
from typing import Callable

import paddle
import paddle.nn.functional as F

from fastdeploy_lp.model_config import HIDDEN_ACTIVATIONS, UnsupportedCheckpointError


def _gelu_tanh(x: paddle.Tensor) -> paddle.Tensor:
    # NewGELUActivation / GELUTanh / AccurateGELUActivation: 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))
    return 0.5 * x * (1.0 + paddle.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def _gelu_fast(x: paddle.Tensor) -> paddle.Tensor:  # FastGELUActivation (rounded constant)
    return 0.5 * x * (1.0 + paddle.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _laplace(x: paddle.Tensor, mu: float = 0.707107, sigma: float = 0.282095) -> paddle.Tensor:
    return 0.5 * (1.0 + paddle.erf((x - mu) / (sigma * math.sqrt(2.0))))


ACTIVATIONS: dict[str, Callable[[paddle.Tensor], paddle.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # exact (erf)
    "gelu_python": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_python_tanh": _gelu_tanh,
    "gelu_accurate": _gelu_tanh,
    "gelu_fast": _gelu_fast,
    "gelu_10": lambda x: paddle.clip(F.gelu(x), -10.0, 10.0),
    "quick_gelu": lambda x: x * F.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu2": lambda x: paddle.square(F.relu(x)),
    "relu6": F.relu6,
    "leaky_relu": lambda x: F.leaky_relu(x, negative_slope=0.01),  # torch.nn.LeakyReLU's default
    "sigmoid": F.sigmoid,
    "tanh": paddle.tanh,
    "mish": F.mish,
    "laplace": _laplace,
    "linear": lambda x: x,
}
assert set(ACTIVATIONS) == set(HIDDEN_ACTIVATIONS), "config.HIDDEN_ACTIVATIONS and ACTIVATIONS disagree"


def activation(name: str) -> Callable[[paddle.Tensor], paddle.Tensor]:
    if name not in ACTIVATIONS:
        raise UnsupportedCheckpointError(
            f"model: unsupported config switch hidden_act={name!r}; the activations implemented are "
            f"{', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]
