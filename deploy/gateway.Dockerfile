# The gateway: aiohttp + tokenizer, no torch. Small, starts in about a second.
# Build arguments PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST (pip's own settings, for a
# mirror or proxy) and extra CA certificates in deploy/ca-certificates/*.crt, as for the engine.
FROM python:3.11-slim

ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt

COPY deploy/ca-certificates/ /usr/local/share/ca-certificates/ember/
RUN update-ca-certificates
RUN useradd --create-home --uid 10001 ember
WORKDIR /src
COPY deploy/gateway-requirements.txt ./
RUN pip install -r gateway-requirements.txt
COPY pyproject.toml README.md ./
COPY ember_core ember_core
COPY proto proto
COPY services services
# --no-deps: the engine's dependencies (torch, safetensors, gguf, ...) stay out of this image.
RUN pip install --no-deps . && rm -rf /src/build

USER ember
WORKDIR /home/ember
ENV EMBER_HOST=0.0.0.0 EMBER_PORT=8000 EMBER_ENGINE=dns+tcp://engine:5555
EXPOSE 8000
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ[\"EMBER_PORT\"]}/health', timeout=2)"]
CMD ["ember-gateway"]
