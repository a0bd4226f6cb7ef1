# vLLM's OpenAI server image (vllm==0.26.0, the GPU-validated version) with vllm-xmix, serving
# through `vllm-xmix serve` (a model, a deployment file, and any vLLM serve arguments):
#   docker build -t vllm-xmix .
#   docker run --gpus all -p 8000:8000 -v "$PWD/apps:/apps" -v ~/.cache/huggingface:/root/.cache/huggingface \
#       vllm-xmix meta-llama/Llama-3.1-8B-Instruct --apps /apps/apps.yaml
# Vector files named in apps.yaml are read relative to it, so mount its folder.
FROM vllm/vllm-openai:v0.26.0

WORKDIR /opt/vllm-xmix
COPY pyproject.toml setup.py README.md ./
COPY vllm_xmix ./vllm_xmix
# vLLM and its dependencies (pydantic, numpy, safetensors, PyYAML) come with the image; the
# plugin registers itself through the vllm.general_plugins entry point
RUN VLLM_TARGET_DEVICE=cuda pip install --no-cache-dir --no-deps . \
    && python3 -c "import importlib.metadata as m; assert any(e.name == 'xmix' for e in m.entry_points(group='vllm.general_plugins'))"

EXPOSE 8000
ENTRYPOINT ["vllm-xmix", "serve"]
CMD ["--help"]
