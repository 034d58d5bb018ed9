#!/usr/bin/env bash
# The one device call of a GPU session with 15 minutes of device time (docs/gpu.md, "`make gpu-check`"):
# `bash bench/gpu_call.sh` with the `run` tool's timeout_s 600, after moving all models but mha and
# mha-1024-pruned out of the tree. Each part has a time limit of its own, so one slow part leaves time for the others;
# the limits sum to 945 s, so the call's own 600 s may cut the last parts short. After each part, everything written
# under bench/results since the call began is packed into $OUT/results.tgz (replaced whole, never half-written), so
# a part cut short loses only itself. Each part's output: bench/results/gpu_call_logs/part-<name>.txt, packed with
# the rest. $OUT holds results.tgz alone: the device tool brings back at most 8 files, and on 2026-11-28 a ninth
# (the part logs were then loose in $OUT) cost the whole archive. ($OUT/gpu-results.tar.gz, which each
# `make gpu-check` part writes of its own results, is removed after the part: results.tgz holds them.)
# Exit status 1 when a part failed or was cut short (all parts run all the same).
#
#   --dry-run   print the parts and their limits, run nothing (any machine)
set -u
cd "$(dirname "$0")/.."
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
out="${OUT:-}"
if [ -z "$out" ] || [ ! -d "$out" ]; then
  echo "gpu-call: \$OUT must name the folder the device tool brings back"; exit 2
fi
stamp=$(mktemp)  # what this call writes is newer than this
if [ "$dry" = 1 ]; then gpu="GPU"; else
  gpu=$(python3 -c "from bench.gpu_check import slug; print(slug())") || { echo "gpu-call: no GPU visible"; exit 1; }
fi
export PYTHONUNBUFFERED=1
logs=bench/results/gpu_call_logs
[ "$dry" = 1 ] || mkdir -p "$logs"

pack() {  # everything this call wrote under bench/results, as one archive
  find bench/results -newer "$stamp" -type f -print0 | tar -czf "$out/results.part" --null -T - \
    && mv "$out/results.part" "$out/results.tgz"
}

failed=""
part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2 rc
  shift 2
  echo "gpu-call: $name (limit ${limit} s): $(printf '%q ' "$@")"
  [ "$dry" = 1 ] && return 0
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$logs/part-$name.txt" 2>&1  # (-k: killed 10 s after a TERM it ignores)
  rc=$?
  echo "gpu-call: $name exit $rc in $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || failed="$failed $name"
  tail -n 5 "$logs/part-$name.txt"
  rm -f "$out/gpu-results.tar.gz"
  pack
}

# the tests first: the third H200 run lost 126 tests to one failed capture (models.train's, changed since on the CPU),
# so none of those ran; they now run with the CUDA-graph training tests last
part tests 240 make gpu-check ARGS="--only tests"
# the decode tables at 16k: the rows with fewer splits (MQA at batch 1 took 0.076 ms against SDPA's 0.013), then
# float32 on its table's launch shape beside the others
part kernels16k 100 python3 -m bench.kernels --sections decode,compact --contexts 16384 --models "" \
  --json "bench/results/kernels_16k_$gpu.json" --table "bench/results/kernels_16k_$gpu.md"
part kernels16k-fp32 60 python3 -m bench.kernels --dtype float32 --sections decode --contexts 16384 --models "" \
  --json "bench/results/kernels_16k_fp32_$gpu.json" --table "bench/results/kernels_16k_fp32_$gpu.md"
# the pruned step's attention alone, forward and backward (SDPA, PyTorch's kernel, ours) at SmolLM2's head shape,
# then our kernels' candidate launch shapes over five interleaved rounds (--tune-train); FlexAttention left out: on
# the H100 its compile failed here after autotuning, and the JSON is written only at the end
part train-attention 75 python3 -m bench.kernels --sections train_attention --no-flex --tune-train --models "" \
  --json "bench/results/kernels_train_attention_$gpu.json" --table "bench/results/kernels_train_attention_$gpu.md"
# pruned training against its dense twin, eager and from CUDA graphs, with PyTorch's attention kernel and ours
# (met at every alpha from graphs in the third run; the fourth repeats it at the same commit as the tests)
part profile 220 make gpu-check ARGS="--only profile"
# SmolLM2's shape (random weights; 3 K/V groups for 9 heads), its pruned step's attention in kernels.efficient, in
# kernels.triton_causal_bias and on SDPA
part profile-smollm2 60 python3 -m bench.train_step_profile --config configs/real/smollm2-pruned.json --alphas 2 \
  --ab-alpha 2 --steps 5 --device cuda --json "bench/results/train_step_profile_smollm2_$gpu.json"
# last, what may be cut: the decode targets, met in all three runs (batch-1 decode 2.00-2.16x transformers' best)
part decode 190 make gpu-check ARGS="--only decode"
if [ -n "$failed" ]; then echo "gpu-call: failed or cut short:$failed"; exit 1; fi
echo "gpu-call: done"
