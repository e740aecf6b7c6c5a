#!/usr/bin/env bash
# Debian packages the tests and the fast crypto path need: nginx (HTTP server for tests),
# libsodium23 (XSalsa20-Poly1305, as tensorizer uses) and headless Chromium with its
# WebDriver (the console tests, tests/console). Installs only what is missing.
set -euo pipefail
need=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx)
ldconfig -p 2>/dev/null | grep -q 'libsodium.so.23' || need+=(libsodium23)
[ -x /usr/bin/chromium ] || need+=(chromium)
[ -x /usr/bin/chromedriver ] || need+=(chromium-driver)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "missing system packages: ${need[*]}; run: sudo apt-get install -y ${need[*]}" >&2
        exit 1
    fi
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi
