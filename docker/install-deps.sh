#!/bin/sh
# Create /opt/venv and install searchr1's dependencies (not the package itself), so that editing
# source code does not invalidate this cached layer. Shared by every Dockerfile.
#
# torch: a base image that already has it (PyTorch CUDA, SGLang) keeps its own build: the venv
# sees the base's packages (--system-site-packages) and torch is pinned to that version, so pip
# never pulls a second multi-GB torch. On a plain Python base, torch comes from TORCH_INDEX (the
# CPU wheels by default), pinned by constraints.txt.
set -eu
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

# Debian/Ubuntu system Pythons (e.g. in the SGLang image) may lack ensurepip: fall back to virtualenv.
python3 -m venv --system-site-packages /opt/venv 2>/dev/null || {
    rm -rf /opt/venv
    # PEP 668 system Pythons refuse plain installs; older pips ignore this variable.
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir virtualenv
    python3 -m virtualenv --system-site-packages /opt/venv
}
PIP="/opt/venv/bin/pip --disable-pip-version-check --no-input"
if /opt/venv/bin/python -c "import torch" 2>/dev/null; then
    /opt/venv/bin/python -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' \
        > /tmp/pins.txt
else
    cp /src/constraints.txt /tmp/pins.txt
    $PIP install -c /tmp/pins.txt --index-url "$TORCH_INDEX" torch
fi
/opt/venv/bin/python /src/docker/requirements.py /src/pyproject.toml > /tmp/requirements.txt
$PIP install -c /tmp/pins.txt -r /tmp/requirements.txt
