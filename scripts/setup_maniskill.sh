#!/usr/bin/env bash
# Sets up ManiSkill 3 (the `maniskill` extra) on a CPU-only Debian 12 machine; quick when done.
#
# SAPIEN builds every scene with render materials, even for state observations, so it needs
# a Vulkan device; without a GPU that is Mesa's lavapipe, and Debian 12's Mesa 22 is too old
# for SAPIEN 3. bookworm-backports has Mesa 25, which works.
#
# Usage: scripts/setup_maniskill.sh [PYTHON]   (default: .venv/bin/python; apt steps need root)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}

fail() {
    echo "setup_maniskill: $*" >&2
    exit 1
}

vulkan_works() {
    "$PY" -c 'import sapien; sapien.render.RenderSystem(sapien.Device("cpu"))' >/dev/null 2>&1
}

if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("mani_skill") is None)'; then
    "$PY" -m pip install -q -e ".[maniskill]" || fail "pip could not install the maniskill extra"
fi
vulkan_works && exit 0

# No working software Vulkan yet: Mesa's lavapipe from bookworm-backports.
. /etc/os-release
if [ "${VERSION_CODENAME:-}" != bookworm ] || ! command -v apt-get >/dev/null; then
    fail "SAPIEN finds no Vulkan device, and this is not Debian 12 (apt): install Mesa >= 23's" \
         "lavapipe (mesa-vulkan-drivers) or a GPU Vulkan driver yourself"
fi
SUDO=
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || fail "installing mesa-vulkan-drivers needs root (or sudo)"
    SUDO="sudo -n"
fi
if ! grep -rqsE '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "setup_maniskill: adding bookworm-backports to the apt sources"
    $SUDO tee /etc/apt/sources.list.d/bookworm-backports.sources >/dev/null <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
fi
echo "setup_maniskill: installing mesa-vulkan-drivers from bookworm-backports"
APT="$SUDO env DEBIAN_FRONTEND=noninteractive apt-get"
$APT update -qq \
    || fail "apt-get update failed (network, or the bookworm-backports source); see the messages above"
$APT install -y -qq --no-install-recommends --no-remove -t bookworm-backports mesa-vulkan-drivers >/dev/null \
    || fail "apt-get could not install mesa-vulkan-drivers from bookworm-backports; see the messages above"
vulkan_works || fail "mesa-vulkan-drivers $(dpkg-query -W -f='${Version}' mesa-vulkan-drivers) is" \
    "installed but SAPIEN still finds no Vulkan device: $("$PY" -c 'import sapien; sapien.render.RenderSystem(sapien.Device("cpu"))' 2>&1 | tail -1)"
echo "setup_maniskill: ManiSkill is ready (software Vulkan: Mesa lavapipe)"
