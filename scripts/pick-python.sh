#!/bin/sh
# Prints the Python interpreter `make` builds .venv with (the Makefile's PYTHON; set PYTHON
# to choose another).
#
# The distribution's /usr/bin/python3 comes first when it is Python >= 3.11 and can make a
# venv: distributions (Debian, Ubuntu, Fedora) build CPython with profile-guided
# optimisation and LTO, which version managers such as pyenv leave out unless asked. The
# gateway is Python on its hot path: on Debian's 3.11 it spent 15-20% less CPU per request
# than on pyenv's default 3.11 (bench/README.md, "The interpreter"). Otherwise the
# python3 on PATH; its version is checked by the Makefile, which says what to do.
set -eu
usable() {
    "$1" -c 'import sys, ensurepip, venv; sys.exit(0 if sys.version_info >= (3, 11) else 1)' >/dev/null 2>&1
}
if [ -x /usr/bin/python3 ] && usable /usr/bin/python3; then
    echo /usr/bin/python3
else
    echo python3
fi
