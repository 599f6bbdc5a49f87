#!/usr/bin/env python3
"""A reward program for tests (tests/rl/test_env_program.cpp): the one-step form of docs/rl.md "Environments".

python3 reward_modes.py MODE; the reward is the response's length. MODE:
  order         a bare number per request, in order
  order_banner  "loading..." first, then as order
  order_log     a JSON log line {"log": "starting"} first, then as order
  ids_reverse   collect 4 requests, then answer {"id", "reward"} last first
  ids_banner    "loading..." first, then {"id", "reward"} in order
  fail          exit with status 2 on the first request
"""
import json
import sys

mode = sys.argv[1]
if mode.endswith("banner"):
    print("loading...", flush=True)
if mode == "order_log":
    print(json.dumps({"log": "starting"}), flush=True)
held = []
for line in sys.stdin:
    req = json.loads(line)
    if mode == "fail":
        sys.exit(2)
    if mode.startswith("order"):
        print(len(req["response"]), flush=True)
    elif mode == "ids_banner":
        print(json.dumps({"id": req["id"], "reward": len(req["response"])}), flush=True)
    else:
        held.append(req)
        if len(held) == 4:
            for r in reversed(held):
                print(json.dumps({"id": r["id"], "reward": len(r["response"])}), flush=True)
            held = []
