#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls exactly this).
#
#   scripts/test.sh [--no-setup]
#
# 1. setup: scripts/setup.sh installs what is missing (apt, rustup, pip;
#    never reinstalls what is there). `--no-setup` skips it.
# 2. checks, in order; each runs even when an earlier one failed, and the
#    summary names every step that failed:
#      fmt      cargo fmt --check
#      shell    shellcheck scripts/*.sh bench/*.sh
#      clippy   cargo clippy --all-targets -- -D warnings
#      test     cargo test --all-targets --no-fail-fast (RUST_BACKTRACE=1)
#      doctest  cargo test --doc
#      doc      cargo doc --no-deps --document-private-items, warnings
#               denied (broken links; the crate is read by its developers,
#               so its private modules are documented too)
#      noscript scripts/noscript-tests.sh      (the integration tests with
#               every server refusing scripts, but for those that need
#               them by design; under 2 minutes)
#      fuzz     scripts/fuzz.sh --seconds 20 --light (every fuzz target
#               of fuzz/ for 20 s on its seed corpus, built at opt-level
#               1; installs cargo-fuzz when missing; see docs/fuzzing.md)
#      demo     scripts/demo.sh --smoke         (release build, real Redis)
#      cluster-demo scripts/demo.sh --cluster --smoke (the same in front of
#               a local 3-primary Redis Cluster)
#      storm-demo scripts/demo.sh --storm --smoke (the incident's spin
#               storm for 5 s through the demo; fails unless fewer than a
#               tenth of the attempts reached Redis)
#      gate     bench/gate.sh                   (the performance gate:
#               instructions per request under callgrind and Redis
#               commands per lock operation against
#               bench/gate-baseline.txt; fails when one is worse than its
#               tolerance; about a minute)
#      deploy   scripts/deploy-test.sh         (the Kubernetes sidecar
#               example against the API schemas and lockgate's
#               configuration; the compose stack of images built here
#               without pulling, up, a lock through it, down: starts a
#               Docker engine when it can, skipped with a message when
#               none can run; about a minute)
#      redis-py scripts/redis-py-locks.sh       (redis-py's own lock tests,
#               sync and asyncio, directly and through lockgate with their
#               key "foo" a lock key; fails when one that passes directly
#               fails through lockgate, but for the named deliberate
#               differences. Fetches the tests from redis-py's source
#               distribution into target/redis-py-suite/; under a minute)
#      libraries scripts/library-suites.sh     (python-redis-lock's and
#               pottery's own tests, from their source distributions,
#               directly and through lockgate with their keys lock keys;
#               fails as redis-py's does. Installs socat and the suites'
#               test dependencies (into target/library-suites/site) when
#               missing; about 4 min)
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

SETUP=1
case "${1:-}" in
'') ;;
--no-setup) SETUP=0 ;;
-h | --help)
	sed -n '2,/^# Exit status/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
	exit 0
	;;
*) die "unknown argument: $1 (scripts/test.sh takes --no-setup or nothing)" ;;
esac

cd "$LOCKGATE_ROOT"
export RUST_BACKTRACE=1

if [ "$SETUP" -eq 1 ]; then
	scripts/setup.sh || die "setup failed (scripts/setup.sh)"
else
	ensure_cargo
fi

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
step shell shellcheck scripts/*.sh bench/*.sh
step clippy cargo clippy --all-targets -- -D warnings
step test cargo test --all-targets --no-fail-fast
step doctest cargo test --doc
step doc env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --document-private-items --quiet
step noscript scripts/noscript-tests.sh
step fuzz scripts/fuzz.sh --seconds 20 --light
step demo scripts/demo.sh --smoke
step cluster-demo scripts/demo.sh --cluster --smoke
step storm-demo scripts/demo.sh --storm --smoke
step gate bench/gate.sh
step deploy scripts/deploy-test.sh
step redis-py scripts/redis-py-locks.sh
step libraries scripts/library-suites.sh
step suite scripts/redis-suite.sh

printf '\n==> summary\n' >&2
printf '  %s\n' "${RESULTS[@]}" >&2
if [ "${#FAILED[@]}" -ne 0 ]; then
	printf '\ntest.sh: FAILED step(s): %s\n' "${FAILED[*]}" >&2
	exit 1
fi
printf '\ntest.sh: all %d steps passed\n' "${#STEPS[@]}" >&2
