#!/usr/bin/env bash
# The Python packages scripts/device_pretrain.py needs on the GPU machine beyond what its image holds, as wheels in
# .whl/ (git-ignored through .git/info/exclude), fetched HERE: the GPU machine reaches no package index. Its image
# (Python 3.12) has torch, transformers, tokenizers, huggingface_hub, accelerate, peft, safetensors, numpy, scipy,
# pillow, pyyaml and tqdm; the pretraining scripts import besides them diffusers, omegaconf (with antlr4's runtime)
# and ftfy (with wcwidth); scripts/gpu_check.py's main job and tiny CLIP need hydra-core and open_clip_torch too (timm,
# regex and huggingface_hub are in the image). Then, through the device tool, with carry [".whl"]:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && TIME_LIMIT_S=$((540 - SECONDS)) \
#       python3 scripts/device_pretrain.py
#
# (PYTHONPATH=$PWD imports diffalign from the copy of the repo: nothing of it is installed there.)
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    diffusers==0.42.1 omegaconf==2.3.1 ftfy==6.3.1 wcwidth==0.9.4 hydra-core==1.3.8 open_clip_torch==3.3.0
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # (an sdist only on PyPI: pure Python)
ls -l .whl
echo "device_wheels: $(du -sh .whl | cut -f1) in .whl; carry it: run(..., carry=[\".whl\"])"
