#!/usr/bin/env bash
# Installs the Debian packages named as arguments that are not installed yet (with
# sudo when not root); does nothing, and needs no network, when all are there.
set -euo pipefail

need_apt=()
for pkg in "$@"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
