"""Test functions for the optimizer benchmark: a search space as a scenario declares it, plus an objective.

Each :class:`TestFunction` declares its parameters exactly as a scenario YAML would (hpo's
:class:`hpo.scenario.Param`, in definition order, conditions included), so every optimizer sees
the space the way a user's sweep does: Optuna samplers through :func:`hpo.space.suggest`, SMAC3
through :func:`hpo.space.config_space`. Objectives are minimized; ``optimum`` is the known global
minimum, or ``None`` for a real tuning task (regret is then measured against the best value any
run found).

The suite has smooth functions (Branin, Hartmann, Rosenbrock), multimodal ones (Ackley and Levy
in 4 or 5 and in 10 dimensions, Michalewicz), five more in 8 to 10 dimensions (tag ``8-10-d``:
Rosenbrock, Styblinski-Tang, Rastrigin, Michalewicz, Hartmann-6 beside two inert dimensions), a
mixed log/int/categorical space, a conditional optimizer choice, a 20-D space with two active
dimensions, and real tasks on scikit-learn data sets (an SVM, gradient boosting, an MLP).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from hpo import space
from hpo.scenario import Param


@dataclass(frozen=True)
class TestFunction:
    """A named objective over scenario parameters, to be minimized.

    Args:
        name: the function's name in the benchmark tables.
        params: the parameters, as a scenario's ``parameters`` mapping (definition order).
        objective: the value of one configuration (active parameters only).
        optimum: the known global minimum; ``None`` for a real tuning task.
        tags: kinds the function belongs to (``continuous``, ``multimodal``, ``conditional``, ``real``...).
    """

    name: str
    params: Mapping[str, Param]
    objective: Callable[[dict[str, Any]], float]
    optimum: float | None = None
    tags: tuple[str, ...] = ()

    def config_space(self, seed: int | None = None) -> Any:
        """The ConfigSpace space hpo builds for these parameters (for SMAC3)."""
        return space.config_space(self.params, seed=seed)

    def suggest(self, trial: Any) -> dict[str, Any]:
        """Suggest every active parameter on an Optuna trial, as hpo's engine does; returns the values."""
        return space.suggest(trial, self.params)

    def __call__(self, trial: Any) -> float:
        """The objective of a define-by-run Optuna trial."""
        return self.objective(self.suggest(trial))


def _float(low: float, high: float, log: bool = False, **condition: Any) -> Param:
    return Param(type="float", low=low, high=high, log=log, condition=condition or None)


def _int(low: int, high: int, log: bool = False, **condition: Any) -> Param:
    return Param(type="int", low=low, high=high, log=log, condition=condition or None)


def _choice(*choices: Any, **condition: Any) -> Param:
    return Param(type="categorical", choices=choices, condition=condition or None)


def _box(n: int, low: float, high: float) -> dict[str, Param]:
    return {f"x{i}": _float(low, high) for i in range(n)}


def _vector(v: Mapping[str, Any], n: int) -> np.ndarray:
    return np.array([v[f"x{i}"] for i in range(n)], dtype=float)


def _branin_xy(x1: float, x2: float) -> float:
    b, c = 5.1 / (4 * math.pi**2), 5 / math.pi
    return (x2 - b * x1**2 + c * x1 - 6) ** 2 + 10 * (1 - 1 / (8 * math.pi)) * math.cos(x1) + 10


def _branin(v: Mapping[str, Any]) -> float:
    return _branin_xy(v["x1"], v["x2"])


def _branin20(v: Mapping[str, Any]) -> float:
    """Branin on x3 and x11 of 20 unit-range dimensions (the other 18 do nothing)."""
    return _branin_xy(-5.0 + 15.0 * v["x3"], 15.0 * v["x11"])


_H_ALPHA = np.array([1.0, 1.2, 3.0, 3.2])
_H3_A = np.array([[3.0, 10, 30], [0.1, 10, 35], [3.0, 10, 30], [0.1, 10, 35]])
_H3_P = 1e-4 * np.array([[3689, 1170, 2673], [4699, 4387, 7470], [1091, 8732, 5547], [381, 5743, 8828]])
_H6_A = np.array(
    [[10, 3, 17, 3.5, 1.7, 8], [0.05, 10, 17, 0.1, 8, 14], [3, 3.5, 1.7, 10, 17, 8], [17, 8, 0.05, 10, 0.1, 14]]
)
_H6_P = 1e-4 * np.array(
    [
        [1312, 1696, 5569, 124, 8283, 5886],
        [2329, 4135, 8307, 3736, 1004, 9991],
        [2348, 1451, 3522, 2883, 3047, 6650],
        [4047, 8828, 8732, 5743, 1091, 381],
    ]
)


def _hartmann(a: np.ndarray, p: np.ndarray) -> Callable[[Mapping[str, Any]], float]:
    def f(v: Mapping[str, Any]) -> float:
        x = _vector(v, a.shape[1])
        return float(-np.sum(_H_ALPHA * np.exp(-np.sum(a * (x - p) ** 2, axis=1))))

    return f


def _rosenbrock(v: Mapping[str, Any]) -> float:
    """Rosenbrock in d = len(v) dimensions: minimum 0 at (1, ..., 1)."""
    x = _vector(v, len(v))
    return float(np.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2))


def _ackley(v: Mapping[str, Any]) -> float:
    """Ackley on [-5, 10]^d, d = len(v): minimum 0 at the origin, off the centre of the box."""
    x = _vector(v, len(v))
    return float(
        -20 * math.exp(-0.2 * math.sqrt(np.mean(x**2))) - math.exp(np.mean(np.cos(2 * math.pi * x))) + 20 + math.e
    )


def _levy(v: Mapping[str, Any]) -> float:
    """Levy on [-10, 10]^d, d = len(v): minimum 0 at (1, ..., 1)."""
    w = 1 + (_vector(v, len(v)) - 1) / 4
    middle = np.sum((w[:-1] - 1) ** 2 * (1 + 10 * np.sin(math.pi * w[:-1] + 1) ** 2))
    last = (w[-1] - 1) ** 2 * (1 + np.sin(2 * math.pi * w[-1]) ** 2)
    return float(np.sin(math.pi * w[0]) ** 2 + middle + last)


def _michalewicz(v: Mapping[str, Any]) -> float:
    """Michalewicz on [0, pi]^d, d = len(v) (m = 10): minimum -4.687658 in 5-D, -9.660152 in 10-D."""
    x = _vector(v, len(v))
    i = np.arange(1, len(x) + 1)
    return float(-np.sum(np.sin(x) * np.sin(i * x**2 / math.pi) ** 20))


def _styblinski_tang(v: Mapping[str, Any]) -> float:
    """Styblinski-Tang on [-5, 5]^d, d = len(v): minimum -39.166166 d at (-2.903534, ...)."""
    x = _vector(v, len(v))
    return float(0.5 * np.sum(x**4 - 16 * x**2 + 5 * x))


def _rastrigin(v: Mapping[str, Any]) -> float:
    """Rastrigin on [-5.12, 5.12]^d, d = len(v): minimum 0 at the origin."""
    x = _vector(v, len(v))
    return float(10 * len(x) + np.sum(x**2 - 10 * np.cos(2 * math.pi * x)))


_ACTIVATION_PENALTY = {"relu": 0.0, "tanh": 0.3, "sigmoid": 1.0}


def _mixed(v: Mapping[str, Any]) -> float:
    """A network-tuning caricature, optimum 0 at lr 1e-3, 64 units, 3 layers, relu, dropout 0.3."""
    lr_term = (math.log10(v["lr"]) + 3) ** 2 / 4
    width_term = (math.log2(v["units"]) - 6) ** 2 / 8
    depth_term = (v["layers"] - 3) ** 2 / 4
    dropout_term = 4 * (v["dropout"] - 0.1 * v["layers"]) ** 2
    coupling = 0.5 * (1 - math.exp(-((math.log10(v["lr"]) + 3) ** 2))) * (v["layers"] > 4)
    return lr_term + width_term + depth_term + dropout_term + coupling + _ACTIVATION_PENALTY[v["act"]]


def _optimizer_choice(v: Mapping[str, Any]) -> float:
    """A training-loss caricature over an optimizer choice with its own sub-parameters.

    SGD reaches 0 (lr / (1 - momentum) = 0.316 at batch 128, momentum 0.9, Nesterov) but needs
    all three tuned together; Adam is forgiving with a floor of 0.08, RMSprop of 0.15. The best
    learning rate grows with the batch size; weight decay is best at 1e-4.
    """
    batch_shift = math.log10(v["batch"] / 128)
    shared = (math.log10(v["weight_decay"]) + 4) ** 2 / 25 + (math.log2(v["batch"]) - 7) ** 2 / 40
    lr = math.log10(v["lr"]) - batch_shift
    if v["optimizer"] == "sgd":
        effective = lr - math.log10(1 - v["momentum"])
        branch = (effective + 0.5) ** 2 + 3 * (v["momentum"] - 0.9) ** 2 + (0.0 if v["nesterov"] else 0.05)
    elif v["optimizer"] == "adam":
        branch = 0.08 + (lr + 3.2) ** 2 / 3 + 2 * (v["beta1"] - 0.9) ** 2 + (math.log10(1 - v["beta2"]) + 3) ** 2 / 10
    else:
        branch = 0.15 + (lr + 3.5) ** 2 / 3 + 2 * (v["rho"] - 0.9) ** 2
    return shared + branch


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    return x[order] / 16.0, y[order]


def _svm_error(v: Mapping[str, Any]) -> float:
    """3-fold cross-validated error of an SVM on 600 digits (deterministic)."""
    from sklearn.model_selection import cross_val_score
    from sklearn.svm import SVC

    x, y = _digits()
    model = SVC(
        C=v["C"], gamma=v["gamma"], kernel=v["kernel"], degree=v.get("degree", 3), coef0=v.get("coef0", 0.0)
    )
    return float(1.0 - cross_val_score(model, x[:600], y[:600], cv=3).mean())


def _gbm_error(v: Mapping[str, Any]) -> float:
    """3-fold cross-validated error of histogram gradient boosting on breast cancer (deterministic)."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.model_selection import cross_val_score

    x, y = load_breast_cancer(return_X_y=True)
    model = HistGradientBoostingClassifier(
        learning_rate=v["learning_rate"], max_leaf_nodes=v["max_leaf_nodes"], min_samples_leaf=v["min_samples_leaf"],
        l2_regularization=v["l2_regularization"], max_features=v["max_features"], max_iter=100,
        early_stopping=False, random_state=0,
    )
    return float(1.0 - cross_val_score(model, x, y, cv=3).mean())


def _mlp_error(v: Mapping[str, Any]) -> float:
    """Validation error of an MLP trained 25 epochs on 1,000 digits, validated on 797 (deterministic)."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier

    x, y = _digits()
    model = MLPClassifier(
        hidden_layer_sizes=(v["hidden"],) * v["layers"], activation=v["activation"], alpha=v["alpha"],
        learning_rate_init=v["lr"], batch_size=v["batch"], max_iter=25, random_state=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(x[:1000], y[:1000])
    return float(1.0 - model.score(x[1000:], y[1000:]))


FUNCTIONS: dict[str, TestFunction] = {
    f.name: f
    for f in (
        TestFunction("branin", {"x1": _float(-5.0, 10.0), "x2": _float(0.0, 15.0)}, _branin, 0.397887357729739,
                     ("continuous",)),
        TestFunction("hartmann3", _box(3, 0.0, 1.0), _hartmann(_H3_A, _H3_P), -3.86278214782076, ("continuous",)),
        TestFunction("hartmann6", _box(6, 0.0, 1.0), _hartmann(_H6_A, _H6_P), -3.32236801141551, ("continuous",)),
        TestFunction("rosenbrock4", _box(4, -5.0, 10.0), _rosenbrock, 0.0, ("continuous",)),
        TestFunction("ackley5", _box(5, -5.0, 10.0), _ackley, 0.0, ("continuous", "multimodal", "new")),
        TestFunction("levy4", _box(4, -10.0, 10.0), _levy, 0.0, ("continuous", "multimodal", "new")),
        TestFunction("ackley10", _box(10, -5.0, 10.0), _ackley, 0.0, ("continuous", "multimodal", "new")),
        TestFunction("levy10", _box(10, -10.0, 10.0), _levy, 0.0, ("continuous", "multimodal", "new")),
        TestFunction("michalewicz5", _box(5, 0.0, math.pi), _michalewicz, -4.687658179, ("continuous", "multimodal",
                                                                                          "new")),
        TestFunction("branin20", _box(20, 0.0, 1.0), _branin20, 0.397887357729739, ("continuous", "high-dim", "new")),
        TestFunction("rosenbrock8", _box(8, -5.0, 10.0), _rosenbrock, 0.0, ("continuous", "8-10-d", "new")),
        TestFunction("styblinski8", _box(8, -5.0, 5.0), _styblinski_tang, -39.16616570377141 * 8,
                     ("continuous", "multimodal", "8-10-d", "new")),
        TestFunction("rastrigin8", _box(8, -5.12, 5.12), _rastrigin, 0.0, ("continuous", "multimodal", "8-10-d", "new")),
        TestFunction("michalewicz10", _box(10, 0.0, math.pi), _michalewicz, -9.660151715641234,
                     ("continuous", "multimodal", "8-10-d", "new")),
        TestFunction("hartmann6in8", _box(8, 0.0, 1.0), _hartmann(_H6_A, _H6_P), -3.32236801141551,
                     ("continuous", "8-10-d", "new")),  # x6 and x7 do nothing
        TestFunction(
            "mixed",
            {
                "lr": _float(1e-5, 1.0, log=True),
                "units": _int(4, 1024, log=True),
                "layers": _int(1, 8),
                "act": _choice("relu", "tanh", "sigmoid"),
                "dropout": _float(0.0, 0.9),
                "batch": Param(type="constant", value=32),
            },
            _mixed,
            0.0,
            ("mixed",),
        ),
        TestFunction(
            "optimizer",
            {
                "optimizer": _choice("sgd", "adam", "rmsprop"),
                "lr": _float(1e-5, 1.0, log=True),
                "momentum": _float(0.0, 0.99, optimizer="sgd"),
                "nesterov": _choice(False, True, optimizer="sgd"),
                "beta1": _float(0.5, 0.999, optimizer="adam"),
                "beta2": _float(0.9, 0.9999, optimizer="adam"),
                "rho": _float(0.5, 0.99, optimizer="rmsprop"),
                "weight_decay": _float(1e-7, 0.1, log=True),
                "batch": _int(16, 512, log=True),
            },
            _optimizer_choice,
            0.0,
            ("conditional", "new"),
        ),
        TestFunction(
            "svm_digits",
            {
                "kernel": _choice("rbf", "poly", "sigmoid"),
                "C": _float(1e-3, 1e4, log=True),
                "gamma": _float(1e-5, 1e1, log=True),
                "degree": _int(2, 5, kernel="poly"),
                "coef0": _float(0.0, 1.0, kernel=["poly", "sigmoid"]),
            },
            _svm_error,
            None,
            ("real", "conditional"),
        ),
        TestFunction(
            "gbm_cancer",
            {
                "learning_rate": _float(1e-3, 1.0, log=True),
                "max_leaf_nodes": _int(2, 128, log=True),
                "min_samples_leaf": _int(1, 100, log=True),
                "l2_regularization": _float(1e-8, 10.0, log=True),
                "max_features": _float(0.1, 1.0),
            },
            _gbm_error,
            None,
            ("real", "new"),
        ),
        TestFunction(
            "mlp_digits",
            {
                "layers": _int(1, 3),
                "hidden": _int(8, 256, log=True),
                "activation": _choice("relu", "tanh", "logistic"),
                "alpha": _float(1e-7, 1.0, log=True),
                "lr": _float(1e-4, 0.3, log=True),
                "batch": _int(16, 256, log=True),
            },
            _mlp_error,
            None,
            ("real", "new"),
        ),
    )
}
