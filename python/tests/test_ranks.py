"""The API under launched ranks: `moetrain launch --exe python -- script.py` runs the same script on every rank
(RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launcher), Model(mesh=...) lays the model out over them, and each
rank's sampler, loss, gradient norm and log-probs after the step equal one process's."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
BIN = os.environ.get("MOETRAIN_BIN", str(HERE.parents[1] / "build" / "moetrain"))


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(l[l.index("{"):]) for l in r.stdout.splitlines() if '"rank"' in l]


@pytest.mark.skipif(not os.path.exists(BIN), reason=f"no moetrain binary at {BIN} (set MOETRAIN_BIN)")
@pytest.mark.parametrize("mesh", [{"dp_shard": 2}, {"ep": 2}, {"tp": 2}, {"sp": 2}])
def test_launched_ranks_equal_one_process(mesh):
    script = str(HERE / "mesh_script.py")
    one = run([sys.executable, script, "{}"])[0]
    ranks = run([BIN, "launch", "--nproc-per-node", "2", "--exe", sys.executable, "--", script, json.dumps(mesh)])
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["world"] == 2
        assert r["tokens"] == one["tokens"]
        assert r["loss"] == pytest.approx(one["loss"], rel=1e-6)
        assert r["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        assert r["lp"] == pytest.approx(one["lp"], rel=1e-5)
        # After the step the sampler reads the new weights (under tp and sp a copy gathered again).
        for a, b in zip(r["sample_lp_after"], one["sample_lp_after"]):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
        assert r["sample_lp_after"] != r["sample_lp"]


TORCHRUN = os.environ.get("TORCHRUN") or shutil.which("torchrun")


@pytest.mark.skipif(not TORCHRUN, reason="no torchrun (set TORCHRUN=PATH, or install torch)")
def test_torchrun_ranks_equal_one_process():
    """Under torchrun (its agent's store on MASTER_PORT, ours on the next port) as under moetrain launch."""
    script = str(HERE / "mesh_script.py")
    one = run([sys.executable, script, "{}"])[0]
    ranks = run([TORCHRUN, "--nproc-per-node", "2", script, json.dumps({"dp_shard": 2})])
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["tokens"] == one["tokens"]
        assert r["loss"] == pytest.approx(one["loss"], rel=1e-6)


@pytest.mark.skipif(not os.path.exists(BIN), reason=f"no moetrain binary at {BIN} (set MOETRAIN_BIN)")
@pytest.mark.parametrize("mesh", [{"dp_shard": 2}, {"ep": 2}])
def test_batch_invariant_ranks_give_one_process_log_probs_bit_for_bit(mesh):
    """MOETRAIN_BATCH_INVARIANT=1 (docs/rl.md "Bit-equal rollout and trainer log-probs"): under dp_shard and ep
    the trainer's log-probs and the sampler's equal one process's bit for bit, and the trainer's equal the
    sampler's on the sampled tokens."""
    env = dict(os.environ, MOETRAIN_BATCH_INVARIANT="1")
    script = str(HERE / "mesh_script.py")
    one = run([sys.executable, script, "{}"], env)[0]
    ranks = run([BIN, "launch", "--nproc-per-node", "2", "--exe", sys.executable, "--", script, json.dumps(mesh)], env)
    for r in ranks:
        assert r["tokens"] == one["tokens"]
        assert r["sample_lp"] == one["sample_lp"]
        assert r["lp0"] == one["lp0"]
