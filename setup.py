"""One install for the engine, the processors and the OpenAI-compatible server.

`processors/` and `entrypoints/` live at the top of the repository and ship inside the
`fastdeploy_lp` namespace: `fastdeploy_lp/processors` and `fastdeploy_lp/entrypoints` are relative
symlinks to them. So the source tree imports exactly as it installs (`PYTHONPATH=.` is enough, and
editors resolve `fastdeploy_lp.processors`), `pip install -e .` maps one directory, and
`pip install .` copies the real files into the wheel (`find_packages` follows the links).
Nothing named plain `processors` or `entrypoints` lands in site-packages.
"""

from setuptools import find_packages, setup

setup(
    name="fastdeploy_lp",
    version="0.1.0",
    description="Paddle LLM inference engine with a registered logits-processor pipeline",
    python_requires=">=3.11",
    packages=find_packages(include=["fastdeploy_lp", "fastdeploy_lp.*"]),
    package_data={"fastdeploy_lp": ["default_model/*"], "fastdeploy_lp.model.cpu_kernels": ["kernels.c", "linear.h", "blocks.h", "block_linear.h", "layer.h"]},
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
    ],
    extras_require={"test": ["pytest", "openai", "openai-agents", "httpx", "jsonschema", "anthropic"]},
    entry_points={"console_scripts": ["fastdeploy-lp=fastdeploy_lp.entrypoints.cli:main"]},
)
