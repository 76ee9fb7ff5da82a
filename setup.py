"""One install for the engine, the processors and the OpenAI-compatible server.

`processors/` and `entrypoints/` live at the top of the repository but ship inside the
`fastdeploy_lp` namespace, so users import `fastdeploy_lp.processors` and run
`python -m fastdeploy_lp.entrypoints.openai.api_server`.
"""

from setuptools import find_packages, setup

core = find_packages(include=["fastdeploy_lp", "fastdeploy_lp.*"])
processors = ["fastdeploy_lp.processors" + p[len("processors"):]
              for p in find_packages(include=["processors", "processors.*"])]
entrypoints = ["fastdeploy_lp.entrypoints" + p[len("entrypoints"):]
               for p in find_packages(include=["entrypoints", "entrypoints.*"])]

setup(
    name="fastdeploy_lp",
    version="0.1.0",
    description="Paddle LLM inference engine with a registered logits-processor pipeline",
    python_requires=">=3.11",
    packages=core + processors + entrypoints,
    package_dir={
        "fastdeploy_lp": "fastdeploy_lp",
        "fastdeploy_lp.processors": "processors",
        "fastdeploy_lp.entrypoints": "entrypoints",
    },
    package_data={"fastdeploy_lp": ["default_model/*"]},
    include_package_data=True,
    install_requires=[
        "paddlepaddle>=3.0",
        "numpy",
        "safetensors",
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
    extras_require={"test": ["pytest", "openai", "httpx", "jsonschema"]},
    entry_points={"console_scripts": ["fastdeploy-lp=fastdeploy_lp.entrypoints.cli:main"]},
)
