#!/bin/sh
# Install every package copied under /app (libs/*, services/*) editable into /opt/venv.
#
# Run inside an image build stage (see deploy/docker/Dockerfile). Editable installs put a .pth
# pointing at /app/<pkg>/src into the venv, so Tilt can live-sync source files into a running
# container. All local packages go in one pip call: their slipstream-* dependencies resolve to
# each other and never to an index. The constraints file pins torch and nats-py like `make install`.
set -eu
set --
for dir in /app/libs/*/ /app/services/*/; do
    if [ -f "${dir}pyproject.toml" ]; then
        set -- "$@" -e "$dir"
    fi
done
if [ "$#" -eq 0 ]; then
    echo "install-app.sh: no package (pyproject.toml) under /app/libs or /app/services" >&2
    exit 1
fi
pip install -c /opt/slipstream/constraints.txt "$@"
