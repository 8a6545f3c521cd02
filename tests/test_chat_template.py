"""Chat templates: with a tokenizer that has one (data.chat_template=auto), DeepSpeed-Chat's
" Human: ... Assistant:" rows, `messages` rows and the chat CLI render the same text; without one,
or with data.chat_template=none, DeepSpeed-Chat's text stays.

    python -m pytest tests/test_chat_template.py
"""

from __future__ import annotations

import json

import pytest

from rlhf.chat import chat_format
from rlhf.config import DataConfig, ModelConfig, SourceConfig
from rlhf.data.adapters import dschat_messages
from rlhf.data.blend import DataReport, load_step_data
from rlhf.data.cache import cache_key
from rlhf.data.tokenize import sft_dataset
from rlhf.models import load_tokenizer, resolve_path

# A Llama-3-like template: it writes the bos token itself and closes every turn with <|end|>.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": "sort b a"}]
DSCHAT = {"prompt": "\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: sort b a\n\nAssistant:", "chosen": " a b",
          "rejected": " b a"}


@pytest.fixture(scope="module")
def tok():
    tokenizer = load_tokenizer(resolve_path(ModelConfig(name="tiny-llama", random_init=True)))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _data(tmp_path, row: dict, **kw) -> DataConfig:
    for split in ("train", "eval"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for _ in range(9)))
    return DataConfig(name="chat", sources=[SourceConfig(path=str(tmp_path))], split="1,1,1", **kw)


def test_sft_ppo_and_chat_render_the_same_prompt_through_the_template(tok, tmp_path):
    expected = "<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n<|user|>\nsort b a<|end|>\n<|assistant|>\n"
    cfg = _data(tmp_path, DSCHAT)
    sft_train, sft_eval = load_step_data(cfg, "sft", DataReport(), tok)
    ppo_train, ppo_eval = load_step_data(cfg, "ppo", DataReport(), tok)
    chat = chat_format(tok).prompt(TURNS)
    assert chat == expected  # the template's text less its bos: tokenization adds the one bos
    assert {*sft_train["prompt"], *sft_eval["prompt"], *ppo_train["prompt"], *ppo_eval["prompt"]} == {expected}
    # Answers close the turn as the template does; eos is appended by tokenization, once.
    assert (sft_train[0]["chosen"], sft_train[0]["rejected"]) == ("a b<|end|>", "b a<|end|>")
    ids = sft_dataset(sft_train, tok, 256, "answer", DataReport(), "train")[0]["input_ids"]
    assert ids == tok(expected + "a b<|end|>").input_ids + [tok.eos_token_id]
    assert ids.count(tok.bos_token_id) == 1


def test_messages_rows_render_as_the_same_turns_in_deepspeed_chat_form(tok, tmp_path):
    conversation = {"messages": [*TURNS, {"role": "assistant", "content": "a b"}],
                    "rejected": [*TURNS, {"role": "assistant", "content": "b a"}]}
    (tmp_path / "dschat").mkdir()
    (tmp_path / "chat").mkdir()
    from_dschat = load_step_data(_data(tmp_path / "dschat", DSCHAT), "reward", DataReport(), tok)[1][0]
    from_messages = load_step_data(_data(tmp_path / "chat", conversation), "reward", DataReport(), tok)[1][0]
    assert [from_dschat[k] for k in ("prompt", "chosen", "rejected")] == \
        [from_messages[k] for k in ("prompt", "chosen", "rejected")]


def test_without_a_template_or_with_none_deepspeed_chat_text_stays(tok, tmp_path):
    plain = load_tokenizer(resolve_path(ModelConfig(name="tiny-llama", random_init=True)))
    assert not plain.chat_template  # the shipped tiny models have none: their rule parses these prompts
    for tokenizer, mode in ((plain, "auto"), (tok, "none")):
        row = load_step_data(_data(tmp_path, DSCHAT, chat_template=mode), "sft", DataReport(), tokenizer)[1][0]
        assert (row["prompt"], row["chosen"]) == (DSCHAT["prompt"], DSCHAT["chosen"])
        assert chat_format(tokenizer, mode).prompt(TURNS) == " Human: Hi Assistant: Hello. Human: sort b a Assistant:"
    # The tokenized-data cache keeps the two renderings apart.
    assert cache_key("sft", _data(tmp_path, DSCHAT), tok, {}) != \
        cache_key("sft", _data(tmp_path, DSCHAT, chat_template="none"), tok, {})


def test_deepspeed_chat_prompts_parse_into_alternating_turns():
    assert dschat_messages(" Human: Hi Assistant: Hello. Human: sort b a Assistant:") == TURNS
    # A plain question (a table mapped by columns) is one user turn; a preface joins the first one,
    # and two turns of one role in a row are joined (templates expect them to alternate).
    assert dschat_messages("What is 2 + 2?") == [{"role": "user", "content": "What is 2 + 2?"}]
    assert dschat_messages("Be brief. Human: a Human: b Assistant:") == [{"role": "user", "content": "Be brief.\n\na\n\nb"}]
