"""Adapters from the datasets DeepSpeed-Chat knows (its raw_datasets.py) to our common columns.

Each adapter maps one row of the dataset's own layout to ``prompt`` (in the " Human: ...
Assistant:" convention), ``chosen`` (the preferred answer, used for SFT too; for prompts with a
checkable answer, the reference a rule compares against) and ``rejected`` ("" where the dataset has
no second answer: such rows serve SFT and PPO; the pairwise steps drop them, and refuse a source that
has none). The registry key is the hub id, so ``data.sources=[{path: Dahoas/rm-static}]`` works
unchanged; a local copy in the same layout uses ``adapter: Dahoas/rm-static``. Any other file maps
its columns with ``columns: {prompt: question, chosen: answer}``.

    python launch.py step=reward 'data.sources=[{path: Dahoas/rm-static, eval_split: test}]'
"""

from __future__ import annotations

import re
from collections.abc import Callable

Row = dict
Adapter = Callable[[Row], Row]


def _human(text: str) -> str:
    return f" Human: {text.strip()} Assistant:"


def _answer(text: str) -> str:
    return " " + text.strip() if text and text.strip() else ""


def _rm_static(row: Row) -> Row:
    # Already " \n\nHuman: ... \n\nAssistant:" prompts and " ..." answers.
    return {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"]}


def _gptj_pairwise(row: Row) -> Row:
    return {"prompt": _human(row["prompt"]), "chosen": _answer(row["chosen"]), "rejected": _answer(row["rejected"])}


def _yitingxie(row: Row) -> Row:
    # Prompts end with "Human: ..." and the answers carry the "Assistant:" turn.
    return {"prompt": row["prompt"] + "Assistant:", "chosen": row["chosen"].split("Assistant:")[-1],
            "rejected": row["rejected"].split("Assistant:")[-1]}


_CITATION = re.compile(r"\s*\[\d+(?:,\s*\d+)*\]|\s*\[\^\d+\]")


def _webgpt(row: Row) -> Row:
    # The higher-scored answer is chosen; citation marks like [1] or [1, 2] are removed.
    a, b = _CITATION.sub("", row["answer_0"]), _CITATION.sub("", row["answer_1"])
    chosen, rejected = (a, b) if row["score_0"] >= row["score_1"] else (b, a)
    if row["score_0"] == row["score_1"]:
        rejected = chosen  # a tie teaches nothing: dropped and counted as "chosen equals rejected"
    return {"prompt": _human(row["question"]["full_text"]), "chosen": _answer(chosen), "rejected": _answer(rejected)}


def _shp(row: Row) -> Row:
    a, b = row["human_ref_A"], row["human_ref_B"]
    chosen, rejected = (a, b) if row["labels"] == 1 else (b, a)
    return {"prompt": _human(row["history"]), "chosen": _answer(chosen), "rejected": _answer(rejected)}


def _sharegpt(row: Row) -> Row:
    prompt = row["prompt"].replace("USER:", "Human:").replace("ASSISTANT:", "Assistant:")
    return {"prompt": " " + prompt.strip(), "chosen": _answer(row["label"]), "rejected": ""}


def _zhihu(row: Row) -> Row:
    return {"prompt": _human(row["INSTRUCTION"]), "chosen": _answer(row["RESPONSE"]), "rejected": ""}


def _miracl(row: Row) -> Row:
    pos, neg = row["positive_passages"], row["negative_passages"]
    return {"prompt": _human(row["query"]), "chosen": _answer(pos[0]["text"] if pos else ""),
            "rejected": _answer(neg[0]["text"] if neg else "")}


def _hc3(row: Row) -> Row:
    human = row["human_answers"]
    return {"prompt": _human(row["question"]), "chosen": _answer(human[0] if human else ""), "rejected": ""}


def _mkqa(lang: str) -> Adapter:
    def adapt(row: Row) -> Row:
        answers = row["answers"][lang]
        text = answers[0]["text"] if answers and answers[0].get("text") else ""
        return {"prompt": _human(row["queries"][lang]), "chosen": _answer(text), "rejected": ""}

    return adapt


def _qg_jaquad(row: Row) -> Row:
    return {"prompt": _human(row["question"]), "chosen": _answer(row["sentence"]), "rejected": ""}


def _qag_jaquad(row: Row) -> Row:
    return {"prompt": _human(row["questions"][0]), "chosen": _answer(row["paragraph"]), "rejected": ""}


def _gsm8k(row: Row) -> Row:
    # A grade-school word problem; the answer is the worked solution ending in "#### <number>", which
    # SFT learns and the `math` rule reads the final number of.
    return {"prompt": _human(row["question"]), "chosen": _answer(row["answer"]), "rejected": ""}


def _math(row: Row) -> Row:
    # A competition problem; the solution marks its final answer with \\boxed{} (the `math` rule).
    return {"prompt": _human(row["problem"]), "chosen": _answer(row["solution"]), "rejected": ""}


def _local_jsonfile(row: Row) -> Row:
    return {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row.get("rejected") or ""}


ADAPTERS: dict[str, Adapter] = {
    "Dahoas/rm-static": _rm_static,
    "Dahoas/full-hh-rlhf": _rm_static,
    "Dahoas/synthetic-instruct-gptj-pairwise": _gptj_pairwise,
    "yitingxie/rlhf-reward-datasets": _yitingxie,
    "openai/webgpt_comparisons": _webgpt,
    "stanfordnlp/SHP": _shp,
    "pvduy/sharegpt_alpaca_oa_vicuna_format": _sharegpt,
    "wangrui6/Zhihu-KOL": _zhihu,
    "Cohere/miracl-zh-queries-22-12": _miracl,
    "Cohere/miracl-ja-queries-22-12": _miracl,
    "Hello-SimpleAI/HC3-Chinese": _hc3,
    "mkqa-Chinese": _mkqa("zh_cn"),
    "mkqa-Japanese": _mkqa("ja"),
    "lmqg/qg_jaquad": _qg_jaquad,
    "lmqg/qag_jaquad": _qag_jaquad,
    "local/jsonfile": _local_jsonfile,
    # Prompts with a checkable answer (no rejected answers: SFT and PPO/GRPO against data.rule=math).
    "openai/gsm8k": _gsm8k,
    "hendrycks/competition_math": _math,
    "DigitalLearningGmbH/MATH-lighteval": _math,
}
# The dataset configuration a hub id needs (load_dataset's second argument).
HUB_CONFIGS = {"openai/gsm8k": "main"}
# Hub datasets whose id differs from the adapter name (DeepSpeed-Chat's names for mkqa's languages).
HUB_IDS = {"mkqa-Chinese": "mkqa", "mkqa-Japanese": "mkqa"}
# Splits DeepSpeed-Chat evaluates on, where a dataset has one ("train" only: the split carves eval rows).
EVAL_SPLITS = {"Dahoas/rm-static": "test", "Dahoas/full-hh-rlhf": "test",
               "yitingxie/rlhf-reward-datasets": "test", "stanfordnlp/SHP": "validation",
               "pvduy/sharegpt_alpaca_oa_vicuna_format": "test", "lmqg/qg_jaquad": "validation",
               "lmqg/qag_jaquad": "validation", "Cohere/miracl-zh-queries-22-12": "dev",
               "Cohere/miracl-ja-queries-22-12": "dev", "openai/gsm8k": "test", "hendrycks/competition_math": "test",
               "DigitalLearningGmbH/MATH-lighteval": "test"}


def map_columns(columns: dict[str, str]) -> Adapter:
    """An adapter for any table: our column name -> the table's column name."""
    def adapt(row: Row) -> Row:
        return {ours: (row.get(theirs) or "") if theirs else "" for ours, theirs in
                {"prompt": columns.get("prompt"), "chosen": columns.get("chosen"),
                 "rejected": columns.get("rejected")}.items()}

    return adapt


def render_conversation(messages: list[dict], tokenizer=None) -> tuple[str, str]:
    """(prompt, answer) from role/content messages ending with the assistant's answer: through the
    tokenizer's chat template when it has one, else in DeepSpeed-Chat's " Human: ... Assistant:" form."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("a conversation must end with an assistant message (the answer)")
    history, answer = messages[:-1], messages[-1]["content"]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True), answer
    turns = {"user": " Human: ", "assistant": " Assistant: ", "system": " "}
    prompt = "".join(turns.get(m["role"], " ") + m["content"].strip() for m in history)
    return prompt + " Assistant:", _answer(answer)


def adapt_rows(rows: list[Row], name: str) -> list[Row]:
    """Apply a registered adapter to rows (used on the fixtures in tests and inside load_source)."""
    return [ADAPTERS[name](r) for r in rows]
