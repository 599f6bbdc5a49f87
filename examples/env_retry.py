#!/usr/bin/env python3
"""An environment for `moetrain grpo` (docs/rl.md "Environments"): an arithmetic question, reward 1 for a
right first answer; a wrong one hears "wrong, try again" once, and a right second answer gets 0.5.

The trainer runs it as `python3 examples/env_retry.py` and speaks JSON lines: one request per line on stdin,
one reply per init or step request on stdout, flushed at once. The right answer is the prompt line's "answer",
else the sum the prompt asks for ("What is 3 + 4?"); a prompt with neither gets a question from init."""
import json
import re
import sys

answers = {}  # episode id -> the right answer
for line in sys.stdin:
    req = json.loads(line)
    eid, kind = req["id"], req["type"]
    if kind == "close":  # no reply
        answers.pop(eid, None)
        continue
    if kind == "init":
        reply, meta = {"id": eid}, req.get("metadata") or {}
        asked = re.findall(r"(-?\d+) *\+ *(-?\d+)", req["prompt"])
        if "answer" in meta:
            answers[eid] = int(meta["answer"])
        elif asked:  # the prompt's last "a + b"
            answers[eid] = int(asked[-1][0]) + int(asked[-1][1])
        else:  # a question of its own, the same for every sample of the prompt
            a, b = len(req["prompt"]) % 50, 7
            answers[eid] = a + b
            reply["observations"] = [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}]
    elif eid not in answers:
        reply = {"id": eid, "error": f"episode {eid} was never started, or is closed"}
    else:
        numbers = re.findall(r"-?\d+", req["text"])
        right = bool(numbers) and int(numbers[-1]) == answers[eid]
        if right or req["turn"] >= 1:
            reply = {"id": eid, "reward": (1.0 if req["turn"] == 0 else 0.5) if right else 0.0, "done": True}
        else:
            retry = [{"role": "user", "content": "wrong, try again"}]
            reply = {"id": eid, "reward": 0.0, "done": False, "observations": retry}
    print(json.dumps(reply), flush=True)  # unflushed, the reply would sit in a buffer and miss the deadline
