#!/usr/bin/env bash
# Records the fuzz targets' seed corpus from real traffic and replaces
# fuzz/corpus/ with it:
#
#   scripts/fuzz-corpus.sh
#
# fuzz/seed/record.py runs a private redis-server (unix socket only) behind
# a recording relay, drives it with redis-benchmark, redis-cli, inline
# commands and raw RESP2/RESP3 sessions, and writes what each side sent.
# Installs redis-server/redis-tools when missing.
set -euo pipefail

LOG_TAG=fuzz-corpus
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

case "${1:-}" in
'') ;;
-h | --help)
	sed -n '2,11s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
	exit 0
	;;
*) die "unknown argument: $1 (scripts/fuzz-corpus.sh takes none)" ;;
esac

ensure_redis
have python3 || apt_install python3
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
python3 "$LOCKGATE_ROOT/fuzz/seed/record.py" "$OUT" || die "recording failed"
rm -rf "$LOCKGATE_ROOT/fuzz/corpus"
cp -R "$OUT" "$LOCKGATE_ROOT/fuzz/corpus"
log "fuzz/corpus: $(find "$LOCKGATE_ROOT/fuzz/corpus" -type f | wc -l) files," \
	"$(du -sh --apparent-size "$LOCKGATE_ROOT/fuzz/corpus" | cut -f1)"
