#!/usr/bin/env bash
# The CUDA checks in one go, for a GPU machine with python3 + torch (CUDA) + transformers:
#   1. tests/test_devices.py -k cuda: greedy == transformers on the same GPU and weights (tiny
#      Llama / Qwen2; block_size 16, chunked prefill, preemption, prefix caching), seeded
#      sampling, beam search, the engine process, paged attention vs the reference oracle;
#   2. throughput of the fixed workload (64 x 128 prompt / 128 output tokens, greedy,
#      ignore_eos) on a random-weight model of SmolLM2-135M's shape, bf16, pagellm vs
#      transformers.generate at batch 64.
# Logs and the JSON report go to $OUT (default: benchmarks/results/cuda). Run from the repo root.
# Missing packages (gguf) may be given as wheels in .whl/.
set -uo pipefail
OUT=${OUT:-benchmarks/results/cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=.:${PYTHONPATH:-}

python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>&1 | tee "$OUT/env.txt"

timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rs -k cuda tests/test_devices.py --durations=10 -s \
    2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

model=/tmp/pagellm-random-smollm2-135m
python3 -m pagellm.benchmarks.random_model "$model" --shape smollm2-135m --dtype bfloat16 2>&1 | tail -1
timeout "${BENCH_TIMEOUT:-300}" python3 -m pagellm.benchmarks throughput --workload fixed --model "$model" \
    --device cuda --dtype bfloat16 --compare hf --no-progress --output-json "$OUT/throughput.json" \
    2>&1 | tee "$OUT/throughput.log"
bench_rc=${PIPESTATUS[0]}
echo "tests exit $tests_rc, throughput exit $bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
