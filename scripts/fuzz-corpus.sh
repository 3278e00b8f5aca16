#!/usr/bin/env bash
# Records the fuzz targets' seed corpus from real traffic and replaces
# fuzz/corpus/ with it:
#
#   scripts/fuzz-corpus.sh            re-record the quick part, keep the suite's
#   scripts/fuzz-corpus.sh --suite    re-record Redis's own test suite's part too
#
# fuzz/seed/record.py runs a private redis-server (unix socket only) behind
# a recording relay, drives it with redis-benchmark, redis-cli, inline
# commands and raw RESP2/RESP3 sessions, and writes what each side sent
# (a few seconds). The files recorded from Redis's own tcl test suite, listed
# in fuzz/seed/suite-files, are kept as they are unless --suite is given:
# then fuzz/seed/record_suite.py runs twenty of the suite's units in
# external mode through a TCP recording relay in front of a private
# redis-server on a free loopback port (a few minutes), keeps a varied
# sample of short slices (at most 300 files per target) and rewrites
# fuzz/seed/suite-files. The suite is the one scripts/redis-suite.sh --fetch
# leaves in target/redis-suite/ (fetched when missing), or REDIS_SUITE_SRC.
# Installs redis-server/redis-tools (and tcl for --suite) when missing.
set -euo pipefail

LOG_TAG=fuzz-corpus
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SUITE=0
case "${1:-}" in
'') ;;
--suite) SUITE=1 ;;
-h | --help)
	sed -n '2,20s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
	exit 0
	;;
*) die "unknown argument: $1 (scripts/fuzz-corpus.sh takes only --suite)" ;;
esac
[ $# -le 1 ] || die "too many arguments"

ensure_redis
have python3 || apt_install python3
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
python3 "$LOCKGATE_ROOT/fuzz/seed/record.py" "$OUT/corpus" || die "recording failed"
LISTING="$LOCKGATE_ROOT/fuzz/seed/suite-files"
if [ "$SUITE" -eq 1 ]; then
	have tclsh || apt_install tcl
	SRC="${REDIS_SUITE_SRC:-}"
	if [ -z "$SRC" ]; then
		version="$(redis-server --version | sed -n 's/.* v=\([0-9][0-9.]*\).*/\1/p')"
		SRC="$LOCKGATE_ROOT/target/redis-suite/redis-$version"
		[ -x "$SRC/runtest" ] || "$LOCKGATE_ROOT/scripts/redis-suite.sh" --fetch ||
			die "fetching Redis's test suite failed"
	fi
	python3 "$LOCKGATE_ROOT/fuzz/seed/record_suite.py" "$SRC" "$OUT/suite" ||
		die "recording the suite failed"
	mv "$OUT/suite/suite-files" "$OUT/suite-files"
else
	# The suite's files of the current corpus, as they are.
	mkdir -p "$OUT/suite"
	: >"$OUT/suite-files"
	if [ -f "$LISTING" ]; then
		while IFS= read -r f; do
			if [ -f "$LOCKGATE_ROOT/fuzz/corpus/$f" ]; then
				mkdir -p "$OUT/suite/${f%/*}"
				cp "$LOCKGATE_ROOT/fuzz/corpus/$f" "$OUT/suite/$f"
				printf '%s\n' "$f" >>"$OUT/suite-files"
			else
				warn "fuzz/corpus/$f (fuzz/seed/suite-files) is missing; run with --suite"
			fi
		done <"$LISTING"
	fi
fi
cp -R "$OUT/suite/." "$OUT/corpus/"
rm -rf "$LOCKGATE_ROOT/fuzz/corpus"
cp -R "$OUT/corpus" "$LOCKGATE_ROOT/fuzz/corpus"
cp "$OUT/suite-files" "$LISTING"
log "fuzz/corpus: $(find "$LOCKGATE_ROOT/fuzz/corpus" -type f | wc -l) files" \
	"($(wc -l <"$LISTING") from Redis's test suite)," \
	"$(du -sh --apparent-size "$LOCKGATE_ROOT/fuzz/corpus" | cut -f1)"
