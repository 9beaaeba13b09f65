#!/usr/bin/env bash
# Debian packages the test suite drives for real: headless Chromium (the UI test screenshots the asset
# graph). Installed with apt-get as root (or through sudo); a no-op where they are already present.
set -euo pipefail
packages=(chromium redis-server postgresql)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system-packages: no apt-get here; install ${missing[*]} by hand" >&2
  exit 1
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "system-packages: installed ${missing[*]}"
