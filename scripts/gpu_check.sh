#!/usr/bin/env bash
# One script for a GPU machine that has torch, triton, einops, safetensors, hypothesis and pytest
# but no package registry: first the PTX audit of every Triton kernel (compiled for sm_90 at the
# tiny, small and glm5 presets; it needs no GPU), then the conformance suite on CUDA (tiny and
# small, bf16 and fp32; batched at tiny; the glm5_next family at glm5next_tiny, which shares the indexer's
# selection across draft steps like the release, audited at glm5next; index sharing on CUDA for both
# families), the gpu-marked tests, then the benchmarks (one sequence,
# then batches). Everything lands under $OUT (or outputs/gpu_check); a short table is printed last. Budget: about 8 minutes on an H100/H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

# Import glm_mtp from this checkout without installing it (src layout: the package is src/glm_mtp).
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

$PY - <<'PYEOF' | tee "$OUT/device.txt"
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, cuda {torch.version.cuda}")
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
PYEOF

status=0
summary="$OUT/summary.txt"
: > "$summary"

# The kernels' instruction stream first: compiled for an H100/H200 (sm_90), no FMA, no
# approximate or flush-to-zero op, every float add/sub/mul rounded; registers, spills, smem.
# Its PTX and cubins go to Triton's cache (TRITON_CACHE_DIR), not under $OUT.
timeout 300 $PY -m glm_mtp.tools.audit --arch sm_90 --presets tiny small glm5 >"$OUT/audit.log" 2>&1
rc=$?
[ $rc -ne 0 ] && status=1
echo "ptx audit sm_90, tiny small glm5: exit $rc ($(tail -n 1 "$OUT/audit.log"))" | tee -a "$summary"
for preset in tiny small; do
  for dtype in bfloat16 float32; do
    scen=$([ "$preset" = tiny ] && echo 200 || echo 60)
    log="$OUT/conformance-$preset-$dtype.log"
    timeout 150 $PY -m glm_mtp.conformance --candidate optimized --baseline reference --device cuda \
      --dtype "$dtype" --preset "$preset" --scenarios "$scen" --seed 0 \
      --json "$OUT/conformance-$preset-$dtype.json" >"$log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    echo "conformance optimized vs reference, cuda $preset $dtype, $scen scenarios: exit $rc" | tee -a "$summary"
    tail -n 3 "$log"
  done
done

# The glm5_next family (GLM-5.3-Flash): its kernels audited at glm5next widths, then lockstep on CUDA
# (the fused step with the family's kernels, captured), batched generator included.
timeout 200 $PY -m glm_mtp.tools.audit --arch sm_90 --presets glm5next >"$OUT/audit-glm5next.log" 2>&1
rc=$?
[ $rc -ne 0 ] && status=1
echo "ptx audit sm_90, glm5next: exit $rc ($(tail -n 1 "$OUT/audit-glm5next.log"))" | tee -a "$summary"
for dtype in bfloat16 float32; do
  log="$OUT/conformance-glm5next_tiny-$dtype.log"
  timeout 150 $PY -m glm_mtp.conformance --candidate optimized --baseline reference --device cuda \
    --dtype "$dtype" --preset glm5next_tiny --scenarios 40 --seed 0 --generators realistic,adversarial,batched \
    --json "$OUT/conformance-glm5next_tiny-$dtype.json" >"$log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && status=1
  echo "conformance optimized vs reference, cuda glm5next_tiny $dtype, 40 scenarios: exit $rc" | tee -a "$summary"
  tail -n 3 "$log"
done

# Index sharing across draft steps (DESIGN.md §9) on CUDA: GLM-5 (tiny, sharing on) and glm5next_tiny,
# step 1 and the shared steps captured in one graph per num_drafts, eager too, then batched scenarios.
timeout 150 $PY -m pytest -q -m gpu -p no:cacheprovider tests/optimized/test_sharing.py >"$OUT/pytest-sharing.log" 2>&1
rc=$?
[ $rc -ne 0 ] && status=1
echo "index sharing on cuda (pytest -m gpu tests/optimized/test_sharing.py): exit $rc" \
  "($(tail -n 1 "$OUT/pytest-sharing.log"))" | tee -a "$summary"

# Batched drafting on CUDA: propose_batch / catchup_batch against each state alone (graphs per bucket).
for dtype in bfloat16 float32; do
  log="$OUT/conformance-batched-tiny-$dtype.log"
  timeout 90 $PY -m glm_mtp.conformance --candidate optimized --baseline reference --device cuda --generators batched \
    --dtype "$dtype" --preset tiny --scenarios 40 --seed 0 --json "$OUT/conformance-batched-tiny-$dtype.json" >"$log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && status=1
  echo "batched conformance, cuda tiny $dtype, 40 scenarios: exit $rc" | tee -a "$summary"
  tail -n 3 "$log"
done

timeout 120 $PY -m pytest -q -m gpu -p no:cacheprovider tests >"$OUT/pytest-gpu.log" 2>&1
rc=$?
[ $rc -ne 0 ] && status=1
echo "pytest -m gpu: exit $rc ($(tail -n 1 "$OUT/pytest-gpu.log"))" | tee -a "$summary"

timeout 300 $PY -m glm_mtp.experiments.bench --device cuda --presets tiny small glm5_shape glm5 glm5next_small glm5next \
  --drafts 1 2 3 4 5 --repeats 30 --out "$OUT/bench" >"$OUT/bench.log" 2>&1
rc=$?
[ $rc -ne 0 ] && status=1
echo "bench: exit $rc" | tee -a "$summary"

timeout 120 $PY -m glm_mtp.experiments.bench_batch --device cuda --preset small --batch-sizes 1 2 4 8 16 --repeats 30 \
  --no-counters --out "$OUT/bench_batch" >"$OUT/bench_batch.log" 2>&1
rc=$?
[ $rc -ne 0 ] && status=1
echo "bench_batch: exit $rc" | tee -a "$summary"

echo
cat "$summary"
echo
cat "$OUT/audit.log"
[ -f "$OUT/bench/bench.md" ] && cat "$OUT/bench/bench.md"
[ -f "$OUT/bench_batch/bench_batch.md" ] && cat "$OUT/bench_batch/bench_batch.md"
exit $status
