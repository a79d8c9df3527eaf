"""A row's prompt as the engine is given it: a string as it is, chat messages rendered by the
model tokenizer's chat template, with the generation prompt (the assistant's turn opened)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class NoChatTemplate(ValueError):
    """A chat prompt for a model whose tokenizer has no chat template."""


def render(tokenizer: Any, prompt: str, messages: Sequence[Any]) -> str:
    """`prompt`, or `messages` (each with `role` and `content`: a Message or the wire's
    ChatMessage) through `tokenizer`'s chat template. The template's own begin-of-text token is
    left out where the tokenizer adds one when it encodes (Llama 3): the engine's encoding
    would have it twice."""
    if not messages:
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate(
            "the dataset's prompts are chat messages, and the model's tokenizer has no chat "
            "template (tokenizer_config.json: chat_template)"
        )
    chat = [{"role": m.role, "content": m.content} for m in messages]
    text = str(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    bos = tokenizer.bos_token
    adds_bos = tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
    if bos and text.startswith(bos) and adds_bos:
        text = text[len(bos) :]
    return text


def prompt_text(prompt: str, messages: Sequence[Any]) -> str:
    """The prompt a reward plug-in is given: the string, or a chat prompt's contents one per
    line (what the user wrote, without the template's markup)."""
    return prompt or "\n".join(m.content for m in messages)
