#!/usr/bin/env bash
# Starts (or stops) Kitchen's remote Bazel cache: Debian's nginx as a WebDAV server on
# 127.0.0.1. `--config=remote` in .bazelrc points at it.
#   tools/cache/start_cache.sh [--port 9092] [--dir ~/.cache/kitchen/remote-cache] [stop]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
port=9092
dir=${XDG_CACHE_HOME:-$HOME/.cache}/kitchen/remote-cache
action=start
while (($#)); do
  case $1 in
    --port) port=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    stop) action=stop; shift ;;
    *) echo "usage: $0 [--port N] [--dir DIR] [stop]" >&2; exit 2 ;;
  esac
done

if [[ -f $dir/nginx.pid ]] && kill -0 "$(cat "$dir/nginx.pid")" 2>/dev/null; then
  if [[ $action == stop ]]; then
    kill "$(cat "$dir/nginx.pid")" && echo "remote cache stopped"
  else
    echo "remote cache already running: http://127.0.0.1:$port/kitchen (data in $dir/data)"
  fi
  exit 0
fi
[[ $action == stop ]] && { echo "remote cache not running"; exit 0; }

command -v nginx >/dev/null || { echo "nginx is not installed (apt-get install nginx)" >&2; exit 1; }
mkdir -p "$dir/data/kitchen" "$dir/tmp"
# As root nginx's workers would drop to nobody and fail to create cache directories.
user_line=""
[[ $(id -u) -eq 0 ]] && user_line="user root;"
sed -e "s|@DIR@|$dir|g" -e "s|@PORT@|$port|g" -e "s|@USER@|$user_line|" \
  "$here/nginx.conf.in" >"$dir/nginx.conf"
nginx -c "$dir/nginx.conf" -e "$dir/error.log"
for _ in $(seq 50); do
  curl -fsS -o /dev/null -X PUT --data probe "http://127.0.0.1:$port/kitchen/probe" 2>/dev/null && break
  sleep 0.1
done
curl -fsS "http://127.0.0.1:$port/kitchen/probe" >/dev/null || {
  echo "remote cache did not answer; see $dir/error.log" >&2
  exit 1
}
echo "remote cache running: http://127.0.0.1:$port/kitchen (data in $dir/data)"
