"""Request models of POST /tokenize and POST /detokenize, in vLLM's shape.

    {"model", "prompt"}      → {"count", "max_model_len", "tokens"}   text, as /v1/completions encodes it
    {"model", "messages"}    → {"count", "max_model_len", "tokens"}   a chat, as /v1/chat/completions renders it
    {"model", "tokens"}      → {"prompt"}

`return_token_strs: true` adds `token_strs`, the vocabulary entry of each id.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fastdeploy_lp.entrypoints.openai.protocol import ChatMessage, ToolDefinition

class _Request(BaseModel):
    """Strict types (a wrong type is a 400 naming the field); unknown fields are kept to be reported."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class TokenizeRequest(_Request):
    """POST /tokenize: either `prompt` (text) or `messages` (a chat), never both."""

    model: str | None = Field(None, description="The served model name; 'default' or leaving it out means it.")
    prompt: str | None = Field(None, description="Text, encoded as /v1/completions encodes a text prompt.")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="A chat, rendered with the model's chat template as /v1/chat/completions "
                                        "renders it.")
    add_special_tokens: bool | None = Field(
        None, description="Add the tokenizer's special tokens (BOS) around the text. Default: true for prompt "
                          "(what /v1/completions does), false for messages (the chat template writes them).")
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant turn's header.")
    continue_final_message: bool = Field(False, description="Not supported (400 when true).")
    chat_template: str | None = Field(None, description="Not supported (400 when set): the model's template is used.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="messages: extra template variables.")
    tools: list[ToolDefinition] | None = Field(None, description="messages: the tools the template renders.")
    return_token_strs: bool | None = Field(False, description="Also return each id's vocabulary entry.")

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: send either 'prompt' (text) or 'messages' (a chat), not "
                             + ("both" if self.prompt is not None else "neither"))
        if self.prompt is not None:
            chat_only = [f for f in ("tools", "chat_template_kwargs") if getattr(self, f) is not None]
            if chat_only:
                raise ValueError(f"{chat_only[0]}: only applies to 'messages'")
        if self.continue_final_message:
            raise ValueError("continue_final_message: not supported; render the chat with "
                             "add_generation_prompt false instead")
        if self.chat_template is not None:
            raise ValueError("chat_template: not supported; the model's own chat template is used")
        return self


class DetokenizeRequest(_Request):
    """POST /detokenize: token ids back to text (special tokens kept, so a rendered chat reads back)."""

    model: str | None = None
    tokens: list[int] = Field(description="Token ids, each in [0, vocabulary size).")
