#!/usr/bin/env bash
# Sets up Meta-World (the `metaworld` extra) beside the main environment; quick when done.
#
# metaworld 3.1 pins mujoco 3.3.0, where gymnasium's MuJoCo envs here run on mujoco 4, and its
# envs fail on mujoco 4 (their mocap welds have a different size). So it gets a venv of its
# own that reuses every other package of the main one: the overlay's site-packages come first
# on sys.path (its mujoco 3.3.0, metaworld), the main venv's after them (torch, ray, m2flow).
#
# Usage: scripts/setup_metaworld.sh [BASE_VENV] [OVERLAY_VENV]   (default: .venv .venv-metaworld)
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:-.venv}
OVERLAY=${2:-.venv-metaworld}

[ -x "$BASE/bin/python" ] || { echo "setup_metaworld: no $BASE: run make setup first" >&2; exit 1; }
site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
[ -x "$OVERLAY/bin/python" ] || "$BASE/bin/python" -m venv --without-pip "$OVERLAY"
# addsitedir (not a bare path) so that the base's own .pth files, the editable m2flow among
# them, are processed too.
echo "import site; site.addsitedir('$(site_of "$BASE")')" > "$(site_of "$OVERLAY")/_m2flow_base.pth"
if ! "$OVERLAY/bin/python" -c 'import metaworld' 2>/dev/null; then
    # The base's pip, installing into the overlay: only what the base lacks (mujoco 3.3.0).
    "$OVERLAY/bin/python" -m pip install -q -e ".[metaworld]" \
        || { echo "setup_metaworld: pip could not install the metaworld extra" >&2; exit 1; }
fi
"$OVERLAY/bin/python" -c 'import metaworld, mujoco; print(f"setup_metaworld: metaworld ready, mujoco {mujoco.__version__}")'
