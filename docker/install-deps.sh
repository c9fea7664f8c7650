#!/bin/sh
# Create /opt/venv and install searchr1's dependencies (not the package itself), so that editing
# source code does not invalidate this cached layer. Shared by every Dockerfile.
#   sh install-deps.sh          the venv with the dependencies
#   sh install-deps.sh wheel    the searchr1 wheel of /src into /wheels (same pip settings)
#   sh install-deps.sh extras NAMES
#                               pyproject extras (comma-separated; "" = none) as wheels in
#                               /extras: what installing them into this venv added (its own
#                               dependencies are mostly there already), for one image to install
#                               with --no-deps in a small layer above the shared venv
#
# torch: a base image that already has it (PyTorch CUDA, SGLang) keeps its own build: the venv
# sees the base's packages (--system-site-packages) and torch is pinned to that version, so pip
# never pulls a second multi-GB torch. On a plain Python base, torch comes from TORCH_INDEX (the
# CPU wheels by default) and no CUDA wheel may follow it.
#
# The lock: on a plain CPython 3.11 x86_64 (glibc) base (the CPU images' python:3.11-slim-bookworm)
# every package comes from /src/requirements.lock, hash-checked (--require-hashes): torch's entry
# (the CPU build) from TORCH_INDEX, then the entries the runtime dependencies need (the `dev`
# extra's tools are left out). Bases with their own torch (GPU) are not locked: their torch, CUDA
# stack and (SGLang's) pinned packages differ from the lock's, and no lock was resolved or tested
# against them; they install pyproject.toml's ranges against the base's torch as before. So does
# a plain base of another Python or architecture (the lock holds only x86_64 CPython 3.11 wheels).
#
# Optional build inputs (empty = pip's defaults): PIP_INDEX_URL, PIP_EXTRA_INDEX_URL,
# PIP_TRUSTED_HOST (pip reads them from the environment), and CA certificates in
# /usr/local/share/ca-certificates (copied from docker/ca-certificates/ by the Dockerfiles).
set -eu
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
# An empty PIP_* variable is not "unset" to pip (PIP_INDEX_URL="" is an empty index URL).
for name in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST; do
    eval "[ -n \"\${$name:-}\" ] || unset $name"
done
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    update-ca-certificates >/dev/null
fi
# pip's own certifi bundle lacks locally added CAs: use the system bundle when there is one.
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    export PIP_CERT=/etc/ssl/certs/ca-certificates.crt
fi
if [ "${1:-}" = wheel ]; then
    exec /opt/venv/bin/pip --disable-pip-version-check --no-input wheel --no-deps -w /wheels /src
fi
if [ "${1:-}" = extras ]; then
    mkdir -p /extras
    REQS="/opt/venv/bin/python /src/docker/requirements.py"
    LOCKED="" HASHES=""  # the deps stage installed from the lock: so do the extras, hashed
    if [ -f /tmp/searchr1-locked ]; then
        LOCKED="--locked /src/requirements.lock" HASHES="--require-hashes"
    fi
    $REQS /src/pyproject.toml --extras "${2:-}" $LOCKED > /tmp/extras.txt
    grep -q . /tmp/extras.txt || exit 0
    PIP="/opt/venv/bin/pip --disable-pip-version-check --no-input"
    # Resolved against the venv (torch stays the pinned one); the report names what was added.
    $PIP install $HASHES -c /tmp/pins.txt --report /tmp/extras.json -r /tmp/extras.txt
    $REQS --installed /tmp/extras.json $LOCKED > /tmp/extras-installed.txt
    grep -q . /tmp/extras-installed.txt || exit 0  # the base image had them all
    exec $PIP wheel --no-deps $HASHES -c /tmp/pins.txt -w /extras -r /tmp/extras-installed.txt
fi

# Debian/Ubuntu system Pythons (e.g. in the SGLang image) may lack ensurepip: fall back to virtualenv.
python3 -m venv --system-site-packages /opt/venv 2>/dev/null || {
    rm -rf /opt/venv
    # PEP 668 system Pythons refuse plain installs; older pips ignore this variable.
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir virtualenv
    python3 -m virtualenv --system-site-packages /opt/venv
}
PIP="/opt/venv/bin/pip --disable-pip-version-check --no-input"
REQS="/opt/venv/bin/python /src/docker/requirements.py"
LOCK=/src/requirements.lock
cpu_torch=0
if /opt/venv/bin/python -c "import torch" 2>/dev/null; then
    /opt/venv/bin/python -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' \
        > /tmp/pins.txt
    echo "install-deps.sh: the base image has torch: pyproject.toml's ranges, not $LOCK"
    $REQS /src/pyproject.toml > /tmp/requirements.txt
    $PIP install -c /tmp/pins.txt -r /tmp/requirements.txt
elif [ -f "$LOCK" ] && /opt/venv/bin/python -c '
import platform, sys
libc, version = platform.libc_ver()
sys.exit(not (sys.version_info[:2] == (3, 11) and platform.machine() == "x86_64"
              and libc == "glibc" and tuple(map(int, version.split(".")[:2])) >= (2, 28)))'; then
    cpu_torch=1
    echo "install-deps.sh: installing from $LOCK (--require-hashes)"
    touch /tmp/searchr1-locked
    grep '^torch==' "$LOCK" | cut -d' ' -f1 > /tmp/pins.txt
    # torch's entry alone first, from TORCH_INDEX (--no-deps: it may serve torch alone); then
    # the runtime dependencies' entries (torch's dependencies among them), every file hashed.
    $REQS --names torch --locked "$LOCK" > /tmp/torch.txt
    $PIP install --require-hashes --no-deps --index-url "$TORCH_INDEX" -r /tmp/torch.txt
    $REQS /src/pyproject.toml --locked "$LOCK" > /tmp/requirements.txt
    $PIP install --require-hashes -r /tmp/requirements.txt
else
    cpu_torch=1
    echo "install-deps.sh: $LOCK is for CPython 3.11 on x86_64 (glibc): pyproject.toml's ranges"
    cp /src/constraints.txt /tmp/pins.txt
    # --no-deps: TORCH_INDEX may serve torch alone (a local mirror); its dependencies come from
    # the package index in the next step, which sees torch installed and resolves them.
    $PIP install -c /tmp/pins.txt --no-deps --index-url "$TORCH_INDEX" torch
    $REQS /src/pyproject.toml > /tmp/requirements.txt
    $PIP install -c /tmp/pins.txt -r /tmp/requirements.txt
fi

if [ "$cpu_torch" = 1 ]; then
    if $PIP list --format=freeze | grep -i '^nvidia-\|^triton=='; then
        echo "install-deps.sh: CUDA wheels above were installed into a CPU image" >&2
        exit 1
    fi
    # What a CPU runtime never loads: C++ headers, torch's test binaries, and every package's
    # own test suite (about 310 MB). torch_shm_manager stays (tensor sharing between processes).
    site=$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -rf "$site/torch/include" "$site/torch/test"
    find "$site/torch/bin" -mindepth 1 ! -name torch_shm_manager -exec rm -rf {} +
    find "$site" -depth -type d -name tests -exec rm -rf {} +
fi
