"""One install for the engine, the processors and the OpenAI-compatible server.

`processors/` and `entrypoints/` live at the top of the repository (the design card) and ship
inside the `fastdeploy_lp` namespace through `package_dir`: `pip install .` copies them into the
wheel as `fastdeploy_lp/processors` and `fastdeploy_lp/entrypoints`, `pip install -e .` maps them
with setuptools' editable finder, and an uninstalled source tree (`PYTHONPATH=.`) finds them with
`fastdeploy_lp/_source_tree.py`. Nothing named plain `processors` or `entrypoints` lands in
site-packages.
"""

from setuptools import find_packages, setup

TOP_LEVEL_FOLDERS = ("processors", "entrypoints")  # as fastdeploy_lp/_source_tree.py resolves them
PACKAGES = find_packages(include=["fastdeploy_lp", "fastdeploy_lp.*"])
for _folder in TOP_LEVEL_FOLDERS:
    PACKAGES += [f"fastdeploy_lp.{_folder}"] + [f"fastdeploy_lp.{_folder}.{p}" for p in find_packages(_folder)]

setup(
    name="fastdeploy_lp",
    version="0.1.0",
    description="Paddle LLM inference engine with a registered logits-processor pipeline",
    python_requires=">=3.11",
    packages=PACKAGES,
    package_dir={f"fastdeploy_lp.{folder}": folder for folder in TOP_LEVEL_FOLDERS},
    package_data={"fastdeploy_lp": ["default_model/*"], "fastdeploy_lp.model.cpu_kernels": ["kernels.c", "linear.h", "invariant.h", "blocks.h", "block_linear.h", "invariant_blocks.h", "layer.h", "dot_bf16.h", "xpanel.h", "attention.h"]},
    install_requires=[
        "paddlepaddle>=3.0",
        "numpy",
        "safetensors",
        "gguf>=0.17",
        "tokenizers",
        "sentencepiece",
        "jinja2",
        "llguidance>=1.9",
        "pydantic>=2",
        "fastapi",
        "uvicorn",
        "prometheus-client",
        "tqdm",
        "pyzmq",    # KV-cache events (--kv-events-config): vLLM's ZMQ publisher
        "msgpack",  # ... and its msgpack wire format
    ],
    # the request routers tests/test_routers.py puts in front of two replicas
    extras_require={"test": ["pytest", "openai", "openai-agents", "httpx", "jsonschema", "anthropic",
                             "sglang-router==0.3.2", "vllm-router==0.1.17"]},
    entry_points={"console_scripts": ["fastdeploy-lp=fastdeploy_lp.entrypoints.cli:main"]},
)
