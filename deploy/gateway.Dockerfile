# The gateway: aiohttp + tokenizer, no torch. Small, starts in about a second.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 ember
WORKDIR /app
COPY deploy/gateway-requirements.txt ./
RUN pip install -r gateway-requirements.txt
COPY pyproject.toml README.md ./
COPY ember_core ember_core
COPY proto proto
COPY services services
# --no-deps: the engine's dependencies (torch, safetensors, gguf, ...) stay out of this image.
RUN pip install --no-deps .

USER ember
ENV EMBER_HOST=0.0.0.0 EMBER_PORT=8000 EMBER_ENGINE=tcp://engine:5555
EXPOSE 8000
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ[\"EMBER_PORT\"]}/health', timeout=2)"]
CMD ["ember-gateway"]
