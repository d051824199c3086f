#!/usr/bin/env bash
# The main job: set up (once), prepare the bundled data set once (scikit-learn's handwritten
# digits written as JPEGs into ImageNet's TFRecord layout), then train EfficientNet-B0 on it
# with 2 ranks through shoalrun for a couple of minutes: it prints the loss, accuracy rising
# well above chance (10%) and images/second. Extra arguments go to the training application
# (e.g. --max_epochs 3, --backend ddp-gloo, --batch_norm default). The old demo still runs with
# `shoalrun -np 2 .venv/bin/python examples/allreduce_demo.py`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
data=.cache/digits-tfrecords
.venv/bin/python -m apps.efficientnet.dataloader.digits --out "$data"
exec .venv/bin/shoalrun -np "${NP:-2}" .venv/bin/python -m apps.efficientnet.main \
  --mode train_and_eval --arch efficientnet-b0 --data_dir "$data" --num_classes 10 \
  --image_size 32 --max_epochs 12 --train_batch_size 32 --eval_batch_size 64 \
  --optimizer rmsprop --lr_init 0.002 --lr_warmup_epochs 2 --lr_decay cosine \
  --batch_norm syncbn --bn_momentum 0.9 --augmenter_name none --crop_min_scale 0.5 \
  --random_flip false --num_workers 1 --log_steps 0 --save_checkpoint_freq 0 --resume none \
  --model_dir results/efficientnet-digits \
  "$@"
