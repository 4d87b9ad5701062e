#!/usr/bin/env bash
# Install Debian's chromium for the real-browser notebook test (tests/notebooks/test_browser.py).
# Playwright cannot download its own browser on this kind of machine, so the test drives
# /usr/bin/chromium through `executable_path`. Idempotent: does nothing when chromium is present.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
    echo "chromium already installed: $(/usr/bin/chromium --version 2>/dev/null || true)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
echo "installed: $(/usr/bin/chromium --version 2>/dev/null || true)"
