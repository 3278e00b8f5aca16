#!/usr/bin/env bash
# redis-py's own lock tests, through lockgate.
#
#   scripts/redis-py-locks.sh            fetch the tests if needed, run them
#   scripts/redis-py-locks.sh --fetch    only fetch and unpack the tests
#
# The tests are those of the installed redis-py (tests/test_lock.py and
# tests/test_asyncio/test_lock.py, sync and asyncio), from its source
# distribution on PyPI of the same version, fetched with `pip download` into
# target/redis-py-suite/ (only its tests/ and pyproject.toml are unpacked, so
# the installed redis-py is what runs). Their fixtures flush the database
# between tests, and every test locks the key "foo". They run with pytest
# (tests/py/requirements.txt; installed when missing), in RESP2 and RESP3,
# against three targets in turn, each with a fresh redis-server on a free
# loopback port:
#   direct       redis-server itself
#   lockgate     target/release/lockgate, with locks.keys = ["foo"] (the
#                tests' lock key; everything else as config/lockgate.toml's
#                defaults)
#   lockgate-1m  the same with locks.retry.probe_interval_ms = 60000: an
#                answer from a stale view of the lock would last the whole
#                run, not up to 100 ms, so it cannot pass by chance
# and prints per target what passed and the names of what failed. A test
# lost through a lockgate is run there again, alone, 3 times, and counts as
# passed only if every rerun passes (timing tests fail now and then either
# way).
#
# LOCKGATE_BIN=PATH runs that lockgate binary instead of building one (an
# older build, to see a test fail there).
#
# Exit status: 0 when every test that passes directly also passes through
# both lockgates, apart from the EXCEPTIONS below, each of which must fail
# with the message named there (a deliberate difference of lockgate's, in
# docs/behaviour.md); 1 otherwise.
set -euo pipefail

LOG_TAG=redis-py
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() { sed -n '2,34s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

FETCH_ONLY=0
while [ $# -gt 0 ]; do
	case "$1" in
	--fetch) FETCH_ONLY=1 ;;
	-h | --help)
		usage
		exit 0
		;;
	*)
		usage >&2
		die "unknown argument: $1"
		;;
	esac
	shift
done

# The test files run.
TESTS=(tests/test_lock.py tests/test_asyncio/test_lock.py)

# Tests that pass directly and must fail through lockgate, each with the
# message it must fail with: "test|regex of the failure message|why". A test
# is named as in pytest's JUnit report: module.Class::name. They assert
# `ttl("foo") == -1` after acquiring without a timeout: through lockgate a
# lock never lives without a lease (locks.default_lease_ms, 30 s), the
# "lease on a lease-less lock" of docs/behaviour.md.
LEASE='assert [0-9]+ == -1|a lock never lives without a lease (default_lease_ms)'
# redis-py 8.2 added tests of a lock taken with timeout=0 (SET NX without
# PX): reacquire keeps it without a TTL (`pttl == -1`, the same lease), and
# extend must raise LockNotOwnedError because redis-py's extend script
# answers 0 for a key without a TTL; through lockgate the key has its lease,
# so the extension is made (docs/behaviour.md, "Acquisitions").
NOTTL='DID NOT RAISE.*LockNotOwnedError|a lock never lives without a lease (default_lease_ms), so redis-py extends it'
EXCEPTIONS=()
add_exception() {
	EXCEPTIONS+=("tests.test_lock.TestLock::$1|$2")
	local client
	for client in single pool; do
		EXCEPTIONS+=("tests.test_asyncio.test_lock.TestLock::${1}[${client}]|$2")
	done
}
for t in test_lock test_lock_token test_lock_token_thread_local_false \
	test_reacquire_lock_zero_timeout_keeps_lock; do
	add_exception "$t" "$LEASE"
done
for t in test_extend_lock_zero_additional_time_replace_ttl_raises_error \
	test_extend_lock_zero_timeout_without_replace_raises_error; do
	add_exception "$t" "$NOTTL"
done

cd "$LOCKGATE_ROOT"
SUITE_DIR="$LOCKGATE_ROOT/target/redis-py-suite"

ensure_redis
ensure_python

# --- fetching the tests ---------------------------------------------------------

# Leaves the tests of the installed redis-py in $SUITE_SRC.
fetch_tests() {
	local version dl tarball top
	version="$(python3 -c 'import redis; print(redis.__version__)')"
	[ -n "$version" ] || die "cannot tell the version of the installed redis-py"
	SUITE_SRC="$SUITE_DIR/redis-py-$version"
	if [ -f "$SUITE_SRC/tests/test_lock.py" ] && [ -f "$SUITE_SRC/pyproject.toml" ]; then
		return 0
	fi
	log "fetching redis-py $version's tests (its source distribution)"
	dl="$SUITE_DIR/download.$$"
	rm -rf "$dl"
	mkdir -p "$dl"
	PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
		python3 -m pip download -q --no-deps --no-binary :all: "redis==$version" -d "$dl" </dev/null ||
		die "pip download redis==$version (source distribution) failed"
	tarball="$(find "$dl" -maxdepth 1 -name "redis-$version.tar.gz" | head -n 1)"
	[ -n "$tarball" ] || die "pip download left no redis-$version.tar.gz in $dl"
	top="redis-$version"
	tar -xzf "$tarball" -C "$dl" "$top/tests" "$top/pyproject.toml" ||
		die "the source distribution has no tests/ or pyproject.toml"
	[ -f "$dl/$top/tests/test_lock.py" ] || die "no tests/test_lock.py in $(basename "$tarball")"
	rm -rf "$SUITE_SRC"
	mv "$dl/$top" "$SUITE_SRC"
	rm -rf "$dl"
	log "redis-py $version's tests are in ${SUITE_SRC#"$LOCKGATE_ROOT"/}"
}

fetch_tests
[ "$FETCH_ONLY" -eq 1 ] && exit 0

ensure_lockgate_bin

# --- processes ----------------------------------------------------------------

scratch_dir redis-py
# The tests' lock key; everything else is lockgate's default.
lock_configs "" '"foo"'

# start_target NAME — a fresh redis-server, and lockgate with
# $WORKDIR/NAME.toml in front of it unless NAME=direct; sets PORT to where
# the tests connect.
start_target() {
	local config="$WORKDIR/$1.toml"
	[ "$1" != direct ] || config=""
	start_behind "$WORKDIR/$1" "$config"
}

# run_tests TARGET PROTOCOL — the tests against $PORT; the JUnit report in
# $WORKDIR/TARGET-PROTOCOL.xml (pytest's own exit status is not the verdict).
# run_tests TARGET PROTOCOL REPORT [NODE_ID...] — the suite (or only the
# tests NODE_ID...) against the target started, its report
# $WORKDIR/REPORT.xml.
run_tests() {
	local target="$1" protocol="$2" report="$3" t0=$SECONDS
	shift 3
	[ $# -gt 0 ] || set -- "${TESTS[@]}"
	(
		cd "$SUITE_SRC"
		exec timeout -k 5 300 python3 -m pytest -q -p no:cacheprovider -W ignore \
			--redis-url="redis://127.0.0.1:$PORT" --protocol="$protocol" \
			--junitxml="$WORKDIR/$report.xml" "$@"
	) </dev/null >"$WORKDIR/$report.log" 2>&1 || true
	[ -f "$WORKDIR/$report.xml" ] ||
		die "pytest wrote no report for $target (RESP$protocol): see $WORKDIR/$report.log"
	log "[$target] RESP$protocol $report: $(tail -n 1 "$WORKDIR/$report.log") ($((SECONDS - t0))s)"
}

TARGETS=(direct lockgate lockgate-1m)
for target in "${TARGETS[@]}"; do
	start_target "$target"
	for protocol in 2 3; do run_tests "$target" "$protocol" "$target-$protocol"; done
	stop_all
done

# A test lost through a lockgate is run there again, alone, 3 times; it
# counts as passed only if every rerun passes (as scripts/library-suites.sh).
RERUNS=3
RUNS=()
for target in "${TARGETS[@]:1}"; do
	for protocol in 2 3; do
		reports="$WORKDIR/$target-$protocol.xml"
		mapfile -t lost < <(python3 "$LOCKGATE_ROOT/scripts/junit_verdict.py" --lost \
			<(printf '%s\n' "${EXCEPTIONS[@]}") "$SUITE_SRC" \
			"$WORKDIR/direct-$protocol.xml" "$WORKDIR/$target-$protocol.xml")
		if [ "${#lost[@]}" -gt 0 ]; then
			log "[$target] RESP$protocol lost ${#lost[@]}, each run again $RERUNS times: ${lost[*]}"
			start_target "$target"
			for k in $(seq 1 "$RERUNS"); do
				run_tests "$target" "$protocol" "$target-$protocol.rerun$k" "${lost[@]}"
				reports+=",$WORKDIR/$target-$protocol.rerun$k.xml"
			done
			stop_all
		fi
		RUNS+=("$target, RESP$protocol" "$WORKDIR/direct-$protocol.xml" "$reports")
	done
done

printf '%s\n' "${EXCEPTIONS[@]}" >"$WORKDIR/exceptions"
status=0
python3 "$LOCKGATE_ROOT/scripts/junit_verdict.py" "$WORKDIR/exceptions" "${RUNS[@]}" || status=$?
if [ "$status" -ne 0 ]; then
	printf '\nredis-py-locks: FAILED: a test that passes directly lost through lockgate\n'
	exit 1
fi
printf '\nredis-py-locks: every test that passes directly passes through lockgate (%d excepted per run)\n' \
	"${#EXCEPTIONS[@]}"
