"""A custom loss in Python: DPO's pairwise loss on (chosen, rejected) responses, through the trainer's
forward_backward(batch, loss=fn). The function receives the per-token log-probs and returns the loss and its
gradient per token; the engine back-propagates them. The gradient is checked against central finite differences
of the loss along the gradient's direction.

    python examples/python/dpo_loss.py [--model tiny] [--steps 20] [--device cpu]
"""
import argparse, json

import numpy as np

import moetrain as mt

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="tiny")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--beta", type=float, default=0.5)
ap.add_argument("--device", default="cpu", help="cpu (fp32: the finite differences are exact to ~1e-5) or cuda")
a = ap.parse_args()

model = mt.Model(a.model, device=a.device, seed=1)
rng = np.random.default_rng(0)
pairs = [(rng.integers(1, 200, 5).tolist(), rng.integers(1, 200, 4).tolist(), rng.integers(1, 200, 4).tolist())
         for _ in range(4)]
batch = [mt.Datum(p, r) for p, c, x in pairs for r in (c, x)]  # chosen, rejected, chosen, ...
ref = [lp.sum() for lp in (r["logprobs"] for r in model.trainer.forward(batch))]  # the frozen reference


def dpo(logprobs, data):
    """-mean log sigmoid(beta ((c - c_ref) - (x - x_ref))) over the pairs; d/dlogp per token."""
    loss, grads = 0.0, []
    for k in range(0, len(logprobs), 2):
        z = a.beta * ((logprobs[k].sum() - ref[k]) - (logprobs[k + 1].sum() - ref[k + 1]))
        loss += np.logaddexp(0.0, -z) / (len(logprobs) // 2)
        g = -a.beta / (1.0 + np.exp(z)) / (len(logprobs) // 2)  # d loss / d z times dz/dlogp
        grads += [np.full(logprobs[k].shape, g, np.float32), np.full(logprobs[k + 1].shape, -g, np.float32)]
    return float(loss), grads


def loss_at(params):
    model._m.set_parameters(params)
    return dpo([r["logprobs"].astype(np.float64) for r in model.trainer.forward(batch)], batch)[0]


theta = model._m.parameters()
model.trainer.forward_backward(batch, loss=dpo)
g = model._m.gradients()
u = g / np.linalg.norm(g)
eps = 1e-2 / np.linalg.norm(g)
fd = (loss_at(theta + eps * u) - loss_at(theta - eps * u)) / (2 * eps)  # = |g| when g is the gradient
model._m.set_parameters(theta)
losses = []
for step in range(a.steps):
    if step > 0:
        model.trainer.forward_backward(batch, loss=dpo)
    losses.append(loss_at(model._m.parameters()))
    model.trainer.optim_step(mt.AdamParams(learning_rate=1e-3))
norm = float(np.linalg.norm(g.astype(np.float64)))
print(json.dumps({"example": "dpo_loss", "grad_norm": norm, "finite_difference": float(fd),
                  "relative_error": abs(float(fd) - norm) / norm, "loss_first": float(losses[0]),
                  "loss_last": float(losses[-1])}))
