#!/usr/bin/env python3
"""An environment program for tests (tests/rl/test_env_program.cpp), speaking docs/rl.md "Environments".

python3 env_modes.py MODE [N]; MODE:
  ordered    answer each request at once: init -> one observation "hello <id>", step -> reward len(text),
             done, metadata {"turn", "tool"}
  plain      as ordered, but init gives no observation (the n episodes of a prompt then start alike)
  twoturn    init -> "hello" (shared by a prompt's episodes); step 0 -> reward len(text) % 3, observation
             "again", not done; step 1 -> reward len(text) % 4 + 0.5 * (the id is odd), done, metadata
             {"first": the first turn's reward}
  reverse N  collect N requests, then answer them last first
  banner     write "loading..." first, then as ordered
  crash N    answer N requests, then exit with status 3
  slow       answer the first request, then sleep
  malformed  an unknown id first, then as ordered except that episode 0's step reply comes twice and odd
             episodes' step replies have no "done"
"""
import json
import sys
import time

mode = sys.argv[1]
count = int(sys.argv[2]) if len(sys.argv) > 2 else 0


first = {}


def reply(req):
    if mode == "twoturn":
        if req["type"] == "init":
            return {"id": req["id"], "observations": [{"role": "user", "content": "hello"}]}
        if req["turn"] == 0:
            first[req["id"]] = len(req["text"]) % 3
            return {"id": req["id"], "reward": first[req["id"]], "done": False,
                    "observations": [{"role": "user", "content": "again"}]}
        return {"id": req["id"], "reward": len(req["text"]) % 4 + 0.5 * (req["id"] % 2), "done": True,
                "metadata": {"first": first.pop(req["id"], -1)}}
    if req["type"] == "init":
        if mode == "plain":
            return {"id": req["id"], "observations": []}
        return {"id": req["id"], "observations": [{"role": "user", "content": "hello %d" % req["id"]}]}
    tool = req["tool_call"]["name"] if req["tool_call"] else None
    r = {"id": req["id"], "reward": len(req["text"]), "done": True, "metadata": {"turn": req["turn"], "tool": tool}}
    if mode == "malformed" and req["id"] % 2:
        del r["done"]
    return r


def send(obj):
    print(json.dumps(obj), flush=True)


if mode == "banner":
    print("loading...", flush=True)
if mode == "malformed":
    send({"id": 999, "reward": 0, "done": True})
held, answered = [], 0
for line in sys.stdin:
    req = json.loads(line)
    if req["type"] == "close":
        continue
    if mode == "reverse":
        held.append(req)
        if len(held) == count:
            for r in reversed(held):
                send(reply(r))
            held = []
        continue
    if mode == "crash" and answered == count:
        sys.exit(3)
    if mode == "slow" and answered == 1:
        time.sleep(30)
    send(reply(req))
    if mode == "malformed" and req["type"] == "step" and req["id"] == 0:
        send(reply(req))
    answered += 1
