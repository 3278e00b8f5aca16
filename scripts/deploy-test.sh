#!/usr/bin/env bash
# The deployment examples, tried as an operator would use them:
#
# 1. The Kubernetes sidecar (docker/k8s/lockgate-sidecar.yaml) against the
#    Kubernetes API schemas (kubernetes-validate, offline, --strict: an
#    unknown field fails), and against lockgate itself: its ConfigMap passes
#    `lockgate --check`, the container ports are the listen ports of that
#    configuration and of config/lockgate.toml, the probes are /healthz and
#    /readyz on the admin port, Prometheus scrapes that port, and the pod's
#    grace period covers preStop plus proxy.shutdown_grace_ms.
# 2. The compose stack of images built here without pulling
#    (docker/local-images.sh, docker/compose.local.yml): up, a lock taken,
#    leased, refused to a second client, released and taken again through
#    it, LOCKGATE LOCKS naming the holder, then down. Needs a Docker engine:
#    as root with dockerd installed but not running, one is started for the
#    test and stopped after it; where none can run, this part is skipped
#    with a message saying so.
#
#   scripts/deploy-test.sh          (uses target/release/lockgate; builds it if missing)
set -euo pipefail

# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$LOCKGATE_ROOT"

ensure_python
BIN=$LOCKGATE_ROOT/target/release/lockgate
[[ -x $BIN ]] || cargo build --release --quiet --bin lockgate

log "the Kubernetes sidecar example against the API schemas"
python3 -m kubernetes_validate --strict --quiet docker/k8s/lockgate-sidecar.yaml ||
	die "docker/k8s/lockgate-sidecar.yaml does not validate"

log "the sidecar example against lockgate's configuration"
TMP=$(mktemp -d)
python3 - "$BIN" "$TMP" <<'PY' || die "docker/k8s/lockgate-sidecar.yaml disagrees with lockgate"
import subprocess, sys, tomllib, yaml

binary, tmp = sys.argv[1], sys.argv[2]
docs = list(yaml.safe_load_all(open("docker/k8s/lockgate-sidecar.yaml")))
kinds = {d["kind"]: d for d in docs}
config_text = kinds["ConfigMap"]["data"]["lockgate.toml"]
path = f"{tmp}/lockgate.toml"
open(path, "w").write(config_text)
checked = subprocess.run([binary, "--check", "--config", path], capture_output=True, text=True)
assert checked.returncode == 0, f"the ConfigMap's configuration: {checked.stderr}"
mine = tomllib.loads(config_text)
shipped = tomllib.load(open("config/lockgate.toml", "rb"))
port = lambda addr: int(addr.rsplit(":", 1)[1])
redis_port = port(mine.get("proxy", {}).get("listen", shipped["proxy"]["listen"]))
admin_port = port(mine.get("admin", {}).get("listen", shipped["admin"]["listen"]))
assert redis_port == port(shipped["proxy"]["listen"]), "the Redis port differs from config/lockgate.toml"
assert admin_port == port(shipped["admin"]["listen"]), "the admin port differs from config/lockgate.toml"
assert mine["admin"]["listen"].startswith("0.0.0.0:"), "the kubelet cannot reach an admin listener on localhost"
pod = kinds["Deployment"]["spec"]["template"]
lg = next(c for c in pod["spec"]["containers"] if c["name"] == "lockgate")
ports = {p["name"]: p["containerPort"] for p in lg["ports"]}
assert ports == {"redis": redis_port, "admin": admin_port}, ports
assert lg["command"][-2:] == ["--config", "/etc/lockgate/lockgate.toml"], lg["command"]
assert "args" not in lg, "args would bring back the image's CMD"
mount = next(m for m in lg["volumeMounts"] if m["name"] == "config")
assert mount["mountPath"] == "/etc/lockgate", mount
for probe, path in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")]:
    got = lg[probe]["httpGet"]
    assert got["path"] == path and got["port"] in ("admin", admin_port), (probe, got)
notes = pod["metadata"]["annotations"]
assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == admin_port, notes
assert notes["prometheus.io/path"] == "/metrics", notes
grace_ms = mine.get("proxy", {}).get("shutdown_grace_ms", shipped["proxy"]["shutdown_grace_ms"])
pre_stop = lg["lifecycle"]["preStop"]["sleep"]["seconds"]
period = pod["spec"]["terminationGracePeriodSeconds"]
assert period >= pre_stop + grace_ms / 1000 + 1, f"grace {period} s < preStop {pre_stop} s + drain {grace_ms} ms"
app = next(c for c in pod["spec"]["containers"] if c["name"] == "app")
env = {e["name"]: e["value"] for e in app["env"]}
assert env["REDIS_HOST"] == "127.0.0.1" and int(env["REDIS_PORT"]) == redis_port, env
print(f"sidecar example: ports {redis_port}/{admin_port}, grace {period} s >= {pre_stop} s + {grace_ms} ms")
PY

# A Docker engine: the one running, or one started here (and stopped at
# the end); none: the compose part is skipped, saying so.
STARTED_DOCKERD=
stop_dockerd() {
	if [[ -n $STARTED_DOCKERD ]]; then
		kill "$STARTED_DOCKERD" 2>/dev/null || true
	fi
}
ensure_docker() {
	docker info >/dev/null 2>&1 && return 0
	[[ $(id -u) == 0 ]] || return 1
	# An engine that cannot be installed fails the step (apt_install dies):
	# only one that is installed and will not run is skipped.
	have dockerd || apt_install docker.io
	log "starting dockerd for the compose test (stopped after it)"
	setsid dockerd >"$LOCKGATE_ROOT/target/dockerd.log" 2>&1 &
	STARTED_DOCKERD=$!
	for _ in $(seq 1 100); do
		docker info >/dev/null 2>&1 && return 0
		kill -0 "$STARTED_DOCKERD" 2>/dev/null || break
		sleep 0.2
	done
	return 1
}

PROJECT=lockgate-deploy-test
COMPOSE=(docker-compose -f docker/compose.local.yml -p "$PROJECT")
cleanup() {
	if [[ -n ${COMPOSE_UP:-} ]]; then
		"${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
		docker image rm lockgate:local lockgate-redis:local >/dev/null 2>&1 || true
	fi
	stop_dockerd
	rm -rf "$TMP"
}
trap cleanup EXIT

if ! ensure_docker; then
	log "SKIPPED the compose stack: no Docker engine runs here (docker info fails; see target/dockerd.log)"
	exit 0
fi
have docker-compose || apt_install docker-compose

log "images from local files (docker/local-images.sh), no pull"
docker/local-images.sh "$BIN"
REDIS_PORT_OUT=$(pick_free_port)
ADMIN_PORT_OUT=$(pick_free_port)
export REDIS_PORT_OUT ADMIN_PORT_OUT
log "compose up: lockgate on 127.0.0.1:$REDIS_PORT_OUT, admin on 127.0.0.1:$ADMIN_PORT_OUT"
COMPOSE_UP=1
"${COMPOSE[@]}" up -d
# Ready once the lock masters vote (they started moments before lockgate,
# so they first sit out locks.quorum.rejoin_delay_ms, 30 s by default).
ready=
for _ in $(seq 1 300); do
	if curl -sf "http://127.0.0.1:$ADMIN_PORT_OUT/readyz" >/dev/null 2>&1; then
		ready=1
		break
	fi
	sleep 0.2
done
if [[ -z $ready ]]; then
	"${COMPOSE[@]}" logs --tail 30 >&2 || true
	die "the stack never became ready: $(curl -s "http://127.0.0.1:$ADMIN_PORT_OUT/readyz" || true)"
fi

log "a lock through the stack"
# Two clients, as two app processes: the lock leased, refused to the
# other, named by LOCKGATE LOCKS, released by its holder, taken again.
python3 - "$REDIS_PORT_OUT" <<'PY' || die "a lock through the stack did not behave"
import sys, redis
port = int(sys.argv[1])
holder, other = (redis.Redis(port=port, protocol=2, decode_responses=True) for _ in range(2))
assert holder.setnx("lock:deploy:1", "holder") is True
assert other.setnx("lock:deploy:1", "other") is False
assert holder.pttl("lock:deploy:1") > 0, "no lease on a bare SETNX"
rows = holder.execute_command("LOCKGATE", "LOCKS", "lock:deploy:*")
row = dict(zip(rows[0][::2], rows[0][1::2]))
assert row["holder"] == "this instance" and len(row["acquisition"]) == 16, row
assert other.delete("lock:deploy:1") == 0, "a release by a connection that never held it"
assert holder.delete("lock:deploy:1") == 1
assert other.setnx("lock:deploy:1", "next") is True
assert holder.set("plain:deploy", "value") and other.get("plain:deploy") == "value"
PY
# The lock is on the masters, the data on the primary.
on_primary=$(docker exec "$("${COMPOSE[@]}" ps -q primary)" /usr/bin/redis-cli EXISTS lock:deploy:1)
on_master=$(docker exec "$("${COMPOSE[@]}" ps -q m1)" /usr/bin/redis-cli EXISTS lock:deploy:1)
[[ $on_primary == 0 && $on_master == 1 ]] ||
	die "the lock should be on the masters only (primary $on_primary, m1 $on_master)"
log "compose down"
"${COMPOSE[@]}" down -v --remove-orphans >/dev/null
COMPOSE_UP=
log "deploy: the sidecar example and the compose stack work"
