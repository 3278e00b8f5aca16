#!/usr/bin/env bash
# Redis's own tcl test suite, through lockgate.
#
#   scripts/redis-suite.sh            fetch the suite if needed, run it
#   scripts/redis-suite.sh --fetch    only fetch and unpack the suite
#
# The suite is the one of the installed redis-server: Debian's source package
# of redis (the same version as redis-server, e.g. 7.0.15), fetched with
# `apt-get source` into target/redis-suite/ (a deb-src entry is added next to
# the machine's own Debian sources when none is configured) and unpacked with
# its Debian patches. The units of UNITS run in external mode (runtest --host
# --port --singledb, without the tags of DENY_TAGS) against three targets,
# each with a fresh redis-server on a free loopback port (direct and haproxy
# side by side, then lockgate alone):
#   direct     redis-server itself
#   haproxy    HAProxy in TCP mode in front of it (a plain byte copier)
#   lockgate   target/release/lockgate --config config/lockgate.toml
# and prints per target what passed and the names of what failed.
# UPSTREAM_MODE=shared runs lockgate with --upstream-mode shared (clients'
# plain commands over shared upstream connections; default: dedicated).
#
# Exit status: 0 when every test that passes directly also passes through
# lockgate, apart from the named EXCEPTIONS below (each must also fail through
# HAProxy: they are what any proxy changes, not lockgate's doing); 1 otherwise.
# A test lost through lockgate has its unit run once more through a fresh
# lockgate; lost again, it fails the run; passed, it is named at the end.
# What is missing is installed on a fresh Debian machine (as root, apt-get):
# tcl, dpkg-dev, haproxy, redis-server/redis-tools; lockgate is built with
# `cargo build --release`. Every process started is stopped on exit.
set -euo pipefail

# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() { sed -n '2,28s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

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

# The units run, in this order: every unit with a test that runs against an
# external server on one database with DENY_TAGS denied, except dump (15 s of
# MIGRATE timeouts for 9 tests). Nothing runs in the others: auth, info,
# printver, aofrw, latency-monitor, acl, acl-v2, shutdown, oom-score-adj, tls,
# replybufsize, querybuf, pendingquerybuf, networking, client-eviction,
# limits, obuf-limits, wait, memefficiency, maxmemory, pubsubshard, list-2,
# the cluster units (all their tests are external:skip or denied), nor in
# integration/ (they start servers of their own).
UNITS=(
	unit/protocol
	unit/keyspace
	unit/scan
	unit/info-command
	unit/type/string
	unit/type/incr
	unit/type/list
	unit/type/list-3
	unit/type/set
	unit/type/zset
	unit/type/hash
	unit/type/stream
	unit/type/stream-cgroups
	unit/sort
	unit/expire
	unit/other
	unit/multi
	unit/quit
	unit/pubsub
	unit/slowlog
	unit/scripting
	unit/functions
	unit/introspection
	unit/introspection-2
	unit/bitops
	unit/bitfield
	unit/geo
	unit/hyperloglog
	unit/lazyfree
	unit/tracking
	unit/pause
	unit/violations
)

# Tags whose tests cannot pass against a server the suite did not start, or
# test the server rather than the path to it (see tests/README.md of Redis):
# replication (SYNC), DEBUG/OBJECT, PFDEBUG, SAVE, memory limits, CONFIG
# RESETSTAT, latency monitoring, inspecting the server's own process; and, for
# time, large-memory (over 100 MB) and slow (long stress loops).
DENY_TAGS=(needs:repl needs:debug needs:pfdebug needs:save needs:config-maxmemory
	needs:config-resetstat needs:latency needs:local-process large-memory slow)

# Tests skipped for time alone (each a loop of thousands of round trips
# checking the server's own algorithms; together they would take more than
# half the run through each target).
SKIP_TESTS=(
	'/^Fuzzing dense/sparse encoding'
	'/^Stress tester for #3343-alike bugs'
	'/^GEOSEARCH fuzzy test'
	'XRANGE fuzzing'
	'SCAN regression test for issue #4906'
)

# Tests that pass directly but fail through lockgate, and must fail through
# HAProxy too: "unit: test name|why". Empty: lockgate changes nothing a byte
# copier would not.
EXCEPTIONS=()

cd "$LOCKGATE_ROOT"
SUITE_DIR="$LOCKGATE_ROOT/target/redis-suite"
CONFIG="$LOCKGATE_ROOT/config/lockgate.toml"
[ -f "$CONFIG" ] || die "missing $CONFIG"

# --- tools ------------------------------------------------------------------

have_haproxy() { have haproxy || [ -x /usr/sbin/haproxy ]; }
haproxy_bin() { if have haproxy; then command -v haproxy; else echo /usr/sbin/haproxy; fi; }

ensure_tools() {
	local missing=()
	have tclsh || missing+=(tcl)
	have dpkg-source || missing+=(dpkg-dev)
	have_haproxy || missing+=(haproxy)
	have redis-server || missing+=(redis-server)
	have redis-cli || missing+=(redis-tools)
	if [ "${#missing[@]}" -ne 0 ]; then apt_install "${missing[@]}"; fi
	have tclsh || die "tclsh still missing after apt-get"
	have dpkg-source || die "dpkg-source still missing after apt-get"
	have_haproxy || die "haproxy still missing after apt-get"
	ensure_redis
}

# --- fetching the suite -----------------------------------------------------

# The upstream version of the installed redis-server, e.g. 7.0.15.
redis_version() {
	redis-server --version | sed -n 's/.* v=\([0-9][0-9.]*\).*/\1/p'
}

deb_src_configured() {
	local f
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
		[ -f "$f" ] || continue
		grep -Eq '^[[:space:]]*(Types:.*deb-src|deb-src[[:space:]])' "$f" && return 0
	done
	return 1
}

# Adds deb-src entries mirroring the machine's own Debian entries: the same
# URIs, suites, components and Signed-By (apt refuses one repository with two
# different Signed-By values), in the same format (deb822 or one-line).
add_deb_src() {
	local f src="" out
	for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list.d/*.sources; do
		if [ -f "$f" ] && grep -q 'debian' "$f"; then
			src="$f"
			break
		fi
	done
	if [ -n "$src" ]; then
		out=/etc/apt/sources.list.d/lockgate-deb-src.sources
		log "adding deb-src entries to $out (from $src)"
		awk 'BEGIN { RS = ""; ORS = "\n\n" }
			/(^|\n)Types:[^\n]*deb/ {
				sub(/(^|\n)Types:[^\n]*/, "\nTypes: deb-src")
				sub(/^\n/, "")
				print
			}' "$src" | as_root tee "$out" >/dev/null
	elif [ -f /etc/apt/sources.list ] && grep -Eq '^[[:space:]]*deb[[:space:]]' /etc/apt/sources.list; then
		out=/etc/apt/sources.list.d/lockgate-deb-src.list
		log "adding deb-src lines to $out (from /etc/apt/sources.list)"
		sed -n 's/^[[:space:]]*deb[[:space:]]/deb-src /p' /etc/apt/sources.list |
			as_root tee "$out" >/dev/null
	else
		die "no Debian apt sources found to add a deb-src entry for"
	fi
}

# Leaves the suite of the installed version in $SUITE_DIR/redis-VERSION.
fetch_suite() {
	local version pkgver dl tmp
	version="$(redis_version)"
	[ -n "$version" ] || die "cannot tell the version of redis-server"
	SUITE_SRC="$SUITE_DIR/redis-$version"
	if [ -x "$SUITE_SRC/runtest" ] && [ -f "$SUITE_SRC/tests/test_helper.tcl" ]; then
		return 0
	fi
	have apt-get || die "apt-get not found: put Redis $version's source tree in $SUITE_SRC by hand"
	log "fetching Redis $version's test suite (Debian source package redis)"
	deb_src_configured || add_deb_src
	log "apt-get update"
	as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q ||
		die "apt-get update failed"
	dl="$SUITE_DIR/download"
	rm -rf "$dl"
	mkdir -p "$dl"
	pkgver="$(dpkg-query -W -f='${Version}' redis-server 2>/dev/null || true)"
	# The installed package's exact version first; the archive may have moved
	# on to a newer Debian revision of the same upstream version.
	if [ -z "$pkgver" ] ||
		! (cd "$dl" && apt-get source -q --download-only "redis=$pkgver" </dev/null); then
		(cd "$dl" && apt-get source -q --download-only redis </dev/null) ||
			die "apt-get source redis failed"
	fi
	local dsc
	dsc="$(find "$dl" -maxdepth 1 -name 'redis_*.dsc' | head -n 1)"
	[ -n "$dsc" ] || die "apt-get source left no .dsc in $dl"
	case "$(basename "$dsc")" in
	"redis_$version"-*) ;;
	*) die "the archive has $(basename "$dsc"), not Redis $version (the installed redis-server)" ;;
	esac
	tmp="$SUITE_DIR/unpack.$$"
	rm -rf "$tmp"
	log "dpkg-source -x $(basename "$dsc")"
	dpkg-source -x "$dsc" "$tmp" >"$dl/dpkg-source.log" 2>&1 || {
		tail -n 20 "$dl/dpkg-source.log" >&2
		die "dpkg-source -x failed"
	}
	[ -x "$tmp/runtest" ] || die "no runtest in the unpacked source"
	rm -rf "$SUITE_SRC"
	mv "$tmp" "$SUITE_SRC"
	# dpkg-source left a copy of the upstream tarball beside the tree.
	rm -rf "$dl" "$SUITE_DIR"/redis_*.orig.tar.*
	log "Redis $version's suite is in ${SUITE_SRC#"$LOCKGATE_ROOT"/}"
}

ensure_tools
fetch_suite
[ "$FETCH_ONLY" -eq 1 ] && exit 0

ensure_cargo
log "cargo build --release"
cargo build --release -q || die "cargo build --release failed"
LOCKGATE_BIN="$(cargo_target_dir)/release/lockgate"
[ -x "$LOCKGATE_BIN" ] || die "built binary not found at $LOCKGATE_BIN"

# --- processes ----------------------------------------------------------------

scratch_dir suite

RUNTEST_PID=""
# Called on exit (scratch_dir), before the processes are stopped.
# shellcheck disable=SC2317
before_exit() {
	if [ -n "$RUNTEST_PID" ]; then
		# runtest's test client runs in the same process group.
		kill -TERM -- "-$RUNTEST_PID" 2>/dev/null || true
		wait "$RUNTEST_PID" 2>/dev/null || true
	fi
}

rcli() { redis-cli -h 127.0.0.1 "$@" </dev/null 2>&1; }

# start_target NAME — a fresh redis-server, and the proxy of NAME in front of
# it; sets PORT to where the suite connects.
start_target() {
	local name="$1" dir="$WORKDIR/$1" rport pport pid
	start_behind "$dir"
	rport="$PORT"
	case "$name" in
	direct) return 0 ;;
	haproxy)
		pport="$(pick_free_port)"
		cat >"$dir/haproxy.cfg" <<-EOF
			global
			    maxconn 4096
			defaults
			    mode tcp
			    timeout connect 5s
			    timeout client 1h
			    timeout server 1h
			    timeout tunnel 1h
			listen redis
			    bind 127.0.0.1:$pport
			    server redis 127.0.0.1:$rport
		EOF
		"$(haproxy_bin)" -db -f "$dir/haproxy.cfg" </dev/null >"$dir/haproxy.log" 2>&1 &
		;;
	lockgate)
		pport="$(pick_free_port)"
		"$LOCKGATE_BIN" --config "$CONFIG" --listen "127.0.0.1:$pport" \
			--upstream "127.0.0.1:$rport" --admin-listen "" \
			--upstream-mode "${UPSTREAM_MODE:-dedicated}" \
			</dev/null >"$dir/lockgate.log" 2>&1 &
		;;
	esac
	pid=$!
	PIDS+=("$pid")
	wait_ping "$pport" "$pid" "$name"
	PORT="$pport"
}

# --- running the suite --------------------------------------------------------

# run_unit TARGET UNIT — runs one unit against $PORT and appends its results
# to $WORKDIR/TARGET.results as "ok|err<TAB>unit: test name" lines (a repeated
# name gets " #2", " #3"…; every target runs the same tests in the same
# order). A unit that ends early (an exception, or 30 s without a test
# finishing: a client waiting for a reply that never comes, e.g. after two
# clients' commands reached Redis in the other order) adds one "err" line.
run_unit() {
	local target="$1" unit="$2" log rc=0 t0=$SECONDS before
	log="$WORKDIR/$target/${unit//\//_}.log"
	before="$(wc -l <"$WORKDIR/$target.results")"
	(
		cd "$SUITE_SRC"
		exec setsid timeout -k 5 300 ./runtest --host 127.0.0.1 --port "$PORT" \
			--singledb --single "$unit" --tags "${DENY_TAGS[*]/#/-}" \
			--timeout 30 --baseport "$BASEPORT" "${SKIP_ARGS[@]}"
	) </dev/null >"$log" 2>&1 &
	RUNTEST_PID=$!
	wait "$RUNTEST_PID" || rc=$?
	RUNTEST_PID=""
	sed 's/\x1b\[[0-9;]*m//g' "$log" | awk -v unit="$unit" -v rc="$rc" '
		function add(status, name) {
			seen[name]++
			if (seen[name] > 1) name = name " #" seen[name]
			printf "%s\t%s: %s\n", status, unit, name
		}
		/^\[ok\]: / { s = substr($0, 7); sub(/ \([0-9]+ ms\)$/, "", s); add("ok", s); next }
		/^\[err\]: / { s = substr($0, 8); sub(/ in tests\/[^ ]*\.tcl$/, "", s); add("err", s); next }
		/^\[exception\]: / { exc = "exception" }
		/^\[TIMEOUT\]: / { exc = "no progress for 30 s" }
		/All tests passed without errors|tests failed/ { done = 1 }
		END {
			if (exc || (!done && rc != 0))
				printf "err\t%s: (unit aborted: %s)\n", unit, exc ? exc : "exit " rc
		}' >>"$WORKDIR/$target.results"
	printf '  %-9s %-26s %4ds  passed %3d  failed %d\n' "$target" "$unit" "$((SECONDS - t0))" \
		"$(tail -n +"$((before + 1))" "$WORKDIR/$target.results" | grep -c '^ok' || true)" \
		"$(tail -n +"$((before + 1))" "$WORKDIR/$target.results" | grep -c '^err' || true)" >&2
}

SKIP_ARGS=()
for t in "${SKIP_TESTS[@]}"; do SKIP_ARGS+=(--skiptest "$t"); done
TARGETS=(direct haproxy lockgate)
# runtest's own test server listens near --baseport: one range per target.
declare -A BASE=([direct]=21111 [haproxy]=22111 [lockgate]=23111)
# run_units TARGET — every unit against $PORT (set by start_target).
run_units() {
	local target="$1" t0=$SECONDS
	BASEPORT="${BASE[$target]}"
	log "[$target] ${#UNITS[@]} units against 127.0.0.1:$PORT"
	: >"$WORKDIR/$target.results"
	for unit in "${UNITS[@]}"; do
		run_unit "$target" "$unit"
	done
	log "[$target] done in $((SECONDS - t0))s"
}

START=$SECONDS
# Redis directly and through HAProxy side by side (each its own server and
# runtest ports), then lockgate alone: what lockgate is judged by runs on a
# quiet box. Saves a third of the step. The cost: a test too timing-bound
# for a shared box fails directly and leaves the comparison (the counts at
# the end say how many passed directly).
start_target direct
DIRECT_PORT="$PORT"
start_target haproxy
HAPROXY_PORT="$PORT"
(PORT="$DIRECT_PORT" run_units direct) &
side_a=$!
(PORT="$HAPROXY_PORT" run_units haproxy) &
side_b=$!
wait "$side_a" || die "the direct run failed to run"
wait "$side_b" || die "the HAProxy run failed to run"
stop_all
start_target lockgate
run_units lockgate
stop_all

# --- the verdict --------------------------------------------------------------

keys() { sed -n "s/^$2\t//p" "$WORKDIR/$1.results" | sort -u; }
for target in "${TARGETS[@]}"; do
	keys "$target" ok >"$WORKDIR/$target.ok"
	keys "$target" err >"$WORKDIR/$target.err"
done
# A test counts as passing directly when it passed and never failed there.
comm -23 "$WORKDIR/direct.ok" "$WORKDIR/direct.err" >"$WORKDIR/baseline"
for target in haproxy lockgate; do
	# Lost: passes directly, but not here (failed, or never ran).
	comm -23 "$WORKDIR/baseline" <(comm -23 "$WORKDIR/$target.ok" "$WORKDIR/$target.err") \
		>"$WORKDIR/$target.lost"
done

# A second run for the units of what was lost through lockgate, on a fresh
# server and lockgate: a few of the suite's tests are timing-sensitive (a
# unit aborted or a test lost through HAProxy, a plain byte copier, in
# earlier runs here), and one lost once by the extra hop is not lockgate
# changing a command. A test lost again is lost; one that passes the second
# time is named at the end as lost once, so it is seen, not hidden.
: >"$WORKDIR/lockgate.flaky"
if [ -s "$WORKDIR/lockgate.lost" ]; then
	mapfile -t RERUN < <(sed 's/: .*//' "$WORKDIR/lockgate.lost" | sort -u)
	log "[lockgate] lost $(wc -l <"$WORKDIR/lockgate.lost"); running ${RERUN[*]} again"
	mv "$WORKDIR/lockgate" "$WORKDIR/lockgate.first"
	mv "$WORKDIR/lockgate.results" "$WORKDIR/lockgate.results.first"
	start_target lockgate
	BASEPORT="${BASE[lockgate]}"
	: >"$WORKDIR/lockgate.results"
	for unit in "${RERUN[@]}"; do
		run_unit lockgate "$unit"
	done
	stop_all
	mv "$WORKDIR/lockgate" "$WORKDIR/lockgate.rerun"
	mv "$WORKDIR/lockgate.first" "$WORKDIR/lockgate"
	mv "$WORKDIR/lockgate.results" "$WORKDIR/lockgate.rerun.results"
	mv "$WORKDIR/lockgate.results.first" "$WORKDIR/lockgate.results"
	comm -23 <(keys lockgate.rerun ok) <(keys lockgate.rerun err) |
		comm -12 "$WORKDIR/lockgate.lost" - >"$WORKDIR/lockgate.flaky"
	comm -23 "$WORKDIR/lockgate.lost" "$WORKDIR/lockgate.flaky" >"$WORKDIR/lockgate.lost.again"
	mv "$WORKDIR/lockgate.lost.again" "$WORKDIR/lockgate.lost"
fi

printf '\nRedis %s test suite (%s units), external mode\n' "$(redis_version)" "${#UNITS[@]}"
for target in "${TARGETS[@]}"; do
	printf '\n%-9s passed %4d   failed %3d\n' "$target" \
		"$(wc -l <"$WORKDIR/$target.ok")" "$(wc -l <"$WORKDIR/$target.err")"
	sed 's/^/    failed: /' "$WORKDIR/$target.err"
	if [ "$target" != direct ]; then
		# What passes directly and did not run here at all (its unit ended
		# early), counted per unit.
		comm -23 "$WORKDIR/$target.lost" "$WORKDIR/$target.err" |
			sed 's/: .*//' | sort | uniq -c |
			awk '{ printf "    not run (unit ended early): %s, %d test(s) that pass directly\n", $2, $1 }'
	fi
done
printf '\n'

fail=0
: >"$WORKDIR/excepted"
for entry in ${EXCEPTIONS[@]+"${EXCEPTIONS[@]}"}; do
	name="${entry%%|*}"
	printf '%s\n' "$name" >>"$WORKDIR/excepted"
	if ! grep -qxF "$name" "$WORKDIR/lockgate.lost"; then
		warn "exception no longer needed (passes through lockgate or not directly): $name"
	elif ! grep -qxF "$name" "$WORKDIR/haproxy.lost"; then
		printf 'exception passes through HAProxy, so it is lockgate'\''s doing: %s\n' "$name"
		fail=1
	else
		printf 'excepted (%s): %s\n' "${entry#*|}" "$name"
	fi
done
sort -u "$WORKDIR/excepted" -o "$WORKDIR/excepted"
comm -23 "$WORKDIR/lockgate.lost" "$WORKDIR/excepted" >"$WORKDIR/regressions"
regressions="$(wc -l <"$WORKDIR/regressions")"
[ "$regressions" -eq 0 ] || fail=1

printf '\nredis-suite: %d pass directly, %d through haproxy, %d through lockgate;' \
	"$(wc -l <"$WORKDIR/baseline")" \
	"$(($(wc -l <"$WORKDIR/baseline") - $(wc -l <"$WORKDIR/haproxy.lost")))" \
	"$(($(wc -l <"$WORKDIR/baseline") - $(wc -l <"$WORKDIR/lockgate.lost")))"
if [ "$fail" -eq 0 ]; then
	printf ' lockgate lost none (%d excepted); %ds\n' "${#EXCEPTIONS[@]}" "$((SECONDS - START))"
	sed 's/^/    lost once through lockgate, passed when its unit ran again: /' \
		"$WORKDIR/lockgate.flaky"
else
	printf ' FAILED: %d lost through lockgate; %ds\n' "$regressions" "$((SECONDS - START))"
	# Named again last: CI shows the end of the output, and the per-target
	# lists above scroll away.
	sed 's/^/    lost through lockgate: /' "$WORKDIR/regressions"
	exit 1
fi
