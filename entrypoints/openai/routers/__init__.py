"""The HTTP endpoints, one `APIRouter` per concern. Handlers read what they need from
`request.app.state` (set up by `api_server.build_app`), parse, hand over, and shape the answer:

    health.py       GET /health, GET /metrics
    models.py       GET /v1/models, GET /v1/models/{model}, GET /v1/logits_processors
    generation.py   POST /v1/chat/completions → serving_chat.py, POST /v1/completions → serving_completion.py
    tokenize.py     POST /tokenize, POST /detokenize → serving_tokenize.py
    messages.py     POST /v1/messages, POST /v1/messages/count_tokens (Anthropic) → serving_messages.py
    responses.py    POST /v1/responses, GET and DELETE /v1/responses/{id} → serving_responses.py
    worker_info.py  GET /get_model_info, /get_server_info, /get_load (what request routers read)
    render.py       POST /v1/{chat/completions,completions,responses,messages}/render: prompt ids, no generation
    lora.py         POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter (LoRA adapters at run time)
"""

from fastdeploy_lp.entrypoints.openai.routers.generation import router as generation_router
from fastdeploy_lp.entrypoints.openai.routers.health import router as health_router
from fastdeploy_lp.entrypoints.openai.routers.lora import router as lora_router
from fastdeploy_lp.entrypoints.openai.routers.messages import router as messages_router
from fastdeploy_lp.entrypoints.openai.routers.models import router as models_router
from fastdeploy_lp.entrypoints.openai.routers.render import router as render_router
from fastdeploy_lp.entrypoints.openai.routers.responses import router as responses_router
from fastdeploy_lp.entrypoints.openai.routers.tokenize import router as tokenize_router
from fastdeploy_lp.entrypoints.openai.routers.worker_info import router as worker_info_router

ROUTERS = (health_router, models_router, generation_router, tokenize_router, responses_router, messages_router,
           worker_info_router, render_router, lora_router)

__all__ = ["ROUTERS"]
