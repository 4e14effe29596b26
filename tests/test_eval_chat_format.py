"""The model wrapper derived from a chat template: one user turn, no default system turn (RULER / LongBench
wrappers have none), one BOS."""

import pytest

from dual_cache.eval.quality.chat_format import PLAIN, TEMPLATE_DEFAULT, PromptFormat, adds_bos, prompt_format
from tests.test_eval_support import char_tokenizer

# SmolLM2's template shape: ChatML with a default system turn, and "<|im_start|>" as its BOS token
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama-3.1's shape: a standalone BOS, a default system block, trimmed content
LLAMA3 = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>"
    "{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def tokenizer(template, bos, adds=False):
    from tokenizers import processors

    tok = char_tokenizer()
    tok.chat_template = template
    tok.add_special_tokens({"bos_token": bos})
    if adds:
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.bos_token_id)])
    return tok


def test_chatml_drops_the_default_system_turn():
    tok = tokenizer(CHATML, "<|im_start|>")
    fmt = prompt_format(tok)
    assert fmt == PromptFormat("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n", chat=True)
    assert prompt_format(tok, system_prompt=TEMPLATE_DEFAULT).prefix == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n<|im_start|>user\n")
    assert prompt_format(tok, system_prompt="Be brief.").prefix == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert fmt.wrap("Q?") == "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"


def test_llama3_shape_is_rulers_meta_llama3_template():
    tok = tokenizer(LLAMA3, "<|begin_of_text|>")
    assert not adds_bos(tok)
    # RULER's template.py 'meta-llama3' with {task_template} in the middle
    expected = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{task_template}<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert prompt_format(tok).wrap("{task_template}") == expected
    # a tokenizer that adds the BOS itself: the textual one is dropped, so the ids hold exactly one
    tok = tokenizer(LLAMA3, "<|begin_of_text|>", adds=True)
    assert adds_bos(tok)
    fmt = prompt_format(tok)
    assert fmt.prefix == "<|start_header_id|>user<|end_header_id|>\n\n"
    assert tok(fmt.wrap("hi"))["input_ids"].count(tok.bos_token_id) == 1


def test_plain_and_errors():
    tok = char_tokenizer()
    tok.chat_template = None
    assert prompt_format(tok) == PLAIN and PLAIN.wrap("x") == "x"
    assert prompt_format(tokenizer(CHATML, "<|im_start|>"), chat_template="none") == PLAIN
    with pytest.raises(ValueError, match="needs a chat template"):
        prompt_format(tok, system_prompt="Be brief.")
    with pytest.raises(ValueError, match="chat_template must be"):
        prompt_format(tok, chat_template="yes")
