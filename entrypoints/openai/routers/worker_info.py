"""What request routers ask a replica about itself (SGLang's worker protocol, which `sglang-router`
and `vllm-router` read when a worker registers and while they balance load):

    GET /get_model_info, /model_info     the model (its served name, path, architecture)
    GET /get_server_info, /server_info   the server's limits (slots, context, KV tokens)
    GET /get_load                        the sequences running and waiting now (and per engine
                                         process: `engines`, several with --data-parallel-size)
"""

from __future__ import annotations

from fastapi import APIRouter, Request

router = APIRouter()


def _model_info(request: Request) -> dict:
    state = request.app.state
    model = state.async_engine.fd_config.model_config
    return {"model_path": state.settings.model_path, "tokenizer_path": state.settings.model_path,
            "served_model_name": state.settings.served_model_names[0], "is_generation": True,
            "architectures": [model.architecture], "preferred_sampling_params": None,
            "has_image_understanding": False, "has_audio_understanding": False}


def _server_info(request: Request) -> dict:
    state = request.app.state
    fd_config = state.async_engine.fd_config
    stats = state.async_engine.kv_cache_stats()
    return {**_model_info(request), "version": request.app.version, "max_running_requests": fd_config.max_num_seqs,
            "context_length": fd_config.max_model_len,
            "max_total_num_tokens": stats.blocks_total * fd_config.cache_config.block_size}


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request):
    return _model_info(request)


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request):
    return _server_info(request)


@router.get("/get_load")
async def load(request: Request):
    engine = request.app.state.async_engine
    return {"num_reqs": engine.num_running + engine.num_waiting, "num_running_reqs": engine.num_running,
            "num_waiting_reqs": engine.num_waiting, "engines": engine.engine_loads()}
