#!/usr/bin/env bash
# The kvstore's GPU checks and benchmarks in one device call (H200): CUDA IPC test, swap
# bandwidth, RPC round trip (four latency modes). Results under $OUT (or ./out).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pytest -q -m gpu tests/kvstore -p no:cacheprovider 2>&1 | tee "$out/kvstore_gpu_tests.txt"
python3 bench/swap.py 2>&1 | tee "$out/swap.txt"
for mode in "--items" "" "--client-spin-us 1000" "--busy-poll" "--busy-poll --client-spin-us 1000"; do
  python3 bench/rpc.py --device cuda $mode 2>&1 | tee -a "$out/rpc_gpu_host.txt"
done
