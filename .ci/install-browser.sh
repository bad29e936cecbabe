#!/usr/bin/env bash
# Installs the headless browser of the admin page's test (tests/gateway/test_admin_page.py):
# Debian's chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver), which
# Selenium drives without downloading anything. Never fails the run: without a browser that
# test skips, saying why.
set -uo pipefail

if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  echo "install-browser: $(chromium --version 2>/dev/null | head -1) is installed"
  exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo="sudo -n"; else
    echo "install-browser: not root and no sudo: the admin page's browser test will skip" >&2
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null; then
  echo "install-browser: no apt-get: the admin page's browser test will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if $sudo apt-get update -qq >/dev/null &&
  $sudo apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; then
  echo "install-browser: $(chromium --version 2>/dev/null | head -1) installed"
else
  echo "install-browser: apt-get could not install chromium: the browser test will skip" >&2
fi
exit 0
