#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls exactly this).
#
#   scripts/test.sh
#
# 1. setup: installs what is missing (never reinstalls what is there):
#    redis-server/redis-tools (apt-get), the Rust toolchain (rustup) with its
#    rustfmt and clippy components, and the Python redis client
#    (redis-py 8.x, which opens every connection with HELLO 3 and
#    CLIENT SETINFO, like current client libraries do), pottery and
#    prometheus_client (pip), Chromium for the status-page test and
#    faketime for the clock-jump tests (apt).
# 2. checks, in order; each runs even when an earlier one failed, and the
#    summary names every step that failed:
#      fmt      cargo fmt --check
#      clippy   cargo clippy --all-targets -- -D warnings
#      test     cargo test --all-targets --no-fail-fast (RUST_BACKTRACE=1)
#      doctest  cargo test --doc
#      doc      cargo doc --no-deps, warnings denied (broken links)
#      demo     scripts/demo.sh --smoke         (release build, real Redis)
#      suite    scripts/redis-suite.sh          (Redis's own tcl test suite
#               directly, through HAProxy and through lockgate; fails when a
#               test that passes directly fails through lockgate. Fetches
#               the suite from Debian's redis source package into
#               target/redis-suite/ the first time; installs tcl, dpkg-dev
#               and haproxy when missing; 4-6 min)
#
# Exit status: 0 when every step passed, 1 otherwise (also when setup fails).
set -euo pipefail

# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

case "${1:-}" in
'') ;;
-h | --help)
	sed -n '2,28s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
	exit 0
	;;
*) die "unknown argument: $1 (scripts/test.sh takes none)" ;;
esac

cd "$LOCKGATE_ROOT"
export RUST_BACKTRACE=1

# Major version of redis-py to install: 8.x sends HELLO 3 on connect
# (RESP3 by default) and CLIENT SETINFO lib-name/lib-ver.
PY_REDIS_SPEC='redis>=8,<9'

ensure_rust_components() {
	local missing=()
	cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt)
	cargo clippy --version >/dev/null 2>&1 || missing+=(clippy)
	[ "${#missing[@]}" -eq 0 ] && return 0
	have rustup || die "cargo ${missing[*]} missing and rustup not found to add them"
	log "rustup component add ${missing[*]}"
	rustup component add "${missing[@]}" || die "rustup component add ${missing[*]} failed"
}

ensure_python_redis() {
	have python3 || apt_install python3 python3-pip
	local version major
	version="$(python3 -c 'import redis; print(redis.__version__)' 2>/dev/null || true)"
	major="${version%%.*}"
	if [ -n "$version" ] && [ "$major" -ge 8 ] 2>/dev/null; then
		return 0
	fi
	if [ -n "$version" ]; then
		log "python redis $version is older than 8.x (no HELLO 3 on connect): upgrading"
	fi
	python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip
	log "python3 -m pip install -q '$PY_REDIS_SPEC'"
	# Debian's own python3 is "externally managed" (PEP 668); this is a test
	# machine, so install next to the system packages anyway.
	PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore \
		PIP_DISABLE_PIP_VERSION_CHECK=1 \
		python3 -m pip install -q "$PY_REDIS_SPEC" </dev/null ||
		die "pip install '$PY_REDIS_SPEC' failed"
	version="$(python3 -c 'import redis; print(redis.__version__)' 2>/dev/null)" ||
		die "python3 still cannot import redis after pip install"
	log "python redis $version installed"
}

# Other Python modules the tests drive lockgate with: pottery's Redlock
# (a client of the quorum) and the Prometheus text parser (/metrics).
ensure_python_module() {
	local module="$1" spec="$2"
	python3 -c "import $module" >/dev/null 2>&1 && return 0
	log "python3 -m pip install -q '$spec'"
	PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore \
		PIP_DISABLE_PIP_VERSION_CHECK=1 \
		python3 -m pip install -q "$spec" </dev/null ||
		die "pip install '$spec' failed"
	python3 -c "import $module" >/dev/null 2>&1 ||
		die "python3 still cannot import $module after pip install"
}

log "setup: system dependencies"
ensure_redis
ensure_cargo
ensure_rust_components
ensure_python_redis
ensure_python_module pottery pottery
ensure_python_module prometheus_client prometheus_client
# The status page is checked in headless Chromium (Debian's package).
[ -x /usr/bin/chromium ] || apt_install chromium
# A lock master's clock is stepped under libfaketime in the clock tests.
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || apt_install faketime
log "setup done: $(cargo --version), $(redis-server --version | cut -d' ' -f1-3)," \
	"python redis $(python3 -c 'import redis; print(redis.__version__)')"

# The demo's default port is 6380; when something on this machine already
# uses it (a demo left running), smoke-test on another port instead of failing.
if [ -z "${LOCKGATE_PORT:-}" ] && ! is_port_free 6380; then
	LOCKGATE_PORT="$(pick_free_port)"
	export LOCKGATE_PORT
	warn "127.0.0.1:6380 is busy; the demo smoke test uses port $LOCKGATE_PORT"
fi

STEPS=()
RESULTS=()
FAILED=()

# step NAME COMMAND... — runs one check, records whether it passed.
step() {
	local name="$1" start rc=0
	shift
	printf '\n==> [%s] %s\n' "$name" "$*" >&2
	start=$SECONDS
	"$@" </dev/null || rc=$?
	STEPS+=("$name")
	if [ "$rc" -eq 0 ]; then
		RESULTS+=("ok    $(printf '%-8s' "$name") $((SECONDS - start))s  $*")
	else
		RESULTS+=("FAIL  $(printf '%-8s' "$name") $((SECONDS - start))s  $* (exit $rc)")
		FAILED+=("$name")
		printf '==> [%s] FAILED (exit %s)\n' "$name" "$rc" >&2
	fi
}

step fmt cargo fmt --check
step clippy cargo clippy --all-targets -- -D warnings
step test cargo test --all-targets --no-fail-fast
step doctest cargo test --doc
step doc env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet
step demo scripts/demo.sh --smoke
step suite scripts/redis-suite.sh

printf '\n==> summary\n' >&2
printf '  %s\n' "${RESULTS[@]}" >&2
if [ "${#FAILED[@]}" -ne 0 ]; then
	printf '\ntest.sh: FAILED step(s): %s\n' "${FAILED[*]}" >&2
	exit 1
fi
printf '\ntest.sh: all %d steps passed\n' "${#STEPS[@]}" >&2
