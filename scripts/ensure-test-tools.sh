#!/usr/bin/env bash
# Install the operator tools llmgw's tests check their output against, when this machine can.
#
# Tests run a real tool where users have one (keepalived checks the configuration `llmgw server join
# --keepalived-config` writes; nft applies llmgw's firewall table in a network namespace). A test skips a
# tool only where the machine truly cannot have it, and says why; this script is what gives a machine the
# tool when it can: as root with apt-get, it installs each missing Debian package. Without root or apt-get
# it says which tools are missing and exits 0, so the test run goes on and the tests that need them skip
# with their reason. Progress goes to stderr.
#
# Environment:
#   LLMGW_NO_TOOL_INSTALL=1   install nothing (report only)
set -euo pipefail

log() { echo "ensure-test-tools: $*" >&2; }

# command -> Debian package providing it
declare -A PACKAGES=(
    [keepalived]=keepalived
    [nft]=nftables
)

missing=()
for tool in "${!PACKAGES[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("${PACKAGES[$tool]}")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi
if [[ "${LLMGW_NO_TOOL_INSTALL:-0}" == 1 ]]; then
    log "not installing ${missing[*]} (LLMGW_NO_TOOL_INSTALL=1): the tests that need them skip"
    exit 0
fi
if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    log "${missing[*]} missing and this is not root with apt-get: install them to run the tests that need them"
    exit 0
fi
log "installing ${missing[*]} with apt-get"
export DEBIAN_FRONTEND=noninteractive
# Installing must not start services on a test machine: a package's own unit would listen and take
# addresses the tests use. policy-rc.d 101 tells Debian's maintainer scripts not to start anything.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e "$policy" ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && created_policy=1
fi
trap 'if [[ $created_policy == 1 ]]; then rm -f "$policy"; fi' EXIT
if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2; then
    apt-get update -qq >&2 || true
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
        || log "could not install ${missing[*]}: the tests that need them skip"
fi
