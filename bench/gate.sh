#!/usr/bin/env bash
# The performance gate (a step of scripts/test.sh): instructions lockgate
# runs per request and Redis commands per lock operation, measured by
# bench/gate.py and checked against bench/gate-baseline.txt; a figure worse
# than its baseline by more than its tolerance fails. Counts, not times: a
# noisy box does not move them (docs/performance.md, "The gate").
#
#   bench/gate.sh            measure and check (about a minute)
#   bench/gate.sh --update   measure and rewrite the baseline's values
#
# A commit that changes the baseline says why in a line of its message
# that starts with "Baseline:"; the gate checks every such commit, so a
# figure cannot be moved in silence. Environment: LOCKGATE_BIN (default:
# cargo build --release).
set -euo pipefail
BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$BENCH_DIR/.." && pwd)
LOG_TAG=gate
# shellcheck source=scripts/common.sh
. "$REPO/scripts/common.sh"

UPDATE=()
case ${1:-} in
  --update) UPDATE=(--update) ;;
  "") ;;
  *) die "unknown argument: $1 (bench/gate.sh takes --update or nothing)" ;;
esac

install_missing "redis-server redis-tools valgrind" redis-server redis-benchmark valgrind callgrind_control
ensure_python
ensure_valkey
if [[ -z ${LOCKGATE_BIN:-} ]]; then
  log "cargo build --release"
  (cd "$REPO" && cargo build --release --quiet --bin lockgate) || die "cargo build --release failed"
  LOCKGATE_BIN="$(cargo_target_dir)/release/lockgate"
fi

# Every commit that changed the baseline says why.
if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1 &&
  [[ $(git -C "$REPO" rev-parse --is-shallow-repository) == false ]]; then
  while read -r rev; do
    git -C "$REPO" log -1 --format=%B "$rev" | grep -q '^Baseline:' ||
      die "commit $rev changes bench/gate-baseline.txt without a 'Baseline:' line saying why"
  done < <(git -C "$REPO" log --format=%H -- bench/gate-baseline.txt)
else
  warn "not a whole git clone: the baseline's commit messages are not checked"
fi

exec python3 "$BENCH_DIR/gate.py" --lockgate "$LOCKGATE_BIN" --valkey "$(valkey_server)" "${UPDATE[@]}"
