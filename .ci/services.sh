#!/usr/bin/env bash
# Installs the external services the global-tier tests run for real:
# redis-server (Debian package) and the Mooncake master + store client
# (PyPI wheel mooncake-transfer-engine-non-cuda, whose native code links
# against libibverbs/librdmacm/libnuma even when only TCP is used).
# Idempotent: re-running skips what is already present.
set -euo pipefail

MOONCAKE_WHEEL="mooncake-transfer-engine-non-cuda==0.3.13.post1"
APT_PACKAGES=(redis-server libibverbs1 librdmacm1 libnuma1)
PYTHON="${PYTHON:-python3}"

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

# Outputs are captured before they are tested: `cmd | grep -q` under pipefail fails whenever grep
# exits at its first match while cmd still writes (SIGPIPE), which made a present package look absent.
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
    if [[ "$status" != *"install ok installed"* ]]; then
        missing+=("$pkg")
    fi
done
if [ "${#missing[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends "${missing[@]}"
fi

# The Debian package starts a system redis on :6379 where an init system runs;
# tests start their own servers on free ports, so that one is not needed.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || true
fi

mooncake_version() {
    "$PYTHON" -m pip show mooncake-transfer-engine-non-cuda 2>/dev/null | sed -n 's/^Version: //p' || true
}
if [[ "$(mooncake_version)" != "0.3.13.post1" ]]; then
    "$PYTHON" -m pip install "$MOONCAKE_WHEEL"
fi

command -v redis-server >/dev/null
"$PYTHON" -c "import mooncake.store"
echo "services ready: $(redis-server --version | cut -d' ' -f1-3), mooncake $(mooncake_version)"
