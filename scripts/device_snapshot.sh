#!/usr/bin/env bash
# For the device tool, which copies the working tree (committed, modified and untracked files alike)
# while others may be mid-edit: `scripts/device_snapshot.sh save` (here, just before the run) packs
# HEAD's files (tests/assets aside: large, and only added to) and their list; `... restore` (there)
# deletes every file under the source folders that HEAD lacks and unpacks HEAD's over the rest, so a
# run builds and measures exactly the committed code.
set -euo pipefail
cd "$(dirname "$0")/.."
dirs=(apps bench docs scripts src tests tools)
case "${1:-}" in
  save)
    git archive HEAD -o .devsnap.tar.gz -- . ':!tests/assets'
    git ls-files > .devsnap.files
    echo "device_snapshot: HEAD $(git rev-parse --short HEAD), $(wc -l < .devsnap.files) files"
    ;;
  restore)
    find "${dirs[@]}" -type f | grep -v '^tests/assets/' | sort > /tmp/devsnap.present
    sort .devsnap.files | comm -23 /tmp/devsnap.present - | while IFS= read -r f; do rm -f -- "$f"; done
    # Unpack beside the tree and copy only the files that differ: they get a new time, so a build
    # directory kept on a warm machine rebuilds exactly what changed.
    rm -rf /tmp/devsnap && mkdir -p /tmp/devsnap && tar -xzf .devsnap.tar.gz -C /tmp/devsnap
    (cd /tmp/devsnap && find . -type f) | while IFS= read -r f; do
      cmp -s "/tmp/devsnap/$f" "$f" || { mkdir -p "$(dirname "$f")" && cp "/tmp/devsnap/$f" "$f"; }
    done
    rm -f .devsnap.tar.gz .devsnap.files
    echo "device_snapshot: restored HEAD's tree"
    ;;
  *) echo "usage: scripts/device_snapshot.sh save|restore" >&2; exit 2 ;;
esac
