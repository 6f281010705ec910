#!/usr/bin/env bash
# The prepared device run (make bench-device): CUDA qualification tests and the `device` profile of the
# benchmarks on one NVIDIA GPU, within 8 minutes, writing results/<label>/device/ (see book/gpu_support.md).
#
#   bash tools/bench_device.sh                                  # on the GPU machine
#   bash tools/bench_device.sh --device cpu --profile smoke --results /tmp/r   # the CPU dry run
#
# Arguments go to `python -m msrm_lab.device` unchanged. Environment:
#   PYTHON               the interpreter (default python3)
#   MSRM_DEVICE_WHEELS   the carried wheel folder (default .device-wheels, filled here by
#                        `python -m msrm_lab.device --fetch-wheels`)
#   MSRM_DEVICE_SITE     where those wheels are installed (default /tmp/msrm-device-site; put on PYTHONPATH)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PY=${PYTHON:-python3}
WHEELS=${MSRM_DEVICE_WHEELS:-.device-wheels}
SITE=${MSRM_DEVICE_SITE:-/tmp/msrm-device-site}

# the wheels the image lacks (tools/device-wheels.txt), installed with one command when ArviZ is missing;
# --target keeps the image's own environment as it is, --no-deps because everything they need is in the image
if ! "$PY" -c "import arviz" >/dev/null 2>&1; then
  if [ -d "$WHEELS" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --find-links "$WHEELS" --target "$SITE" \
      -r tools/device-wheels.txt || { echo "bench_device: installing the wheels from $WHEELS failed" >&2; exit 3; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "bench_device: ArviZ is missing and no wheel folder $WHEELS is here; the nuts part will fail" >&2
  fi
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
exec "$PY" -m msrm_lab.device "$@"
