# The nobackfill service: CPU image by default; mount the gallery and profile read-only at /data.
FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
# torch first from the CPU index so the image does not carry a CUDA build it cannot use.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY service ./service
RUN pip install . && useradd --uid 10001 --no-create-home nobackfill
USER nobackfill
ENV NOBACKFILL_API__HOST=0.0.0.0 \
    NOBACKFILL_INDEX__GALLERY_DIR=/data/gallery \
    NOBACKFILL_COMPAT__PROFILE_DIR=/data/profile
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"
CMD ["nobackfill", "serve"]
