#!/usr/bin/env bash
# deploy/docker/Dockerfile, built and run for real: this script uses the Docker daemon that is
# running or starts one of its own (Debian's docker.io, on a private socket), builds the image from
# the source tree, and runs the synthetic job in a container for STEPS steps (ZeRO-3, 2 ranks, NVMe
# offload to a directory mounted from the host). It checks that the job finished, that its loss
# fell, and that the checkpoint, metrics and report it wrote are on the host.
#
# Where no registry is reachable (as on the project's build machines), the base image debian:12 is
# made by debootstrap from Debian's own mirror and imported; where NVIDIA's CUDA repository is not
# reachable, the image is built with CUDA=0 (the CPU device). Both choices are printed. The image
# holds the strata command only (TARGETS=strata), which keeps the build inside to about ten
# minutes on two cores. Skips (77) without root, without docker and dockerd, or when a daemon
# cannot start here (its log is printed).
#
#   tests/deploy/docker_test.sh WORK [STEPS]   (default 60, at least 20)
#   STRATA_DOCKER_CUDA=0|1 overrides the CUDA probe. The image stays (strata-test:local), so that
#   the next run's build reuses its layers; `docker image rm strata-test:local` removes it.
set -euo pipefail
work="$1"
steps="${2:-60}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
[[ "$steps" =~ ^[0-9]+$ ]] && [ "$steps" -ge 20 ] ||
  { echo "docker_test: STEPS is '$steps'; it must be a whole number of at least 20" >&2; exit 2; }

[ "$(id -u)" = 0 ] || { echo "SKIP: starting dockerd and mounting volumes needs root"; exit 77; }
for b in docker dockerd; do
  command -v "$b" >/dev/null || { echo "SKIP: $b not found (deploy/install-deps.sh installs docker.io)"; exit 77; }
done

rm -rf "$work"
mkdir -p "$work/out"
work="$(cd "$work" && pwd)"
# dockerd's run-time directory holds unix sockets, whose paths must stay short.
exec_root="$(mktemp -d /tmp/strata-docker.XXXXXX)"
dockerd_pid=""
image="strata-test:local"
cleanup() {
  if [ -n "$dockerd_pid" ]; then
    kill "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.2; done
  fi
  rm -rf "$exec_root"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; [ -f "$work/dockerd.log" ] && { echo "--- dockerd.log"; tail -n 20 "$work/dockerd.log"; }; exit 1; }
now() { date +%s; }
t0=$(now)

# The daemon: the one already running, or our own on a private socket. Its data root is kept
# between runs (/var/lib/strata-docker) so that a second run reuses the base image and layers.
if docker info >/dev/null 2>&1; then
  echo "docker: using the running daemon ($(docker info --format '{{.ServerVersion}}'))"
else
  export DOCKER_HOST="unix://$exec_root/docker.sock"
  dockerd --host "$DOCKER_HOST" --exec-root "$exec_root/exec" --pidfile "$exec_root/dockerd.pid" \
    --data-root /var/lib/strata-docker >"$work/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || break
    sleep 0.5
  done
  if ! docker info >/dev/null 2>&1; then
    echo "SKIP: dockerd did not start here; the last lines of its log:"
    tail -n 10 "$work/dockerd.log"
    exit 77
  fi
  echo "docker: started dockerd $(docker info --format '{{.ServerVersion}}') on $DOCKER_HOST"
fi

# The base image: from a registry if one answers, else debootstrap's Debian 12 imported.
base=debian:12
if docker image inspect "$base" >/dev/null 2>&1; then
  echo "base: $base (present)"
elif timeout 60 docker pull -q "$base" >/dev/null 2>&1; then
  echo "base: $base (pulled)"
else
  base=strata-local/debian:12
  if docker image inspect "$base" >/dev/null 2>&1; then
    echo "base: $base (debootstrap, imported by an earlier run)"
  else
    command -v debootstrap >/dev/null ||
      fail "no registry answers for debian:12 and debootstrap is missing (deploy/install-deps.sh installs it)"
    echo "base: no registry answers for debian:12; making it with debootstrap from deb.debian.org"
    debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian \
      >"$work/debootstrap.log" 2>&1 || { tail -n 20 "$work/debootstrap.log"; fail "debootstrap failed"; }
    tar -C "$work/rootfs" -c . | docker import - "$base" >/dev/null || fail "docker import failed"
    rm -rf "$work/rootfs"
    echo "base: $base imported ($(( $(now) - t0 )) s so far)"
  fi
fi

cuda="${STRATA_DOCKER_CUDA:-}"
if [ -z "$cuda" ]; then
  if timeout 15 bash -c 'exec 3<>/dev/tcp/developer.download.nvidia.com/443' 2>/dev/null; then
    cuda=1
  else
    cuda=0
  fi
fi
[ "$cuda" = 1 ] && echo "cuda: NVIDIA's repository answers; building with the CUDA toolkit" ||
  echo "cuda: NVIDIA's repository is not reachable from here; building with CUDA=0 (the CPU device)"

# The build context is the source tree less what .dockerignore leaves out (build trees, .git).
t_build=$(now)
docker build -f "$root/deploy/docker/Dockerfile" -t "$image" --build-arg "BASE=$base" \
  --build-arg "CUDA=$cuda" --build-arg TARGETS=strata "$root" >"$work/build.log" 2>&1 ||
  { tail -n 40 "$work/build.log"; fail "docker build failed (log: $work/build.log)"; }
echo "image: $image built in $(( $(now) - t_build )) s"

# The synthetic job, as the image's default command would run it, for STEPS steps; what it writes
# (NVMe directory included) goes to a host directory. The locked-memory limit stays the
# daemon's: raising it (--ulimit memlock=-1:-1, as docs advise for the pinned pool) fails where
# the host's own hard limit is lower.
t_run=$(now)
docker run --rm --shm-size=1g \
  -v "$work/out:/strata/build/default/synthetic-job" "$image" ./deploy/synthetic-job.sh build/default "$steps" \
  >"$work/run.log" 2>&1 || { tail -n 40 "$work/run.log"; fail "the synthetic job failed in the container"; }
echo "synthetic job: $steps steps in the container in $(( $(now) - t_run )) s"
tail -n 3 "$work/run.log"

grep -q "synthetic-job: done" "$work/run.log" || fail "the synthetic job did not say it was done"
for f in metrics.jsonl report.html ds_config.json checkpoint/latest/config.json \
  checkpoint/latest/model.safetensors "checkpoint/step-$(printf %08d "$steps")/trainer_state.json"; do
  [ -s "$work/out/$f" ] || fail "the synthetic job did not leave $f on the host"
done
/usr/bin/python3 - "$work/out/metrics.jsonl" "$steps" <<'PY' || fail "the metrics do not show the training run"
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps = [r for r in rows if "loss" in r and "step" in r]
want = int(sys.argv[2])
assert len(steps) == want, f"{len(steps)} steps in the metrics, {want} wanted"
assert all(math.isfinite(r["loss"]) for r in steps), "a loss is not finite"
# Early steps are noisy (20 of warm-up): compare the means of the first and the last ten.
first = sum(r["loss"] for r in steps[:10]) / 10
last = sum(r["loss"] for r in steps[-10:]) / 10
assert last < first - 0.05, f"the loss did not fall: mean of the first ten {first}, of the last ten {last}"
print(f"metrics: {len(steps)} steps, mean loss of the first ten {first:.3f}, of the last ten {last:.3f}")
PY
echo "PASS: deploy/docker/Dockerfile built (base $base, CUDA=$cuda) and the synthetic job trained in it ($(( $(now) - t0 )) s in all)"
