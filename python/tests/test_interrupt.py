"""Ctrl-C: SIGINT during a long call stops it at its next engine step or micro-batch (KeyboardInterrupt), and
Python's own handler is back afterwards."""
import signal
import subprocess
import sys
import time

# Each script starts with Python's own SIGINT handler whatever it inherited (a runner that starts the tests in the
# background hands them SIGINT ignored, and the call then puts that back, as it should).
SCRIPT = r"""
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import moetrain as mt
m = mt.Model("tiny", device="cpu", seed=1)
what = sys.argv[1]
print("ready", flush=True)
t = time.time()
try:
    if what == "sample":
        m.sampler.sample([[1, 2, 3]] * 64, n=8, max_new_tokens=1500)
    else:
        batch = [mt.Datum([1, 2, 3], [5 + i % 500 for i in range(1800)])] * 64
        m.trainer.forward_backward(batch, max_tokens=2000)
    print("finished", flush=True)
except KeyboardInterrupt:
    print("interrupted after %.1f s" % (time.time() - t), flush=True)
try:
    print("sleeping", flush=True)
    time.sleep(30)
except KeyboardInterrupt:
    print("python's handler", flush=True)
"""


def interrupt(what):
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, what], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    line = p.stdout.readline().strip()
    if p.stdout.readline().strip() == "sleeping":  # in Python's own code again
        p.send_signal(signal.SIGINT)
    rest = p.communicate(timeout=60)
    return line, rest[0], p.returncode, rest[1]


def test_ctrl_c_stops_sampling():
    line, rest, code, err = interrupt("sample")
    assert line.startswith("interrupted after"), (line, rest, err)
    assert float(line.split()[2]) < 10
    assert "python's handler" in rest and code == 0, (rest, err)


def test_ctrl_c_stops_forward_backward():
    line, rest, code, err = interrupt("train")
    assert line.startswith("interrupted after"), (line, rest, err)
    assert "python's handler" in rest and code == 0, (rest, err)


GRPO_SCRIPT = r"""
import json, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
import moetrain as mt
d, tok = sys.argv[1], sys.argv[2]
mt.Model("tiny", device="cpu", seed=3, tokenizer=tok).trainer.export_hf(d + "/model", dtype="f32")
with open(d + "/p.jsonl", "w") as f:
    for q in ["a", "b", "c", "d"]:
        f.write(json.dumps({"prompt": q}) + "\n")
first = []
def reward(prompts, responses, metadata):
    if not first:
        first.append(1)
        print("ready", flush=True)
    return [len(r) % 3 for r in responses]
try:
    mt.rl.GRPO(model=d + "/model", prompts=d + "/p.jsonl", device="cpu", steps=100000, prompts_per_step=2, n=4,
               max_new_tokens=8, run_dir=d + "/run").run(reward_fn=reward)
except KeyboardInterrupt as e:
    print("interrupted:", e, flush=True)
print(sorted(x for x in os.listdir(d + "/run") if x.startswith("checkpoint-")), flush=True)
"""


def test_ctrl_c_stops_grpo_after_a_saved_step(tmp_path):
    from conftest import TOKENIZER

    p = subprocess.Popen([sys.executable, "-c", GRPO_SCRIPT, str(tmp_path), str(TOKENIZER)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "interrupted: grpo stopped by a signal after a saved step" in out, out + err
    assert "'checkpoint-" in out, out
