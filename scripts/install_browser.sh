#!/usr/bin/env bash
# The headless browser of the page's test (tests/serve/test_view_browser.py): Debian's chromium and
# chromium-driver, from apt. Nothing is downloaded by Selenium or Playwright (they would fetch a
# browser from the internet; the test points Selenium at these two binaries).
#  - both present: returns at once (no apt call);
#  - missing, as root: `apt-get update` once, then `apt-get install -y chromium chromium-driver`;
#  - missing, not root: one line saying what to run, exit 1 (the test then fails; it never skips).
# `make test` runs this before pytest.
set -euo pipefail
BROWSER=/usr/bin/chromium
DRIVER=/usr/bin/chromedriver

if [ -x "$BROWSER" ] && [ -x "$DRIVER" ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install_browser: $BROWSER or $DRIVER is missing; as root run: apt-get update && apt-get install -y chromium chromium-driver" >&2
  exit 1
fi
echo "install_browser: installing chromium and chromium-driver with apt"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q chromium chromium-driver
if [ ! -x "$BROWSER" ] || [ ! -x "$DRIVER" ]; then
  echo "install_browser: apt finished but $BROWSER or $DRIVER is still missing" >&2
  exit 1
fi
