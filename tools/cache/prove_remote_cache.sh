#!/usr/bin/env bash
# Shows that the remote cache serves a whole test run. Run it after a `./bazel test //...` with
# `--config=remote` (which uploads every action and test result).
#  1. A second clone in another directory, with its own output base: every action and every
#     test result must come from the cache.
#  2. This clone after `bazel clean --expunge`: the same.
# Prints the counts and exits non-zero if anything had to run locally.
#   tools/cache/prove_remote_cache.sh [TARGETS...]   (default //...)
set -euo pipefail
targets=("${@:-//...}")
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d /tmp/kitchen-cache-proof.XXXXXX)
trap 'rm -rf "$work"' EXIT
status=0

# Reads a Bazel log; prints a one-line verdict; returns 1 unless everything was a cache hit.
verdict() {
  local label=$1 log=$2
  local procs hits local_runs executed
  procs=$(grep -E '^INFO: [0-9]+ processes' "$log" | tail -1)
  hits=$(grep -oE '[0-9]+ remote cache hit' <<<"$procs" | grep -oE '^[0-9]+' || echo 0)
  local_runs=$(grep -oE '[0-9]+ (linux-sandbox|local|processwrapper-sandbox|worker)' <<<"$procs" \
    | awk '{n += $1} END {print n + 0}')
  executed=$(grep -E '^Executed [0-9]+ out of [0-9]+ test' "$log" | tail -1)
  echo "remote cache, $label: $hits actions were remote cache hits, ${local_runs:-0} ran locally; $executed"
  [[ ${local_runs:-0} -eq 0 && $hits -gt 0 ]]
}

# Names the actions of a Bazel execution log that ran instead of coming from the cache.
missed() {
  python3 - "$1" <<'PY'
import json, sys
text, i, decoder = open(sys.argv[1]).read(), 0, json.JSONDecoder()
while i < len(text):
    if text[i].isspace():
        i += 1
        continue
    entry, i = decoder.raw_decode(text, i)
    if entry.get("runner") and not entry.get("remoteCacheHit"):
        outputs = [o["path"] for o in entry.get("actualOutputs", [])][:1]
        print(f"  ran, not a hit: {entry.get('mnemonic')} {outputs[0] if outputs else ''}")
PY
}

echo "== second clone in $work/clone"
git clone -q "$root" "$work/clone"
(cd "$work/clone" && ./bazel --output_base="$work/output_base" test "${targets[@]}" --config=remote \
  --execution_log_json_file="$work/clone.exec.json" >"$work/clone.log" 2>&1) || true
verdict "second clone" "$work/clone.log" || { status=1; missed "$work/clone.exec.json"; }
(cd "$work/clone" && ./bazel --output_base="$work/output_base" shutdown) || true

echo "== this clone after bazel clean --expunge"
(cd "$root" && ./bazel clean --expunge >"$work/clean.log" 2>&1 && ./bazel test "${targets[@]}" --config=remote \
  --execution_log_json_file="$work/expunge.exec.json" >"$work/expunge.log" 2>&1) || true
verdict "after clean --expunge" "$work/expunge.log" || { status=1; missed "$work/expunge.exec.json"; }

if ((status)); then
  echo "remote cache: NOT every action was a hit; logs follow" >&2
  tail -n 30 "$work/clone.log" "$work/expunge.log" >&2
fi
exit $status
