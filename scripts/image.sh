#!/usr/bin/env bash
# Build and check hvd_slim's reproduction image with docker or podman (docs/image.md).
#
#   scripts/image.sh build        build the image (`make image`)
#   scripts/image.sh test         offline (--network none) in the image: `make demo`, the unit
#                                 tier and, with WITH_HOROVOD=1, the Horovod tier (`make image-test`)
#   scripts/image.sh compare      `make demo` on this machine, then compare its figures with the
#                                 image's from the last `test` (`make image-compare`)
#   scripts/image.sh run CMD...   run CMD in the image, offline; IMAGE_RUN_FLAGS adds engine flags
#                                 (e.g. "--privileged --user 0" for `make bench`)
#
# Settings (environment): WITH_HOROVOD=0|1 (default 0; 1 also builds Horovod, tag hvd-slim:horovod),
# IMAGE (the tag), ENGINE=docker|podman (default: docker when its engine answers, else podman),
# BASE_IMAGE (default debian:bookworm-slim), TORCH_INDEX_URL (default: the Dockerfile's CPU
# index when it answers from here, else none), DEBIAN_MIRROR (for a base made with debootstrap),
# IMAGE_BUILD_FLAGS (more engine build flags, e.g. --no-cache), IMAGE_INSTALL_ENGINE=0 (never
# install podman).
#
# Idempotent: an engine, a base image or an image already there is used, not made again.
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_HOROVOD=${WITH_HOROVOD:-0}
case "$WITH_HOROVOD" in 0 | 1) ;; *) echo "[image] WITH_HOROVOD must be 0 or 1, not '$WITH_HOROVOD'" >&2; exit 2 ;; esac
if [ "$WITH_HOROVOD" = 1 ]; then IMAGE=${IMAGE:-hvd-slim:horovod}; else IMAGE=${IMAGE:-hvd-slim:latest}; fi
BASE_IMAGE=${BASE_IMAGE:-debian:bookworm-slim}
# What debootstrap makes when no registry can provide the default base.
LOCAL_BASE=localhost/debian:bookworm-slim
OUT=build/image                      # logs and demo outputs (git- and docker-ignored)
mkdir -p "$OUT"

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

say() { echo "[image] $*"; }
die() { echo "[image] $*" >&2; exit 1; }
elapsed() { local s=$(( $(date +%s) - $1 )); printf '%dm%02ds' $((s / 60)) $((s % 60)); }
load() { uptime | sed 's/.*load average: /load /'; }

apt_install() {  # install Debian packages, as scripts/install.sh does for Open MPI
    command -v apt-get >/dev/null 2>&1 || return 1
    [ -z "$SUDO" ] || command -v sudo >/dev/null 2>&1 || return 1
    $SUDO apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "$@" >/dev/null
}

# --- the engine -----------------------------------------------------------------------------
docker_problem() {  # empty when docker can build, else why not
    command -v docker >/dev/null 2>&1 || { echo "no docker command"; return; }
    local err
    err=$(timeout 20 docker info 2>&1 >/dev/null) && return
    echo "the docker client is installed, yet no Docker engine answers ($(grep -m1 -v '^\s*$' <<<"$err" | sed 's/^ERROR: //'))"
}

pick_engine() {  # sets ENGINE
    if [ -n "${ENGINE:-}" ]; then
        case "$ENGINE" in docker | podman) ;; *) die "ENGINE must be docker or podman, not '$ENGINE'" ;; esac
        command -v "$ENGINE" >/dev/null 2>&1 || die "ENGINE=$ENGINE, but $ENGINE is not installed"
        if [ "$ENGINE" = docker ] && [ -n "$(docker_problem)" ]; then die "ENGINE=docker: $(docker_problem)"; fi
        return
    fi
    local why_not_docker
    why_not_docker=$(docker_problem)
    if [ -z "$why_not_docker" ]; then ENGINE=docker; return; fi
    if command -v podman >/dev/null 2>&1; then ENGINE=podman; return; fi
    if [ "${IMAGE_INSTALL_ENGINE:-1}" != 0 ]; then
        say "$why_not_docker, and podman is missing: installing podman and runc from apt"
        if apt_install podman runc && command -v podman >/dev/null 2>&1; then ENGINE=podman; return; fi
    fi
    die "no container engine: $why_not_docker, and podman is not installed. Install one of them, then run \`make image\` again: podman (Debian/Ubuntu: sudo apt-get install podman runc) or Docker Engine (https://docs.docker.com/engine/install/)"
}

setup_engine() {  # sets ENGINE_CMD (the engine with its global flags) and RUN_FLAGS
    pick_engine
    ENGINE_CMD=("$ENGINE")
    RUN_FLAGS=()
    if [ "$ENGINE" = podman ]; then
        # The flags this project's machines need (a sandbox without systemd and without
        # CAP_SYS_RESOURCE): cgroupfs, since no systemd manages cgroups; runc, the runtime tried
        # there; and open-file and process limits no higher than the caller's, because podman's
        # defaults (nofile 1048576) cannot be set without CAP_SYS_RESOURCE ("error setting rlimit").
        if command -v runc >/dev/null 2>&1; then ENGINE_CMD+=(--runtime runc); fi
        [ -d /run/systemd/system ] || ENGINE_CMD+=(--cgroup-manager cgroupfs)
        RUN_FLAGS+=(--ulimit nofile=1024:1024 --ulimit nproc=4096:4096)
    fi
}

engine() { "${ENGINE_CMD[@]}" "$@"; }
have_image() { engine image inspect "$1" >/dev/null 2>&1; }

# --- pip's settings on this machine -----------------------------------------------------------
pip_setting() {  # $1: a key such as cert; the value pip would use (environment over files)
    command -v python3 >/dev/null 2>&1 || return 0
    python3 -m pip config list 2>/dev/null | awk -v key="$1" '
        { eq = index($0, "="); name = substr($0, 1, eq - 1); value = substr($0, eq + 1)
          gsub(/^'\''|'\''$/, "", value)
          dot = match(name, /\.[^.]*$/); section = substr(name, 1, dot - 1); k = substr(name, dot + 1)
          if (k != key) next
          if (section == ":env:") env = value
          else if (section == "global" || section == "install") file = value }
        END { print (env != "" ? env : file) }'
}

# --- the base image ---------------------------------------------------------------------------
qualified() {  # what a registry calls an image name: debian:x -> docker.io/library/debian:x
    local first=${1%%/*}
    if [[ "$1" != */* ]]; then echo "docker.io/library/$1"
    elif [[ "$first" == *.* || "$first" == *:* || "$first" == localhost ]]; then echo "$1"
    else echo "docker.io/$1"; fi
}

apt_sources() {  # "URI SUITE" for each source of this machine's apt (one-line and deb822 files)
    local f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] && awk '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                             print $i, $(i + 1) }' "$f"
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] && awk 'function flush() { if (uri != "" && types ~ /(^| )deb( |$)/)
                                                  { n = split(suites, s, " "); for (j = 1; j <= n; j++) print uri, s[j] }
                                              uri = ""; suites = ""; types = "" }
                            /^[ \t]*$/ { flush(); next }
                            /^URIs:/ { uri = $2 }
                            /^Suites:/ { $1 = ""; suites = $0 }
                            /^Types:/ { $1 = ""; types = $0 }
                            END { flush() }' "$f"
    done
    return 0
}

make_local_base() {
    command -v debootstrap >/dev/null 2>&1 || {
        say "installing debootstrap from apt (to make a base image locally)"
        apt_install debootstrap || die "no registry provides $BASE_IMAGE and debootstrap is missing: install it (sudo apt-get install debootstrap), or make $BASE_IMAGE available to $ENGINE"
    }
    local sources mirror root start
    sources=$(apt_sources | awk '$1 ~ /^https?:/ && $2 ~ /^bookworm(-updates|-security)?$/' | sort -u -k2,2)
    mirror=${DEBIAN_MIRROR:-$(awk '$2 == "bookworm" { print $1; exit }' <<<"$sources")}
    mirror=${mirror:-http://deb.debian.org/debian}
    root=$(mktemp -d "${TMPDIR:-/var/tmp}/hvd-slim-base.XXXXXX")
    trap '$SUDO rm -rf "$root"' EXIT
    say "no registry provides $BASE_IMAGE: making $LOCAL_BASE with debootstrap from $mirror ($(load))"
    start=$(date +%s)
    $SUDO debootstrap --variant=minbase bookworm "$root/rootfs" "$mirror" >"$OUT/debootstrap.log" 2>&1 \
        || die "debootstrap from $mirror failed: $(tail -1 "$OUT/debootstrap.log") (log: $OUT/debootstrap.log; DEBIAN_MIRROR chooses another mirror)"
    # The suites debian:bookworm-slim has (updates, security) where this machine's apt has them too.
    { echo "deb $mirror bookworm main"
      awk '$2 != "bookworm" { print "deb", $1, $2, "main" }' <<<"$sources"; } \
        | $SUDO tee "$root/rootfs/etc/apt/sources.list" >/dev/null
    # What debootstrap downloaded is not part of an image: the Dockerfile runs apt-get update.
    $SUDO rm -rf "$root/rootfs/var/cache/apt/archives/"*.deb "$root/rootfs/var/lib/apt/lists/"*
    $SUDO tar -C "$root/rootfs" -c . | engine import --change 'CMD ["bash"]' - "$LOCAL_BASE" >/dev/null
    $SUDO rm -rf "$root"
    trap - EXIT
    say "made $LOCAL_BASE in $(elapsed "$start")"
}

pick_base() {  # sets BASE: the image the build starts from
    if have_image "$BASE_IMAGE"; then
        # The name the engine resolved it to (podman also finds localhost/NAME for a short NAME).
        BASE=$(engine image inspect --format '{{index .RepoTags 0}}' "$BASE_IMAGE" 2>/dev/null || true)
        BASE=${BASE:-$BASE_IMAGE}
        return
    fi
    if [ "$BASE_IMAGE" = debian:bookworm-slim ] && have_image "$LOCAL_BASE"; then BASE=$LOCAL_BASE; return; fi
    local name
    name=$(qualified "$BASE_IMAGE")
    say "pulling $name"
    if timeout 300 "${ENGINE_CMD[@]}" pull -q "$name" >"$OUT/pull.log" 2>&1; then BASE=$name; return; fi
    say "cannot pull $name: $(grep -m1 -iE 'error|denied|timeout' "$OUT/pull.log" || tail -1 "$OUT/pull.log")"
    [ "$BASE_IMAGE" = debian:bookworm-slim ] \
        || die "no registry provides $BASE_IMAGE; pull or load it into $ENGINE, or leave BASE_IMAGE unset to build on Debian made locally"
    make_local_base
    BASE=$LOCAL_BASE
}

# --- build ----------------------------------------------------------------------------------
build() {
    pick_base
    local args=(build -t "$IMAGE" --build-arg "BASE_IMAGE=$BASE" --build-arg "WITH_HOROVOD=$WITH_HOROVOD")
    if [ "$ENGINE" = podman ]; then
        # --network host: the build reaches the package indexes exactly as this machine does (its
        # resolver, its proxy), and podman sets up no bridge or NAT rules on the host for it.
        # --format docker: podman's default OCI format has no SHELL, and the Dockerfile's bash
        # with pipefail would silently become /bin/sh.
        args+=(--network host --format docker "${RUN_FLAGS[@]}")
    fi

    # pip's wheel directories and CA bundle, when this machine's pip has them: podman mounts them
    # read-only for the build; docker build cannot mount anything of the host.
    local cert links entry links_in=() mounted=()
    cert=$(pip_setting cert)
    links=$(pip_setting find-links)
    for entry in $links; do
        entry=${entry#file://}
        if [[ "$entry" == http://* || "$entry" == https://* ]]; then
            links_in+=("$entry")
        elif [ -d "$entry" ]; then
            mounted+=("$entry")
            [ "$ENGINE" = podman ] || continue
            args+=(--volume "$entry:/mnt/hvd-slim-pip/find-links-${#mounted[@]}:ro")
            links_in+=("/mnt/hvd-slim-pip/find-links-${#mounted[@]}")
        fi
    done
    if [ -n "$cert" ] && [ -f "$cert" ]; then
        mounted+=("$cert")
        if [ "$ENGINE" = podman ]; then
            # A path of its own: mounted over the image's /etc/ssl/certs/ca-certificates.crt it
            # would break the ca-certificates package's post-install step, which rewrites it.
            args+=(--volume "$cert:/mnt/hvd-slim-pip/ca.crt:ro" --build-arg PIP_CERT=/mnt/hvd-slim-pip/ca.crt)
        fi
    fi
    [ ${#links_in[@]} -eq 0 ] || args+=(--build-arg "PIP_FIND_LINKS=${links_in[*]}")
    if [ ${#mounted[@]} -gt 0 ]; then
        if [ "$ENGINE" = podman ]; then
            say "from pip's configuration, mounted read-only into the build: ${mounted[*]}"
        else
            say "docker build cannot mount files of this machine: pip's ${mounted[*]} stay outside and the build uses the indexes alone (ENGINE=podman mounts them)"
        fi
    fi

    # The Dockerfile's CPU torch index, unless it does not answer from here (then torch comes
    # from PyPI or pip's find-links, as in `make install` on this machine).
    if [ -z "${TORCH_INDEX_URL+set}" ] && command -v python3 >/dev/null 2>&1; then
        local torch_index
        torch_index=$(sed -n 's/^ARG TORCH_INDEX_URL=//p' Dockerfile)
        if ! PIP_INDEX_URL=$torch_index PIP_EXTRA_INDEX_URL='' PIP_CERT=$cert bash scripts/check_index.sh pip 2>/dev/null; then
            say "the torch index $torch_index does not answer from here: torch comes from PyPI and pip's find-links (TORCH_INDEX_URL=URL chooses an index)"
            TORCH_INDEX_URL=
        fi
    fi
    [ -z "${TORCH_INDEX_URL+set}" ] || args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
    # shellcheck disable=SC2206  # IMAGE_BUILD_FLAGS is a list of flags, e.g. "--no-cache"
    args+=(${IMAGE_BUILD_FLAGS:-})

    local log=$OUT/build-${IMAGE//[:\/]/_}.log start rc
    say "building $IMAGE with $ENGINE from $BASE, WITH_HOROVOD=$WITH_HOROVOD ($(nproc) cores, $(load)); log: $log"
    say "$(printf '%q ' "${ENGINE_CMD[@]}" "${args[@]}") ."
    start=$(date +%s)
    set +e
    engine "${args[@]}" . 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" -ne 0 ]; then
        # check_index.sh's one line says what was unreachable; repeat it after the engine's own.
        local why
        why=$(grep -m1 '^image build: ' "$log" || true)
        die "building $IMAGE failed${why:+: ${why#image build: }} (full log: $log)"
    fi
    say "built $IMAGE in $(elapsed "$start") ($(load))"
}

# --- run and test -----------------------------------------------------------------------------
need_image() {
    have_image "$IMAGE" || die "no image $IMAGE in $ENGINE: build it first with \`make image WITH_HOROVOD=$WITH_HOROVOD\`"
}

run_offline() {  # the image's command line, with no network at all: nothing may download
    # shellcheck disable=SC2086  # IMAGE_RUN_FLAGS is a list of flags
    engine run --rm --network none "${RUN_FLAGS[@]}" ${IMAGE_RUN_FLAGS:-} "$@"
}

step() {  # NAME LOG RUN-ARGS...: one offline run in the image, timed, its output kept in LOG
    local name=$1 log=$2 start rc
    shift 2
    say "$name: $ENGINE run --rm --network none $*"
    start=$(date +%s)
    set +e
    run_offline "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    SUMMARY+=("$name: $([ "$rc" -eq 0 ] && echo passed || echo "FAILED (exit $rc)") in $(elapsed "$start")")
    [ "$rc" -eq 0 ] || FAILED+=("$name")
}

test_image() {
    need_image
    SUMMARY=() FAILED=()
    say "testing $IMAGE offline with $ENGINE ($(nproc) cores, $(load))"
    step demo "$OUT/demo-image.txt" "$IMAGE" make demo
    step "unit tier" "$OUT/test-unit-image.txt" "$IMAGE" make test-unit
    if [ "$WITH_HOROVOD" = 1 ]; then
        # A Horovod tier that would skip is a failure here, as in CI.
        step "Horovod tier" "$OUT/test-horovod-image.txt" --env HVD_SLIM_REQUIRE_HOROVOD=1 "$IMAGE" make test-horovod
    fi
    say "summary for $IMAGE ($ENGINE, $(load)):"
    printf '[image]   %s\n' "${SUMMARY[@]}"
    if [ -f "$OUT/demo-host.txt" ]; then
        python3 scripts/compare_demo.py "$OUT/demo-host.txt" "$OUT/demo-image.txt" || FAILED+=("demo figures")
    else
        say "to compare the demo's figures with this machine's: make image-compare"
    fi
    [ ${#FAILED[@]} -eq 0 ] || die "failed in the image: ${FAILED[*]}"
}

compare() {
    [ -f "$OUT/demo-image.txt" ] || die "no demo output of the image yet ($OUT/demo-image.txt): run \`make image-test\` first"
    local start
    start=$(date +%s)
    say "make demo on this machine ($(nproc) cores, $(load)), for $OUT/demo-host.txt"
    make --no-print-directory demo 2>&1 | tee "$OUT/demo-host.txt"
    say "host demo ran in $(elapsed "$start")"
    python3 scripts/compare_demo.py "$OUT/demo-host.txt" "$OUT/demo-image.txt"
}

case "${1:-}" in
build) setup_engine; build ;;
test) setup_engine; test_image ;;
compare) compare ;;
run) shift; setup_engine; need_image; run_offline "$IMAGE" "$@" ;;
*) sed -n '2,19p' "$0" >&2; exit 2 ;;
esac
