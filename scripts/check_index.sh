#!/usr/bin/env bash
# Run inside the image build (Dockerfile): make sure a package index answers before the steps
# that need it, so a build without network fails with one line that says what is unreachable
# instead of a page of apt warnings or pip retries.
#
#   check_index.sh apt   apt-get update; fail when any configured Debian source did not answer
#   check_index.sh pip   every index pip will ask (PIP_INDEX_URL or PyPI, PIP_EXTRA_INDEX_URL)
#                        answers over HTTPS, with PIP_CERT as the CA bundle when it is set
#
# The failure line starts with "image build:" so that scripts/image.sh can repeat it at the end.
set -euo pipefail

case "${1:-}" in
apt)
    # `apt-get update` exits 0 when sources fail to download ("W: Failed to fetch"), and the
    # install after it then reports missing packages: look at what it printed instead.
    if log=$(apt-get update -q 2>&1) && ! grep -qE '^(W|E): (Failed to fetch|Some index files)' <<<"$log"; then
        exit 0
    fi
    # apt names the source on an "Err:1 http://deb.debian.org/debian bookworm InRelease" line
    # and the reason on the next ("  Temporary failure resolving 'deb.debian.org'").
    why=$(awk '/^Err:/ { getline reason; sub(/^[ \t]+/, "", reason); print $2 " (" reason ")"; exit }' <<<"$log")
    [ -n "$why" ] || why="($(grep -m1 -E '^(E|W):' <<<"$log" || echo "apt-get update failed"))"
    echo "image build: cannot reach the Debian package mirror $why: the build installs Python, make and Open MPI from it; give the build network access, or a reachable mirror in the base image's apt sources" >&2
    exit 1
    ;;
pip)
    exec python3 - <<'PY'
import os
import ssl
import sys
import urllib.error
import urllib.request

if os.environ.get("PIP_NO_INDEX"):
    sys.exit(0)  # wheels come from PIP_FIND_LINKS only: nothing to reach
cafile = os.environ.get("PIP_CERT") or None
try:
    context = ssl.create_default_context(cafile=cafile)
except (OSError, ssl.SSLError) as exc:
    print(f"image build: the CA bundle {cafile} (PIP_CERT) cannot be read ({exc}): mount it "
          "readable into the build, or leave PIP_CERT unset", file=sys.stderr)
    sys.exit(1)
main = os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
extra = os.environ.get("PIP_EXTRA_INDEX_URL", "").split()  # the Dockerfile's TORCH_INDEX_URL
for url in [main] + extra:
    probe = url.rstrip("/") + "/pip/"  # a small page, where the index root can be megabytes
    if not probe.startswith(("http://", "https://")):
        continue  # file:// and the like: pip reports those itself
    try:
        with urllib.request.urlopen(probe, timeout=30, context=context) as reply:
            reply.read(1)
    except urllib.error.HTTPError:
        continue  # the index answered (an index without pip says 404): reachable is all we check
    except (urllib.error.URLError, OSError) as exc:
        reason = str(getattr(exc, "reason", exc))
    else:
        continue
    if "CERTIFICATE" not in reason.upper() and url != main:
        hint = ("give the build network access, or build with another TORCH_INDEX_URL "
                "(empty: torch from PyPI and pip's find-links)")
    elif "CERTIFICATE" not in reason.upper():
        hint = "give the build network access, or set PIP_INDEX_URL to a reachable index"
    elif cafile:
        hint = f"the CA bundle {cafile} (PIP_CERT) does not verify it"
    else:  # a TLS-inspecting proxy: its CA is in the host's bundle, not in the image's
        hint = "pass the CA bundle that verifies it (pip's `cert`, mounted by scripts/image.sh)"
    print(f"image build: cannot reach the Python package index {url} ({reason}): the build "
          f"installs torch, mpi4py and hvd_slim's dependencies from it; {hint}", file=sys.stderr)
    sys.exit(1)
PY
    ;;
*)
    echo "usage: $0 apt|pip" >&2
    exit 2
    ;;
esac
