#!/usr/bin/env bash
# Set up megascope in ./.venv on a fresh machine, sized to what the command needs.
#   bash scripts/setup.sh                  torch (CPU wheel) + megascope: the demo and every command
#   bash scripts/setup.sh --test           also the test and dev tools (pytest, ruff, HTA, the
#                                          frameworks the examples attach to, Dask)
#   bash scripts/setup.sh --test --browser also Debian's headless Chromium (the live tier's
#                                          browser tests)
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
want_browser=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    --browser) want_browser=1 ;;
    *) echo "setup.sh: unknown option $arg (expected --test, --browser)" >&2; exit 2 ;;
  esac
done

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
py=.venv/bin/python
$py -m pip install -q --upgrade pip
# torch first, pinned, so that nothing later pulls a CUDA build.
if ! $py -c "import torch" 2>/dev/null; then
  $py -m pip install -q "torch==2.13.0"
fi
if [ "$want_test" = 1 ]; then
  $py -m pip install -q -e ".[dev]"
else
  $py -m pip install -q -e .
fi

if [ "$want_browser" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  sudo_=""
  [ "$(id -u)" = 0 ] || sudo_="sudo"
  $sudo_ apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -q chromium chromium-driver >/dev/null
fi
echo "megascope is set up in .venv ($($py -c 'import torch; print("torch", torch.__version__)'))"
