#!/usr/bin/env bash
# Regenerates requirements.lock from requirements.in: installs what is wanted into a scratch
# venv and pins every installed package (transitive ones and setuptools too) at its version.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
scratch=$(mktemp -d /tmp/kitchen-lock.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
python3 -m venv "$scratch/venv"
"$scratch/venv/bin/pip" install --quiet -r "$root/requirements.in"
"$scratch/venv/bin/pip" check
{
  echo "# Generated from requirements.in by tools/python/lock.sh: every package pinned, transitive ones too."
  "$scratch/venv/bin/pip" freeze --all --exclude pip | sort --ignore-case
} >"$root/requirements.lock.tmp"
mv "$root/requirements.lock.tmp" "$root/requirements.lock"
echo "wrote requirements.lock ($(grep -vc '^#' "$root/requirements.lock") packages)"
