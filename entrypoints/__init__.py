"""Ways in: the OpenAI-compatible HTTP server (`entrypoints/openai/`) and the `fastdeploy-lp` CLI."""
