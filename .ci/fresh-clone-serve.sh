#!/usr/bin/env bash
# `make serve` from a fresh clone brings up a working server: clone, `make serve` (creates .venv,
# installs, converts the default model, SmolLM2-135M-Instruct, into a checkpoint unless the cache
# has it, starts Redis, the kvstore, a worker and the gateway), run the curl command it prints
# (one streamed chat completion), then Ctrl-C (SIGINT to its process group, as a terminal sends
# it) and check that everything stopped. Its phases' times are printed at the end.
#
#   .ci/fresh-clone-serve.sh [--working-tree] [SOURCE]
#
# SOURCE: the repository to clone (default: the one this script is in). --working-tree: copy the
# source checkout's uncommitted files (tracked and untracked, not ignored) over the clone, to try
# changes before they are committed. The clone (with its .venv) is deleted at the end.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
overlay=0
if [ "${1:-}" = "--working-tree" ]; then overlay=1; shift; fi
src="${1:-$here}"
work="$(mktemp -d /tmp/pagedserve-clone.XXXXXX)"
dest="$work/pagedserve"
log="$work/serve.log"
pid=""

cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill -KILL -- "-$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

git clone -q "$src" "$dest"
if [ "$overlay" = 1 ]; then
  (cd "$src" && git ls-files -z --cached --others --exclude-standard) |
    while IFS= read -r -d '' f; do
      if [ -e "$src/$f" ]; then mkdir -p "$dest/$(dirname "$f")" && cp -p "$src/$f" "$dest/$f"; fi
    done
fi
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"

started=$SECONDS
# Its own process group (setsid) with SIGINT at its default (a non-interactive shell would
# start a background job with SIGINT ignored), so `kill -INT -- -PID` is a terminal's Ctrl-C.
cd "$dest"
env -u REDIS_URL -u PAGEDSERVE_ADMIN_TOKEN setsid python3 -c '
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])' make serve SERVE_ARGS="--port $port" >"$log" 2>&1 &
pid=$!

echo "fresh clone in $dest: make serve (installing .venv; log $log)"
for _ in $(seq 1 1800); do
  if grep -q "pagedserve is up" "$log"; then break; fi
  if ! kill -0 "$pid" 2>/dev/null; then cat "$log"; echo "make serve exited" >&2; exit 1; fi
  sleep 1
done
grep -q "pagedserve is up" "$log" || { tail -50 "$log"; echo "not up after 30 min" >&2; exit 1; }
up_after=$((SECONDS - started))
grep -A2 "pagedserve is up" "$log"

example="$(grep '^try: curl' "$log" | head -1 | sed 's/^try: //')"
echo "+ $example"
out="$(eval "$example")"
answered_after=$((SECONDS - started))
echo "$out" | head -3
echo "answer: $(echo "$out" | python3 -c '
import json, sys
events = [json.loads(l[6:]) for l in sys.stdin if l.startswith("data: {")]
print("".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices", [])))')"
echo "$out" | grep -q '^data: \[DONE\]' || { echo "no [DONE] in the stream" >&2; exit 1; }
# length, or stop: the model ended its answer
echo "$out" | grep -Eq '"finish_reason":"(length|stop)"' || {
  echo "$out" | tail -6; echo "no finished choice" >&2; exit 1; }

kill -INT -- "-$pid"
for _ in $(seq 1 120); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
if kill -0 "$pid" 2>/dev/null; then tail -30 "$log"; echo "still running after Ctrl-C" >&2; exit 1; fi
grep -q "gateway stopped" "$log" && grep -q "kvstore stopped" "$log" || {
  tail -30 "$log"; echo "not everything stopped" >&2; exit 1; }
echo "OK: make serve from a fresh clone served a streamed completion and stopped on Ctrl-C"
echo "make serve: up after ${up_after} s, answered after ${answered_after} s (install included)"
