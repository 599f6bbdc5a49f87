"""Run by test_ranks.py, on one process and on every launched rank: argv[1] is the mesh (JSON)."""
import json, sys
import numpy as np
import moetrain as mt
mesh = json.loads(sys.argv[1])
m = mt.Model("tiny", device="cpu", seed=4, mesh=mesh)
rng = np.random.default_rng(0)
batch = [mt.Datum(rng.integers(1, 500, 4).tolist(), rng.integers(1, 500, n).tolist()) for n in (5, 3, 6, 2)]
out = m.sampler.sample([[1, 2, 3], [4, 5, 6, 7]], n=2, max_new_tokens=5, seed=3)
lp0 = [r["logprobs"].tolist() for r in m.trainer.forward(batch)]  # before any step
r = m.trainer.forward_backward(batch)
s = m.trainer.optim_step(mt.AdamParams(learning_rate=1e-3))
lp = m.trainer.forward(batch)
after = m.sampler.sample([[1, 2, 3], [4, 5, 6, 7]], n=2, max_new_tokens=5, seed=3)  # the stepped weights
print(json.dumps({"rank": m.rank, "world": m.world_size, "loss": r["loss"], "grad_norm": s["grad_norm"],
                  "tokens": [x.tokens.tolist() for g in out for x in g], "lp": float(sum(x["logprobs"].sum() for x in lp)), "lp0": lp0,
                  "sample_lp": [x.logprobs.tolist() for g in out for x in g],
                  "sample_lp_after": [x.logprobs.tolist() for g in after for x in g]}), flush=True)
