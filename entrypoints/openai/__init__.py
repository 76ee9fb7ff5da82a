"""The OpenAI-compatible server: request/response models, handlers, and the FastAPI app."""
