#!/usr/bin/env bash
# Runs the coverage-guided fuzz targets of fuzz/ (cargo-fuzz, libFuzzer),
# each for a bounded time, on the stable toolchain:
#
#   scripts/fuzz.sh [--minutes N | --seconds N] [--light] [target...]
#
# Default: every target (`cargo fuzz list`) for 1 minute. Installs
# cargo-fuzz when missing, builds the targets (RUSTC_BOOTSTRAP=1, no
# sanitizer: the code under test is safe Rust), then runs each on a scratch
# copy of its seed corpus fuzz/corpus/<target>/, so the checked-in corpus is
# not grown by every run. Prints, per target, the executions, libFuzzer's
# coverage (cov: edges, ft: features) and the crashes. A crash or
# invariant break leaves its input under fuzz/artifacts/<target>/ and the
# run's log under fuzz/target/fuzz-logs/; reproduce it with
# `RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer none <target> <file>` in fuzz/.
#
# --light builds at opt-level 1 without debug info: 3.8 min instead of
# about 6 on a 2-core box, at some 10 000 executions a second (what CI
# runs, scripts/test.sh; a longer hunt wants the full build).
#
# Exit status: 0 when no target crashed, 1 otherwise.
set -euo pipefail

LOG_TAG=fuzz
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SECONDS_EACH=60
TARGETS=()
while [ "$#" -gt 0 ]; do
	case "$1" in
	--minutes | --seconds)
		[ "$#" -ge 2 ] || die "$1 needs a number"
		case "$2" in
		'' | *[!0-9]*) die "$1 needs a whole number, not '$2'" ;;
		esac
		if [ "$1" = --minutes ]; then
			SECONDS_EACH=$(($2 * 60))
		else
			SECONDS_EACH=$2
		fi
		shift 2
		;;
	--light)
		# Both the build and `cargo fuzz run` (which would rebuild
		# otherwise) see the same profile.
		export CARGO_PROFILE_RELEASE_OPT_LEVEL=1 CARGO_PROFILE_RELEASE_DEBUG=0
		shift
		;;
	-h | --help)
		sed -n '2,22s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
		exit 0
		;;
	-*) die "unknown option: $1 (see scripts/fuzz.sh --help)" ;;
	*)
		TARGETS+=("$1")
		shift
		;;
	esac
done
[ "$SECONDS_EACH" -gt 0 ] || die "the time per target must be at least 1 second"

ensure_cargo_fuzz
# cargo-fuzz needs nightly-only rustc flags; RUSTC_BOOTSTRAP lets the
# stable toolchain accept them.
export RUSTC_BOOTSTRAP=1
FUZZ_DIR="$LOCKGATE_ROOT/fuzz"
cd "$FUZZ_DIR"

if [ "${#TARGETS[@]}" -eq 0 ]; then
	mapfile -t TARGETS < <(cargo fuzz list)
	[ "${#TARGETS[@]}" -gt 0 ] || die "cargo fuzz list found no targets in $FUZZ_DIR"
fi

log "building ${TARGETS[*]}"
cargo fuzz build --sanitizer none || die "cargo fuzz build failed"

LOGS="$FUZZ_DIR/target/fuzz-logs"
SCRATCH="$FUZZ_DIR/target/fuzz-corpus"
mkdir -p "$LOGS"
SUMMARY=()
CRASHED=()

# artifacts TARGET — the number of crash, timeout and out-of-memory inputs
# kept for TARGET.
artifacts() {
	find "$FUZZ_DIR/artifacts/$1" -type f 2>/dev/null | wc -l
}

for target in "${TARGETS[@]}"; do
	[ -d "corpus/$target" ] || warn "no seed corpus in fuzz/corpus/$target"
	rm -rf "${SCRATCH:?}/$target"
	mkdir -p "$SCRATCH/$target" "$FUZZ_DIR/artifacts/$target"
	if [ -d "corpus/$target" ]; then
		cp -R "corpus/$target/." "$SCRATCH/$target/"
	fi
	before=$(artifacts "$target")
	log "$target: ${SECONDS_EACH}s"
	rc=0
	cargo fuzz run --sanitizer none "$target" "$SCRATCH/$target" -- \
		-max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 \
		-print_final_stats=1 >"$LOGS/$target.log" 2>&1 || rc=$?
	execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$LOGS/$target.log" | tail -n 1)
	stats=$(grep -E '^#[0-9]+' "$LOGS/$target.log" | grep 'cov:' | tail -n 1 || true)
	cov=$(printf '%s\n' "$stats" | sed -n 's/.* cov: \([0-9]*\).*/\1/p')
	ft=$(printf '%s\n' "$stats" | sed -n 's/.* ft: \([0-9]*\).*/\1/p')
	crashes=$(($(artifacts "$target") - before))
	if [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ]; then
		# libFuzzer stopped without leaving an input: count the failure.
		crashes=1
	fi
	line="$(printf '%-9s execs %-10s cov %-6s ft %-7s crashes %s' "$target" \
		"${execs:-?}" "${cov:-?}" "${ft:-?}" "$crashes")"
	SUMMARY+=("$line")
	if [ "$crashes" -ne 0 ]; then
		CRASHED+=("$target")
		warn "$target failed (exit $rc); its log: fuzz/target/fuzz-logs/$target.log"
		grep -E 'panicked at|^SUMMARY|Test unit written to' "$LOGS/$target.log" >&2 || true
	fi
done

printf '\n==> fuzz summary (%ss per target)\n' "$SECONDS_EACH" >&2
printf '  %s\n' "${SUMMARY[@]}" >&2
if [ "${#CRASHED[@]}" -ne 0 ]; then
	printf '\nfuzz.sh: crash or invariant break in: %s (inputs under fuzz/artifacts/)\n' \
		"${CRASHED[*]}" >&2
	exit 1
fi
printf '\nfuzz.sh: no crash in %d target(s)\n' "${#TARGETS[@]}" >&2
