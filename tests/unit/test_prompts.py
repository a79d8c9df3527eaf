"""A chat prompt is rendered by the model's own chat template, once, with the assistant's turn
opened; a string prompt passes as it is."""

from __future__ import annotations

import pytest

from robustrl.generation.prompts import NoChatTemplate, prompt_text, render
from robustrl.generation.real_shapes import LIKE, build_tokenizer
from robustrl.generation.tasks import Message

CHAT = (Message("system", "Be brief."), Message("user", "What is 2+3?"))


def test_a_qwen_chat_prompt_is_rendered_by_its_template() -> None:
    tokenizer = build_tokenizer(LIKE["qwen2.5-0.5b"].family, 151_936)
    assert render(tokenizer, "", CHAT) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(tokenizer, "7-1=", ()) == "7-1="


def test_a_llama_chat_prompt_encodes_with_one_begin_of_text() -> None:
    tokenizer = build_tokenizer(LIKE["llama-3.2-1b"].family, 128_256)
    text = render(tokenizer, "", CHAT[1:])
    ids = tokenizer(text)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_model_without_a_chat_template_is_told_apart(tmp_path: object) -> None:
    tokenizer = build_tokenizer(LIKE["qwen2.5-0.5b"].family, 151_936)
    tokenizer.chat_template = None
    with pytest.raises(NoChatTemplate, match="no chat template"):
        render(tokenizer, "", CHAT)


def test_a_reward_sees_what_the_user_wrote() -> None:
    assert prompt_text("", CHAT) == "Be brief.\nWhat is 2+3?"
    assert prompt_text("1+1=", ()) == "1+1="
