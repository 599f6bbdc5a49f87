#!/usr/bin/env python3
"""Fails, with a unified diff per file, when a file that tools/gen_op_dispatch.py generates differs from
what the generator writes from the committed src/ops/ops.h (a hand edit, or ops.h changed without
regenerating). Usage: gen_op_dispatch_up_to_date.py REPO_ROOT"""
import difflib, os, subprocess, sys, tempfile

FILES = ["src/backend/cpu/cpu_ops.h", "src/backend/cuda/cuda_ops.h", "src/ops/ops.cpp",
         "src/backend/cuda/cuda_ops_stub.cpp"]
root = sys.argv[1]
with tempfile.TemporaryDirectory() as out:
    subprocess.run([sys.executable, os.path.join(root, "tools/gen_op_dispatch.py"), "--out", out], check=True)
    stale = 0
    for f in FILES:
        want = open(os.path.join(out, f)).read().splitlines(keepends=True)
        have = open(os.path.join(root, f)).read().splitlines(keepends=True)
        if want != have:
            stale += 1
            sys.stdout.writelines(difflib.unified_diff(have, want, f"{f} (committed)", f"{f} (generated)"))
if stale:
    print(f"\n{stale} generated file(s) differ from tools/gen_op_dispatch.py's output: edit src/ops/ops.h or the "
          "generator's tables, then run python3 tools/gen_op_dispatch.py (see docs/ops.md)")
    sys.exit(1)
print(f"all {len(FILES)} generated files match tools/gen_op_dispatch.py")
