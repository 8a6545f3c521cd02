"""Every DeepSpeed-Chat dataset adapter on rows this project wrote in that dataset's own column
layout (no hub here): through load_source exactly as a local copy with `adapter:` would load."""

from __future__ import annotations

import json

import pytest

from rlhf.config import ConfigError, SourceConfig, to_schema
from rlhf.data.adapters import ADAPTERS
from rlhf.data.blend import load_source
from tests.conftest import compose

# name -> (rows in the dataset's own layout, expected (prompt, chosen, rejected) of the first row)
FIXTURES = {
    "Dahoas/rm-static": (
        [{"prompt": "\n\nHuman: Why is the sky blue?\n\nAssistant:", "response": " Rayleigh scattering.",
          "chosen": " Rayleigh scattering.", "rejected": " Because it is."}],
        ("\n\nHuman: Why is the sky blue?\n\nAssistant:", " Rayleigh scattering.", " Because it is.")),
    "Dahoas/full-hh-rlhf": (
        [{"prompt": "\n\nHuman: Hi\n\nAssistant:", "response": " Hello!", "chosen": " Hello!", "rejected": " Go."}],
        ("\n\nHuman: Hi\n\nAssistant:", " Hello!", " Go.")),
    "Dahoas/synthetic-instruct-gptj-pairwise": (
        [{"prompt": "Name a fruit.", "chosen": "An apple.", "rejected": "A chair."}],
        (" Human: Name a fruit. Assistant:", " An apple.", " A chair.")),
    "yitingxie/rlhf-reward-datasets": (
        [{"prompt": "\n\nHuman: Add 2 and 2.\n\n", "chosen": "Assistant: 4", "rejected": "Assistant: 5"}],
        ("\n\nHuman: Add 2 and 2.\n\nAssistant:", " 4", " 5")),
    "openai/webgpt_comparisons": (
        [{"question": {"full_text": "Do cats purr?"}, "answer_0": "Yes, they purr [1].", "score_0": -1.0,
          "answer_1": "Most cats purr when content [1, 2].", "score_1": 1.0}],
        (" Human: Do cats purr? Assistant:", " Most cats purr when content.", " Yes, they purr.")),
    "stanfordnlp/SHP": (
        [{"history": "Best pasta shape?", "human_ref_A": "Penne.", "human_ref_B": "Rigatoni.", "labels": 0}],
        (" Human: Best pasta shape? Assistant:", " Rigatoni.", " Penne.")),
    "pvduy/sharegpt_alpaca_oa_vicuna_format": (
        [{"prompt": "USER: Say hi ASSISTANT:", "label": "Hi!"}],
        (" Human: Say hi Assistant:", " Hi!", "")),
    "wangrui6/Zhihu-KOL": (
        [{"INSTRUCTION": "什么是光?", "RESPONSE": "电磁波。", "SOURCE": "Zhihu", "METADATA": "{}"}],
        (" Human: 什么是光? Assistant:", " 电磁波。", "")),
    "Cohere/miracl-zh-queries-22-12": (
        [{"query": "长城有多长?", "positive_passages": [{"text": "两万多公里。"}],
          "negative_passages": [{"text": "很短。"}]}],
        (" Human: 长城有多长? Assistant:", " 两万多公里。", " 很短。")),
    "Cohere/miracl-ja-queries-22-12": (
        [{"query": "富士山の高さは?", "positive_passages": [{"text": "3776メートル。"}],
          "negative_passages": [{"text": "低い。"}]}],
        (" Human: 富士山の高さは? Assistant:", " 3776メートル。", " 低い。")),
    "Hello-SimpleAI/HC3-Chinese": (
        [{"question": "水为什么是湿的?", "human_answers": ["因为液体。"], "chatgpt_answers": ["水是液体。"]}],
        (" Human: 水为什么是湿的? Assistant:", " 因为液体。", "")),
    "mkqa-Chinese": (
        [{"queries": {"zh_cn": "太阳有多大?", "ja": "太陽の大きさは?"},
          "answers": {"zh_cn": [{"text": "很大。"}], "ja": [{"text": "大きい。"}]}}],
        (" Human: 太阳有多大? Assistant:", " 很大。", "")),
    "mkqa-Japanese": (
        [{"queries": {"zh_cn": "太阳有多大?", "ja": "太陽の大きさは?"},
          "answers": {"zh_cn": [{"text": "很大。"}], "ja": [{"text": "大きい。"}]}}],
        (" Human: 太陽の大きさは? Assistant:", " 大きい。", "")),
    "lmqg/qg_jaquad": (
        [{"question": "日本の首都は?", "sentence": "東京です。", "paragraph": "..."}],
        (" Human: 日本の首都は? Assistant:", " 東京です。", "")),
    "lmqg/qag_jaquad": (
        [{"questions": ["日本の首都は?"], "answers": ["東京"], "paragraph": "日本の首都は東京です。"}],
        (" Human: 日本の首都は? Assistant:", " 日本の首都は東京です。", "")),
    "local/jsonfile": (
        [{"prompt": " Human: Hi Assistant:", "chosen": " Hello.", "rejected": " Bye."}],
        (" Human: Hi Assistant:", " Hello.", " Bye.")),
    "openai/gsm8k": (
        [{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}],
        (" Human: Tom has 3 apples and buys 4 more. How many? Assistant:", " 3 + 4 = <<3+4=7>>7\n#### 7", "")),
    "hendrycks/competition_math": (
        [{"problem": "What is $2^3$?", "level": "Level 1", "type": "Algebra", "solution": "$2^3 = \\boxed{8}$."}],
        (" Human: What is $2^3$? Assistant:", " $2^3 = \\boxed{8}$.", "")),
    "DigitalLearningGmbH/MATH-lighteval": (
        [{"problem": "What is $1+1$?", "level": "Level 1", "type": "Algebra", "solution": "$\\boxed{2}$"}],
        (" Human: What is $1+1$? Assistant:", " $\\boxed{2}$", "")),
}


def _folder(tmp_path, rows, name="train.jsonl"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    with open(tmp_path / name, "w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return str(tmp_path)


def test_every_registered_adapter_has_a_fixture():
    assert set(ADAPTERS) == set(FIXTURES)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_adapter_maps_the_original_layout(name, tmp_path):
    rows, expected = FIXTURES[name]
    ds = load_source(SourceConfig(path=_folder(tmp_path, rows), adapter=name), "train", 0)
    assert (ds[0]["prompt"], ds[0]["chosen"], ds[0]["rejected"]) == expected
    assert ds[0]["row"] == 0 and ds[0]["source"] == str(tmp_path / "train.jsonl")  # the file, for messages


def test_webgpt_tie_becomes_a_pair_that_is_dropped_and_counted(tmp_path):
    from rlhf.data.blend import DataReport
    from rlhf.data.tokenize import pair_dataset

    row = {"question": {"full_text": "Q?"}, "answer_0": "A.", "score_0": 0.0, "answer_1": "B.", "score_1": 0.0}
    ok = {**row, "score_1": 1.0}
    ds = load_source(SourceConfig(path=_folder(tmp_path, [row, ok]), adapter="openai/webgpt_comparisons"), "train", 0)

    class Tok:
        eos_token_id = 2

        def __call__(self, text, add_special_tokens=True):
            return type("E", (), {"input_ids": [1] * len(text.split())})

    report = DataReport()
    assert len(pair_dataset(ds, Tok(), 64, report, "train")) == 1
    assert report.dropped["train"] == {"chosen equals rejected": 1}


def test_column_mapping_for_any_table(tmp_path):
    rows = [{"question": "q1", "good": "a1", "bad": "b1"}]
    src = SourceConfig(path=_folder(tmp_path, rows), columns={"prompt": "question", "chosen": "good", "rejected": "bad"})
    ds = load_source(src, "train", 3)
    assert (ds[0]["prompt"], ds[0]["chosen"], ds[0]["rejected"]) == ("q1", "a1", "b1")


def test_missing_column_and_unreadable_row_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"data.sources\[0\].path=.* has no column 'chosen' \(nor 'answer'\)"):
        load_source(SourceConfig(path=_folder(tmp_path / "a", [{"prompt": "p", "reply": "x"}])), "train", 0)
    good = {"question": {"full_text": "Q?"}, "answer_0": "A.", "score_0": 0.0, "answer_1": "B.", "score_1": 1.0}
    bad = {**good, "question": {"title": "no full text"}}
    with pytest.raises(ValueError, match=r"data.sources\[0\] .*row 2: the openai/webgpt_comparisons adapter cannot"):
        load_source(SourceConfig(path=_folder(tmp_path / "b", [good, bad]), adapter="openai/webgpt_comparisons"),
                    "train", 0)


def test_adapter_and_columns_are_validated():
    with pytest.raises(ConfigError, match=r"data.sources\[0\].adapter='nope' is not allowed"):
        to_schema(compose(["data.sources=[{path: Dahoas/rm-static, adapter: nope}]"]))
    with pytest.raises(ConfigError, match=r"data.sources\[0\].columns=.* must map prompt and chosen"):
        to_schema(compose(["data.sources=[{path: Dahoas/rm-static, columns: {prompt: q}}]"]))
    cfg = to_schema(compose(["data.sources=[{path: Dahoas/rm-static}]"]))
    assert cfg.data.sources[0].path == "Dahoas/rm-static"  # a hub id passes through to load_dataset


CONVERSATION = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sort b a"},
                              {"role": "assistant", "content": "a b"}],
                 "rejected": [{"role": "user", "content": "Sort b a"}, {"role": "assistant", "content": "b a"}]}]


def test_conversations_without_a_chat_template_use_deepspeed_chat_turns(tmp_path):
    ds = load_source(SourceConfig(path=_folder(tmp_path, CONVERSATION)), "train", 0)
    assert ds[0]["prompt"] == " Be brief. Human: Hi Assistant: Hello. Human: Sort b a Assistant:"
    assert (ds[0]["chosen"], ds[0]["rejected"]) == (" a b", " b a")


def test_conversations_use_the_tokenizers_chat_template(tmp_path):
    from rlhf.config import ModelConfig
    from rlhf.models import load_tokenizer, resolve_path

    tok = load_tokenizer(resolve_path(ModelConfig(name="tiny-llama", random_init=True)))
    tok.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    ds = load_source(SourceConfig(path=_folder(tmp_path, CONVERSATION)), "train", 0, tok)
    assert ds[0]["prompt"] == "<|system|>Be brief.<|user|>Hi<|assistant|>Hello.<|user|>Sort b a<|assistant|>"
    assert ds[0]["chosen"] == "a b"


def test_long_ppo_prompts_are_dropped_or_left_truncated():
    from rlhf.config import ModelConfig
    from rlhf.data.blend import DataReport
    from rlhf.generation.rollout import prompt_dataset
    from rlhf.models import load_tokenizer, resolve_path

    tok = load_tokenizer(resolve_path(ModelConfig(name="tiny-llama", random_init=True)))
    rows = [{"prompt": " Human: sort a b c d e f g h i j Assistant:"}, {"prompt": " Human: sort b a Assistant:"}]
    report = DataReport()
    assert len(prompt_dataset(rows, tok, 8, report, "train")) == 1
    assert report.dropped["train"] == {"prompt longer than step.max_prompt_len=8": 1}
    report = DataReport()
    kept = prompt_dataset(rows, tok, 8, report, "train", long_prompts="truncate_left")
    assert len(kept) == 2 and len(kept[0]["input_ids"]) == 8 and kept[0]["input_ids"][0] == tok.bos_token_id
    assert tok.decode(kept[0]["input_ids"], skip_special_tokens=True).endswith("i j Assistant:")
    assert kept[0]["prompt"] == rows[0]["prompt"] and report.truncated == {"train": 1}, "the row's text: a rule's key"
