#!/usr/bin/env bash
# Single-GPU ResNet-50 (mixed precision) images/s, plain Keras fit vs tfdp fit (+async checkpoints); writes a markdown table.
#
# Usage: bash scripts/gpu_bench.sh [--cpu_smoke] [--out_dir DIR]
#   On a GPU machine: fits in 8 minutes (each variant's model is traced once,
#   then 3 rotated rounds of 5 warm-up + 2 x 50 timed steps at 256 images).
#   --cpu_smoke: the same script path with ResNet-50 on 32x32 images, batch 8,
#   a few steps, on CPU, no mixed precision: checks the script end to end.
# Writes DIR/gpu_bench_<date>_<gpu>.md (paste into docs/performance.md) and
# the .json next to it; DIR defaults to bench_results/.
set -euo pipefail
cd "$(dirname "$0")/.."

CPU_SMOKE=0
OUT_DIR=bench_results
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu_smoke) CPU_SMOKE=1 ;;
    --out_dir) OUT_DIR="$2"; shift ;;
    --out_dir=*) OUT_DIR="${1#*=}" ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
mkdir -p "$OUT_DIR"
DATE="$(date -u +%Y-%m-%d)"

if [ "$CPU_SMOKE" = 1 ]; then
  GPU="cpu-smoke ($(nproc) CPUs)"
  ARGS=(--strategy=default --image_size=32 --global_batch_size=8 --num_examples=32
        --warmup_steps=1 --window_steps=3 --windows=1 --rounds=1 --ckpt_every=3
        --nomixed_precision)
  LIMIT=900
else
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "no GPU visible (nvidia-smi); use --cpu_smoke to dry-run" >&2
    exit 1
  fi
  GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  # 512 in-memory 224x224 images (300 MB, host) feed both pipelines.
  ARGS=(--strategy=one_device --image_size=224 --global_batch_size=256
        --num_examples=512 --warmup_steps=5 --window_steps=50 --windows=2
        --rounds=3 --ckpt_every=50 --mixed_precision)
  LIMIT=470  # leaves time to write the table within 8 minutes
fi
SLUG="$(echo "$GPU" | tr -c 'A-Za-z0-9\n' '_' | tr -s '_' | sed 's/_$//')"
JSON="$OUT_DIR/gpu_bench_${DATE}_${SLUG}.json"
MD="$OUT_DIR/gpu_bench_${DATE}_${SLUG}.md"

CMD=("$PYTHON" scripts/bench_train.py --parts=throughput --model=resnet50
     --num_classes=1000 --variants=plain,tfdp,tfdp_ckpt "${ARGS[@]}" --out="$JSON")
echo "==> ${CMD[*]}"
timeout "$LIMIT" "${CMD[@]}"

"$PYTHON" - "$JSON" "$MD" "$GPU" "$DATE" "${CMD[*]}" <<'EOF'
import json, sys
path, md, gpu, date, cmd = sys.argv[1:]
out = json.load(open(path))
t = out["throughput"]
v = t["raw"]["variants"]
plain = v["plain"]["median_examples_per_s"]
lines = [f"ResNet-50 training on one {gpu}, {date}, TF {out['machine'].get('tensorflow')}, "
         f"Keras {out['machine'].get('keras')}: global batch {t['settings']['global_batch_size']}, "
         "mixed precision unless stated in the command; median of "
         f"{len(v['plain']['window_rates'])} timed windows of {t['settings']['window_steps']} steps "
         "per variant, variants interleaved.", "",
         "| variant | images/s | vs plain Keras |", "|---|---|---|"]
names = {"plain": "plain Keras `model.fit` (tf.data + experimental_distribute_dataset)",
         "tfdp": "`tfdp.fit` + `tfdp.data.distribute`",
         "tfdp_ckpt": "tfdp + async checkpoint every %d steps" % t["settings"]["ckpt_every"]}
for name, r in v.items():
  rate = r["median_examples_per_s"]
  lines.append(f"| {names.get(name, name)} | {rate:.0f} | {rate / plain:.3f} |")
lines += ["", f"Command: `bash scripts/gpu_bench.sh` (runs `{cmd}`)", ""]
open(md, "w").write("\n".join(lines))
print("\n".join(lines))
print(f"wrote {md}")
EOF
