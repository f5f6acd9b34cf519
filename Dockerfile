# syntax=docker/dockerfile:1
# The nobackfill images, two targets from one file (docs/deploy.md):
#   docker build -t nobackfill:cpu .                  CPU (the default target: the last stage)
#   docker build --target cuda -t nobackfill:cuda .   torch's CUDA build + faiss-gpu, for GPU boxes
# Both carry the real model backends (the `models` extra).  Dependencies install in layers of their
# own, from pyproject.toml alone, before the source is copied: a code change rebuilds only the
# last, small layers.  Mount the gallery and the profile read-only under /data.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- what both targets run on: a non-root user with a numeric id, the virtualenv on PATH
FROM ${PYTHON_IMAGE} AS runtime
# bash with pipefail: a pipe's failure must fail the build (repeated in the stages that pipe, for hadolint).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# HOME is /tmp: the root filesystem is read-only in compose and Kubernetes, /tmp is the one writable folder.
RUN groupadd --gid 10001 nobackfill \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin nobackfill \
    && mkdir -p /data \
    && chown 10001:10001 /data \
    && python -m venv /opt/venv

# ---- the dependency lists, read from pyproject.toml only (so editing service/ never invalidates them)
FROM runtime AS requirements
WORKDIR /build
COPY pyproject.toml deploy/docker/requirements.py ./
RUN python requirements.py pyproject.toml /req

# ---- the project itself as a wheel (no dependencies): the only stage that sees the source
FROM runtime AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---- CPU dependencies: torch's CPU build first, so nothing pulls a multi-GB CUDA build
FROM runtime AS deps-cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_VERSION=2.13.0
COPY --from=requirements /req /req
RUN pip install torch==${TORCH_VERSION} --index-url https://download.pytorch.org/whl/cpu \
    && pip install -r /req/base.txt -r /req/models.txt -r /req/milvus.txt -r /req/pgvector.txt -r /req/qdrant.txt \
    && ! pip list 2>/dev/null | grep -i -E '^(nvidia-|torchvision )'

# ---- CUDA dependencies: torch built for CUDA 12 (its CUDA libraries come as wheels) and faiss-gpu-cu12
FROM runtime AS deps-cuda
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu128
COPY --from=requirements /req /req
RUN pip install torch==${TORCH_VERSION} --index-url https://download.pytorch.org/whl/${TORCH_CUDA} \
    && pip install -r /req/base-gpu.txt -r /req/models.txt -r /req/milvus.txt -r /req/pgvector.txt -r /req/qdrant.txt -r /req/gpu.txt \
    && ! pip list 2>/dev/null | grep -i -E '^(faiss-cpu|torchvision) '

# ---- target `cuda`: the same tail as `cpu` below (tests/system/test_deploy.py keeps the two identical)
FROM deps-cuda AS cuda
COPY --from=wheel /wheels /wheels
RUN pip install --no-deps /wheels/*.whl && rm -rf /wheels
ENV NOBACKFILL_API__HOST=0.0.0.0 \
    NOBACKFILL_API__PORT=8000 \
    NOBACKFILL_INDEX__GALLERY_DIR=/data/gallery \
    NOBACKFILL_COMPAT__PROFILE_DIR=/data/profile \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    XDG_CACHE_HOME=/tmp/cache
WORKDIR /data
USER 10001:10001
EXPOSE 8000
# /readyz: 200 once the encoders, the gallery and the profile are loaded; the start period covers that load.
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2)"]
ENTRYPOINT ["nobackfill"]
CMD ["serve"]

# ---- target `cpu`, the default (last stage)
FROM deps-cpu AS cpu
COPY --from=wheel /wheels /wheels
RUN pip install --no-deps /wheels/*.whl && rm -rf /wheels
ENV NOBACKFILL_API__HOST=0.0.0.0 \
    NOBACKFILL_API__PORT=8000 \
    NOBACKFILL_INDEX__GALLERY_DIR=/data/gallery \
    NOBACKFILL_COMPAT__PROFILE_DIR=/data/profile \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    XDG_CACHE_HOME=/tmp/cache
WORKDIR /data
USER 10001:10001
EXPOSE 8000
# /readyz: 200 once the encoders, the gallery and the profile are loaded; the start period covers that load.
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2)"]
ENTRYPOINT ["nobackfill"]
CMD ["serve"]
