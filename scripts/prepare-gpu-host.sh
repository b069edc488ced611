#!/usr/bin/env bash
# Gather what `make gpu-check` needs on a GPU host without network into .gpu-check/:
# the redis-server binary with its libraries, and wheels for the packages the check imports
# that such a host lacks (scripts/gpu-host-carry.txt, plus the gpu-host folder's own).
# Run it on a machine with network, before the working tree travels. Nothing under
# .gpu-check/ is tracked by git.
#
#   GPU_HOST_SRC=DIR           a prepared gpu-host folder (redis/ and wheels-py312/);
#                              default: shared/gpu-host next to or above the checkout
#   GPU_CHECK_NVIMGCODEC=...   nvImageCodec + nvJPEG for GPU decode (about 29 MB): by
#                              default the gpu-host folder's nvimgcodec-cu13-py312/ wheels
#                              where it has them; cu12 or cu13 downloads them instead;
#                              none carries none (the check then decodes on the CPU)
#   GPU_CHECK_DIR=DIR          where the carry goes (default .gpu-check in the checkout)
#   GPU_CHECK_PYTHON_VERSION   the GPU host's Python (default 3.12); the rehearsal
#                              (`make gpu-check-rehearse`) prepares the same versions for
#                              this machine's Python instead
#   PIP=...                    the pip to download with (default: python3 -m pip)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${GPU_CHECK_DIR:-$ROOT/.gpu-check}
PIP=${PIP:-python3 -m pip}
PYVER=${GPU_CHECK_PYTHON_VERSION:-3.12}
ABI=cp${PYVER/./}
# What may travel with the working tree to a GPU host, in all.
CARRY_LIMIT_MIB=64

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

download() {
  $PIP download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    -d "$DEST/wheels" "$@"
}

# The gpu-host folder's wheels are built for its Python (3.12): copied as they are where
# they fit this Python, else the same version downloaded for it.
carry_wheel() {
  local wheel=$1 base name version tags
  base=$(basename "$wheel" .whl)
  IFS=- read -r name version tags <<<"$base"
  if [[ $PYVER == 3.12 || $tags == py3-none-* ]]; then
    cp "$wheel" "$DEST/wheels/"
  else
    download "$name==$version"
  fi
}
for wheel in "$src"/wheels-py312/*.whl; do carry_wheel "$wheel"; done

mapfile -t WHEELS < <(grep -Ev '^[[:space:]]*(#|$)' "$ROOT/scripts/gpu-host-carry.txt")
download "${WHEELS[@]}"

case "${GPU_CHECK_NVIMGCODEC:-}" in
  "")
    for wheel in "$src"/nvimgcodec-cu13-py312/*.whl; do
      [[ -f $wheel ]] && carry_wheel "$wheel"
    done
    ;;
  none) ;;
  cu12) download "nvidia-nvimgcodec-cu12==0.9.0.20" "nvidia-nvjpeg-cu12" ;;
  cu13) download "nvidia-nvimgcodec-cu13==0.9.0.20" "nvidia-nvjpeg" ;;
  *) echo "GPU_CHECK_NVIMGCODEC must be cu12 or cu13" >&2; exit 2 ;;
esac

size_kib=$(du -sk "$DEST" | cut -f1)
limit_kib=$((CARRY_LIMIT_MIB * 1024))
printf 'prepare-gpu-host: %d KiB in %s (the carry limit is %d MiB: %d KiB to spare)\n' \
  "$size_kib" "$DEST" "$CARRY_LIMIT_MIB" $((limit_kib - size_kib))
ls "$DEST/wheels"
if ((size_kib > limit_kib)); then
  echo "prepare-gpu-host: FAILED: the carry is over the ${CARRY_LIMIT_MIB} MiB limit" >&2
  exit 1
fi
