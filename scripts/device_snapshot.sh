#!/usr/bin/env bash
# For the device tool, which copies the working tree (committed, modified and untracked files alike):
# `scripts/device_snapshot.sh save` (here) records every uncommitted change as a patch and a list of
# untracked files; `scripts/device_snapshot.sh restore` (there) reverts them, leaving the tree of HEAD
# (plus the carried ignored paths), so a run measures exactly the committed code while other work in
# the tree is half done.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  save)
    git diff HEAD --binary > .devsnap.patch
    git ls-files --others --exclude-standard > .devsnap.untracked
    echo "device_snapshot: $(grep -c '^diff --git' .devsnap.patch || true) modified files, $(wc -l < .devsnap.untracked) untracked to drop"
    ;;
  restore)
    if [ -s .devsnap.patch ]; then patch -R -p1 -s < .devsnap.patch || git apply -R .devsnap.patch; fi
    while IFS= read -r f; do rm -f -- "$f"; done < .devsnap.untracked
    rm -f .devsnap.patch .devsnap.untracked
    echo "device_snapshot: restored HEAD's tree"
    ;;
  *) echo "usage: scripts/device_snapshot.sh save|restore" >&2; exit 2 ;;
esac
