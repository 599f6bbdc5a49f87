#!/usr/bin/env bash
# Runs a moetrain command line and checks its exit status and output.
# usage: expect.sh ok|fail REGEX -- command args...
set -u
want=$1 regex=$2
shift 3
out=$("$@" 2>&1)
rc=$?
if [ "$want" = ok ] && [ $rc -ne 0 ]; then echo "expected exit 0, got $rc:"; echo "$out"; exit 1; fi
if [ "$want" = fail ] && [ $rc -eq 0 ]; then echo "expected a non-zero exit, got 0:"; echo "$out"; exit 1; fi
if ! grep -Eq -- "$regex" <<<"$out"; then echo "output does not match /$regex/:"; echo "$out"; exit 1; fi
echo "ok: exit $rc, output matches /$regex/"
