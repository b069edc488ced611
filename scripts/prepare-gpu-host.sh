#!/usr/bin/env bash
# Gather what `make gpu-check` needs on a GPU host without network into .gpu-check/:
# the redis-server binary with its libraries, and CPython 3.12 wheels for the packages the
# check imports that such a host lacks. Run it on a machine with network, before the
# working tree travels. Nothing under .gpu-check/ is tracked by git.
#
#   GPU_HOST_SRC=DIR           a prepared gpu-host folder (redis/ and wheels-py312/);
#                              default: shared/gpu-host next to or above the checkout
#   GPU_CHECK_NVIMGCODEC=...   nvImageCodec + nvJPEG for GPU decode (about 29 MB): by
#                              default the gpu-host folder's nvimgcodec-cu13-py312/ wheels
#                              where it has them; cu12 or cu13 downloads them instead;
#                              none carries none (the check then decodes on the CPU)
#   PIP=...                    the pip to download with (default: python3 -m pip)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST="$ROOT/.gpu-check"
PIP=${PIP:-python3 -m pip}

src=${GPU_HOST_SRC:-}
if [[ -z $src ]]; then
  for candidate in "$ROOT/shared/gpu-host" "$ROOT/../shared/gpu-host" "/work/shared/gpu-host"; do
    if [[ -d $candidate/redis ]]; then src=$candidate; break; fi
  done
fi
if [[ -z $src || ! -x $src/redis/redis-server && ! -f $src/redis/redis-server ]]; then
  echo "prepare-gpu-host: no gpu-host folder with redis/ found; set GPU_HOST_SRC" >&2
  exit 2
fi

rm -rf "$DEST/redis" "$DEST/wheels" "$DEST/site" "$DEST/bin" "$DEST/out"
mkdir -p "$DEST/redis" "$DEST/wheels" "$DEST/bin"
cp "$src"/redis/* "$DEST/redis/"
chmod u+w,a+x "$DEST/redis/redis-server" "$DEST/redis/redis-cli"
cp "$src"/wheels-py312/*.whl "$DEST/wheels/"

# What the worker, the tests and pytest import beyond the host's own packages.
WHEELS=(
  "click==8.1.8"
  "pytest==8.4.2"
  "pluggy==1.6.0"
  "iniconfig==2.1.0"
  "packaging==25.0"
  "pygments==2.19.2"
  "pytest-asyncio==1.2.0"
  "pytest-timeout==2.4.0"
  "typing_extensions==4.15.0"
  "simplejpeg==1.9.0"
  # worker/fetch/s3.py (tests/ is collected whole: a module that cannot be imported is an error)
  "obstore==0.12.1"
)
download() {
  $PIP download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    -d "$DEST/wheels" "$@"
}
download "${WHEELS[@]}"

case "${GPU_CHECK_NVIMGCODEC:-}" in
  "")
    if compgen -G "$src/nvimgcodec-cu13-py312/*.whl" >/dev/null; then
      cp "$src"/nvimgcodec-cu13-py312/*.whl "$DEST/wheels/"
    fi
    ;;
  none) ;;
  cu12) download "nvidia-nvimgcodec-cu12==0.9.0.20" "nvidia-nvjpeg-cu12" ;;
  cu13) download "nvidia-nvimgcodec-cu13==0.9.0.20" "nvidia-nvjpeg" ;;
  *) echo "GPU_CHECK_NVIMGCODEC must be cu12 or cu13" >&2; exit 2 ;;
esac

du -sh "$DEST" | awk '{print "prepare-gpu-host: " $1 " in .gpu-check/ (the carry limit is 64 MiB)"}'
ls "$DEST/wheels"
