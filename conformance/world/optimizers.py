"""The optimizers cases name (:data:`OPTIMIZERS`), and a custom optimizer
whose per-parameter state is more than tensors shaped like the parameter
(SPEC OPT-STATE-1), as optimizers from outside torch keep (Shampoo-like
preconditioners, Lion, Muon).

Each parameter's state holds:

* ``step``: a 0-d tensor on the CPU, as torch's own optimizers keep it;
* ``momentum``: a tensor shaped like the parameter;
* ``scale``: another 0-d tensor (a running product of ``beta``), on the
  parameter's device;
* ``count`` (int), ``decay`` (float) and ``kind`` (str): Python values;
* ``precond``: a nested dict with a list of tensors shaped like the
  parameter (``traces``) and a Python int (``order``).

Every update is elementwise, so a sharded parameter's shards update exactly
as the full tensor would; the 0-d and Python values depend only on the step
count and the hyperparameters, so they are the same on every rank.
Deterministic: two runs from the same state end bitwise equal.
"""

from __future__ import annotations

import torch

from .. import tensors


class Preconditioned(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-2,
        beta: float = 0.9,
        beta2: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        super().__init__(params, {"lr": lr, "beta": beta, "beta2": beta2, "eps": eps, "weight_decay": weight_decay})

    def _init_state(self, p: torch.Tensor) -> dict:
        local = tensors.local(p)
        return {
            "step": torch.tensor(0.0),
            "momentum": torch.zeros_like(p),
            "scale": torch.ones((), dtype=torch.float32, device=local.device),
            "count": 0,
            "decay": 1.0,
            "kind": "matrix" if p.dim() >= 2 else "vector",
            "precond": {"traces": [torch.zeros_like(p), torch.zeros_like(p)], "order": 2},
        }

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta, beta2, eps, wd = (group[k] for k in ("lr", "beta", "beta2", "eps", "weight_decay"))
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self._init_state(p))
                grad = p.grad
                state["step"] += 1
                state["count"] += 1
                state["scale"].mul_(beta)
                state["decay"] = state["decay"] * 0.5 + 0.25
                second, magnitude = state["precond"]["traces"]
                second.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                magnitude.mul_(beta).add_(grad.abs(), alpha=1 - beta)
                momentum = state["momentum"].mul_(beta).add_(grad, alpha=1 - beta)
                # Python floats: the 0-d tensor and the count enter the update as scalars.
                bias = 1.0 - state["scale"].item()
                shrink = 1.0 - lr * wd * state["decay"]
                p.mul_(shrink).addcdiv_(momentum, second.sqrt().add_(eps).add_(magnitude, alpha=1e-3), value=-lr / bias)
        return loss


# -- the optimizers cases name ----------------------------------------------


def _adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _adam_amsgrad(groups):
    return torch.optim.Adam(groups, lr=1e-2, betas=(0.8, 0.9), amsgrad=True)


def _sgd(groups):
    return torch.optim.SGD(groups, lr=1e-2, momentum=0.9, dampening=0.1)


def _sgd_plain(groups):
    return torch.optim.SGD(groups, lr=1e-2)


def _adagrad(groups):
    return torch.optim.Adagrad(groups, lr=1e-2, initial_accumulator_value=0.1)


def _preconditioned(groups):
    return Preconditioned(groups, lr=1e-2, beta=0.9, beta2=0.99)


OPTIMIZERS = {
    "adamw": _adamw,
    "adam_amsgrad": _adam_amsgrad,
    "sgd": _sgd,
    "sgd_plain": _sgd_plain,
    "adagrad": _adagrad,
    # Per-parameter state beyond tensors shaped like the parameter (OPT-STATE-1).
    "custom": _preconditioned,
}
