#!/usr/bin/env bash
# Lock libraries' own test suites, straight on Redis and through lockgate.
#
#   scripts/library-suites.sh              fetch what is missing, run them all
#   scripts/library-suites.sh --only NAME  one suite: python-redis-lock, pottery
#   scripts/library-suites.sh --fetch      only fetch and unpack the suites
#
# Each suite is the tests of the installed library's release, from its source
# distribution on PyPI (`pip download` into target/library-suites/; only the
# tests are used, so the installed library is what runs), with pytest:
#
#   python-redis-lock  tests/test_redis_lock.py. Its own fixture starts a
#       redis-server per test, listening on a unix socket only. Through
#       lockgate, tests/suites/python_redis_lock_conftest.py replaces the
#       suite's conftest.py: the same server on a loopback port, lockgate in
#       front, socat relaying the socket into lockgate. Lock keys "lock:*".
#       Its test dependencies (process-tests, gevent, eventlet, pytest-xdist)
#       go to target/library-suites/site, not beside the system's packages;
#       6 tests run at a time, each with servers of its own. Three tests that
#       never reach a server are left out: they pass only after another test
#       in the same process registered the library's scripts, so their
#       outcome depends on which tests a worker ran before.
#   pottery  tests/test_redlock.py and tests/test_aioredlock.py (its Redlock,
#       one master). The source distribution has no conftest.py:
#       tests/suites/pottery_conftest.py gives the fixtures they ask for, on
#       one server per target. Lock keys "redlock:*".
#
# node-redlock is not here: its npm package ships no tests, only dist/.
#
# Targets, as in scripts/redis-py-locks.sh: direct (redis-server), lockgate
# (the suite's lock keys, everything else config/lockgate.toml's defaults),
# lockgate-1m (the same with locks.retry.probe_interval_ms = 60000: an answer
# from a stale view would last the run, so it cannot pass by chance).
#
# LOCKGATE_BIN=PATH runs that lockgate binary instead of building one.
#
# A test that passes directly and fails through a lockgate is run there
# again, alone, 3 times: the suites have tests on timing (sleeps against
# leases, 6 workers on 2 shared cores) that fail now and then either way, and
# one such failure once cost a CI run. It counts as passed only if every
# rerun passes; the verdict names it ("failed once, passed 3 reruns").
#
# Exit status: 0 when every test that passes directly also passes through
# both lockgates, apart from the exceptions named below (each must fail with
# the message named, a deliberate difference of docs/behaviour.md); 1
# otherwise.
set -euo pipefail

LOG_TAG=library-suites
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() { sed -n '2,45s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

SUITES=(python-redis-lock pottery)
FETCH_ONLY=0
while [ $# -gt 0 ]; do
	case "$1" in
	--fetch) FETCH_ONLY=1 ;;
	--only)
		[ $# -ge 2 ] || die "--only needs a suite name"
		case "$2" in python-redis-lock | pottery) SUITES=("$2") ;; *) die "no suite named $2" ;; esac
		shift
		;;
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

# The suites' own test dependencies, pinned: a release appearing on PyPI
# must not change what CI runs.
SITE_REQUIREMENTS=(process-tests==3.0.0 gevent==26.9.0 eventlet==0.41.3 pytest-xdist==3.8.0)

# Tests that pass directly and must fail through lockgate: "test|regex of the
# failure message|why", the test as in pytest's JUnit report.
EXCEPTIONS=()
# python-redis-lock's extend refuses a lock without a TTL (NotExpirable);
# through lockgate no lock lives without a lease (locks.default_lease_ms).
if [[ " ${SUITES[*]} " == *" python-redis-lock "* ]]; then
	for d in True-decode_responses=True True-decode_responses=False \
		False-decode_responses=True False-decode_responses=False; do
		EXCEPTIONS+=("tests.test_redis_lock::test_extend_lock_without_expire_fail[decode_responses=$d]|DID NOT RAISE.*NotExpirable|a lock never lives without a lease (default_lease_ms), so the library's extend finds a TTL")
	done
fi

cd "$LOCKGATE_ROOT"
SUITE_DIR="$LOCKGATE_ROOT/target/library-suites"
SITE="$SUITE_DIR/site"

ensure_redis
ensure_python
install_missing socat socat

# --- fetching -----------------------------------------------------------------

# fetch NAME — the tests of the installed NAME's release in $SUITE_DIR/NAME-V;
# sets SRC to it.
fetch() {
	local name="$1" version dl tarball top
	version="$(python3 -c "import importlib.metadata as m; print(m.version('$name'))")" ||
		die "$name is not installed (tests/py/requirements.txt)"
	SRC="$SUITE_DIR/$name-$version"
	[ -f "$SRC/.complete" ] && return 0
	log "fetching $name $version's tests (its source distribution)"
	dl="$SUITE_DIR/download.$$"
	rm -rf "$dl"
	mkdir -p "$dl"
	PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
		python3 -m pip download -q --no-deps --no-binary :all: "$name==$version" -d "$dl" </dev/null ||
		die "pip download $name==$version (source distribution) failed"
	tarball="$(find "$dl" -maxdepth 1 -name "$name-$version.tar.gz" | head -n 1)"
	[ -n "$tarball" ] || die "pip download left no $name-$version.tar.gz in $dl"
	top="$name-$version"
	tar -xzf "$tarball" -C "$dl" "$top/tests" || die "$(basename "$tarball") has no tests/"
	[ "$name" != python-redis-lock ] || tar -xzf "$tarball" -C "$dl" "$top/pytest.ini" ||
		die "$(basename "$tarball") has no pytest.ini"
	touch "$dl/$top/.complete"
	rm -rf "$SRC"
	mv "$dl/$top" "$SRC"
	rm -rf "$dl"
	log "$name $version's tests are in ${SRC#"$LOCKGATE_ROOT"/}"
}

ensure_site() {
	local stamp="$SITE/.requirements"
	[ "$(cat "$stamp" 2>/dev/null)" = "${SITE_REQUIREMENTS[*]}" ] && return 0
	log "pip install --target ${SITE#"$LOCKGATE_ROOT"/} ${SITE_REQUIREMENTS[*]}"
	rm -rf "$SITE"
	PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
		python3 -m pip install -q --target "$SITE" "${SITE_REQUIREMENTS[@]}" </dev/null ||
		die "pip install of the suites' test dependencies failed"
	printf '%s' "${SITE_REQUIREMENTS[*]}" >"$stamp"
}

declare -A SOURCES
for suite in "${SUITES[@]}"; do
	fetch "$suite"
	SOURCES[$suite]="$SRC"
done
ensure_site
[ "$FETCH_ONLY" -eq 1 ] && exit 0

ensure_lockgate_bin

# --- processes ----------------------------------------------------------------

scratch_dir library-suites

# pytest_run REPORT DIR ARGS... — pytest in DIR with ARGS, its JUnit report
# in $WORKDIR/REPORT.xml (pytest's exit status is not the verdict); at most
# 10 minutes.
pytest_run() {
	local report="$1" dir="$2" t0=$SECONDS
	shift 2
	(
		cd "$dir"
		exec timeout -k 5 600 python3 -m pytest -q -p no:cacheprovider -W ignore \
			--junitxml="$WORKDIR/$report.xml" "$@"
	) </dev/null >"$WORKDIR/$report.log" 2>&1 || true
	[ -f "$WORKDIR/$report.xml" ] || die "pytest wrote no report $report: see $WORKDIR/$report.log"
	log "[$report] $(tail -n 1 "$WORKDIR/$report.log") ($((SECONDS - t0))s)"
}

TARGETS=(direct lockgate lockgate-1m)

# run_python_redis_lock TARGET REPORT [NODE_ID...] — its suite (or only the
# tests NODE_ID...) against TARGET, the report $WORKDIR/REPORT.xml.
run_python_redis_lock() {
	local target="$1" report="$2" dir="$WORKDIR/python-redis-lock-$1/suite"
	shift 2
	if [ ! -d "$dir" ]; then
		mkdir -p "$dir"
		cp -r "${SOURCES[python-redis-lock]}/tests" "${SOURCES[python-redis-lock]}/pytest.ini" "$dir/"
		[ "$target" = direct ] || cp tests/suites/python_redis_lock_conftest.py "$dir/tests/conftest.py"
	fi
	[ $# -gt 0 ] || set -- tests/test_redis_lock.py
	# -p no:asyncio, no:timeout: the suite's pytest.ini turns warnings
	# into errors, and those plugins (installed for redis-py's suite) warn
	# at start-up about settings this suite does not make.
	PYTHONPATH="$SITE" LOCKGATE_CONFIG="$WORKDIR/python-redis-lock-$target.toml" \
		pytest_run "$report" "$dir" -p no:asyncio -p no:timeout -n 6 \
		--deselect tests/test_redis_lock.py::test_strict_check \
		--deselect tests/test_redis_lock.py::test_borken_expires \
		--deselect tests/test_redis_lock.py::test_expire_int_conversion \
		"$@"
}

# run_pottery TARGET REPORT [NODE_ID...] — as run_python_redis_lock.
run_pottery() {
	local target="$1" report="$2" dir="$WORKDIR/pottery-$1/suite"
	shift 2
	if [ ! -d "$dir" ]; then
		mkdir -p "$dir"
		cp -r "${SOURCES[pottery]}/tests" "$dir/"
		cp tests/suites/pottery_conftest.py "$dir/tests/conftest.py"
	fi
	[ $# -gt 0 ] || set -- tests/test_redlock.py tests/test_aioredlock.py
	if [ "$target" = direct ]; then
		start_behind "$WORKDIR/pottery-$target"
	else
		start_behind "$WORKDIR/pottery-$target" "$WORKDIR/pottery-$target.toml"
	fi
	SUITE_REDIS_URL="redis://127.0.0.1:$PORT/0" \
		pytest_run "$report" "$dir" -o asyncio_mode=auto "$@"
	stop_all
}

lock_configs python-redis-lock- '"lock:*"'
lock_configs pottery- '"redlock:*"'

# A test lost through a lockgate is run again there, alone, this many
# times; it counts as passed only if every rerun passes (junit_verdict.py).
RERUNS=3

RUNS=()
for suite in "${SUITES[@]}"; do
	for target in "${TARGETS[@]}"; do
		"run_${suite//-/_}" "$target" "$suite-$target"
	done
	for target in "${TARGETS[@]:1}"; do
		reports="$WORKDIR/$suite-$target.xml"
		mapfile -t lost < <(python3 "$LOCKGATE_ROOT/scripts/junit_verdict.py" --lost \
			<(printf '%s\n' "${EXCEPTIONS[@]}") "$WORKDIR/$suite-$target/suite" \
			"$WORKDIR/$suite-direct.xml" "$WORKDIR/$suite-$target.xml")
		if [ "${#lost[@]}" -gt 0 ]; then
			log "[$suite, $target] lost ${#lost[@]}, each run again $RERUNS times: ${lost[*]}"
			for k in $(seq 1 "$RERUNS"); do
				"run_${suite//-/_}" "$target" "$suite-$target.rerun$k" "${lost[@]}"
				reports+=",$WORKDIR/$suite-$target.rerun$k.xml"
			done
		fi
		RUNS+=("$suite, $target" "$WORKDIR/$suite-direct.xml" "$reports")
	done
done

# --- the verdict --------------------------------------------------------------

printf '%s\n' "${EXCEPTIONS[@]}" >"$WORKDIR/exceptions"
status=0
python3 "$LOCKGATE_ROOT/scripts/junit_verdict.py" "$WORKDIR/exceptions" "${RUNS[@]}" || status=$?
if [ "$status" -ne 0 ]; then
	printf '\nlibrary-suites: FAILED: a test that passes directly lost through lockgate\n'
	exit 1
fi
printf '\nlibrary-suites: every test that passes directly passes through lockgate (%d exceptions named)\n' \
	"${#EXCEPTIONS[@]}"
