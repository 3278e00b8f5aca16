#!/usr/bin/env bash
# Builds lockgate's container images without pulling anything, for
# machines that cannot reach a registry (an air-gapped build host, this
# project's CI): each root filesystem is assembled from local files (a
# binary, the shared libraries `ldd` names, a passwd entry) and imported
# with `docker import`. The Dockerfile stays for builders that can pull.
#
#   docker/local-images.sh [LOCKGATE_BIN]
#
# Makes two images:
#   lockgate:local        target/release/lockgate (or LOCKGATE_BIN), the
#                         config/lockgate.toml, uid 10001, the ENTRYPOINT and
#                         CMD of docker/Dockerfile
#   lockgate-redis:local  this machine's redis-server and redis-cli, uid 999
# docker/compose.local.yml runs a stack of them.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
BIN=${1:-$REPO/target/release/lockgate}
[[ -x $BIN ]] || { echo "local-images.sh: no lockgate binary at $BIN (cargo build --release)" >&2; exit 1; }
REDIS=$(command -v redis-server) || { echo "local-images.sh: no redis-server" >&2; exit 1; }
REDIS_CLI=$(command -v redis-cli)

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Copies each binary and every shared library it loads into root $1, at
# the same paths.
with_libs() {
  local root=$1 bin lib
  shift
  for bin in "$@"; do
    install -D -m 0755 "$bin" "$root$bin"
    while read -r lib; do
      # 0755: the loader among them must be executable.
      [[ -n $lib ]] && install -D -m 0755 "$lib" "$root$lib"
    done < <(ldd "$bin" | grep -o '/[^ ]*' | sort -u)
  done
}

# A user and its group, and the folders every process expects.
base() {
  local root=$1 user=$2 uid=$3
  mkdir -p "$root/etc" "$root/tmp" "$root/data"
  chmod 1777 "$root/tmp"
  printf 'root:x:0:0:root:/:/nonexistent\n%s:x:%s:%s::/data:/nonexistent\n' "$user" "$uid" "$uid" >"$root/etc/passwd"
  printf 'root:x:0:\n%s:x:%s:\n' "$user" "$uid" >"$root/etc/group"
  printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
  chown "$uid:$uid" "$root/data"
}

LG=$WORK/lockgate
base "$LG" lockgate 10001
with_libs "$LG" "$BIN"
mv "$LG$BIN" "$LG/usr/local/bin/lockgate" 2>/dev/null || {
  install -D -m 0755 "$BIN" "$LG/usr/local/bin/lockgate"
}
install -D -m 0644 "$REPO/config/lockgate.toml" "$LG/etc/lockgate/lockgate.toml"
tar -C "$LG" -c . | docker import \
  --change 'USER 10001:10001' \
  --change 'EXPOSE 6380 9480' \
  --change 'ENTRYPOINT ["/usr/local/bin/lockgate", "--config", "/etc/lockgate/lockgate.toml"]' \
  --change 'CMD ["--listen", "0.0.0.0:6380", "--admin-listen", "0.0.0.0:9480"]' \
  - lockgate:local >/dev/null

RD=$WORK/redis
base "$RD" redis 999
with_libs "$RD" "$REDIS" "$REDIS_CLI"
tar -C "$RD" -c . | docker import \
  --change 'USER 999:999' \
  --change 'WORKDIR /data' \
  --change 'EXPOSE 6379' \
  --change "ENTRYPOINT [\"$REDIS\"]" \
  --change 'CMD ["--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no"]' \
  - lockgate-redis:local >/dev/null

echo "local-images.sh: built lockgate:local and lockgate-redis:local"
