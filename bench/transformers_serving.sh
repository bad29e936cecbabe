#!/usr/bin/env bash
# `transformers serve` (bench/http_serve.py's baseline) on a GPU host that reaches no package
# index: its image has torch and transformers but not the packages of `transformers[serving]`.
#
#   bench/transformers_serving.sh download [DIR]   # here: wheels for Python 3.12 into DIR
#   bench/transformers_serving.sh install [DIR] [VENV]   # on the GPU host, from DIR
#
# `install` makes VENV (default /tmp/transformers-serving) on top of the host's own packages (a
# .pth file puts its site-packages behind the venv's: its torch and transformers are used, pip
# adds only what is missing) and prints the interpreter to pass as `--transformers-python`.
set -euo pipefail
mode=${1:?download or install}
dir=${2:-.whl-serving}
case $mode in
download)
  plat=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  # transformers 5.17's `serving` extra without torch (the host's), and its own requirements;
  # `requests` and `jinja2`: its CLI and chat templates import them without declaring them
  python3 -m pip download -q "${plat[@]}" -d "$dir" 'openai>=1.98.0' 'pydantic>=2' uvicorn \
    fastapi starlette rich requests 'jinja2>=3.1.0' python-multipart 'huggingface-hub>=1.5,<2' \
    numpy packaging pyyaml 'regex>=2025.10.22' 'tokenizers>=0.23.1,<0.24' typer \
    'safetensors>=0.8' tqdm psutil
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$dir" 'accelerate>=1.1.0'  # not torch
  du -sh "$dir"
  ;;
install)
  venv=${3:-/tmp/transformers-serving}
  site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  python3 -m venv --without-pip "$venv"
  own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$site')" > "$own/_host_site.pth"
  "$venv/bin/python" -m pip install -q --no-index --find-links "$dir" 'transformers[serving]' \
    requests 'jinja2>=3.1.0'
  echo "$venv/bin/python"
  ;;
*) echo "usage: $0 download|install [DIR] [VENV]" >&2; exit 2 ;;
esac
