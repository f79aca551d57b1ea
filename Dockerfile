# CUDA PyTorch base image; the framework needs nothing beyond PyTorch (no Transformer Engine, no apex).
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1

WORKDIR /workspace/megatron-lite
COPY pyproject.toml README.md ./
COPY megatron ./megatron
RUN pip install --no-cache-dir -e ".[data,logging,hf]"
COPY . .

CMD ["python", "pretrain_gpt.py", "--help"]
