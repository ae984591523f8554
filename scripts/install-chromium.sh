#!/usr/bin/env bash
# The report test opens scaletrain's HTML report in headless Chromium (Debian's chromium and
# chromium-driver). Install them when missing and we are root; otherwise say how, and the
# test skips with that reason.
set -u
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing chromium and chromium-driver for the report test"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null \
        || echo "could not install chromium; the report's browser test will be skipped"
else
    echo "chromium/chromedriver missing: sudo apt-get install chromium chromium-driver (the report's browser test skips without them)"
fi
exit 0
