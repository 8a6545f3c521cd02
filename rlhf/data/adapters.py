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

# Rows of hub datasets' splits as their dataset cards publish them (the cards' dataset_info / split
# sizes), for the forecast where the hub is unreachable: (hub id, split) -> rows.
PUBLISHED_ROWS = {
    ("Dahoas/rm-static", "train"): 76_256, ("Dahoas/rm-static", "test"): 5_103,
    ("Dahoas/full-hh-rlhf", "train"): 112_052, ("Dahoas/full-hh-rlhf", "test"): 12_451,
    ("Dahoas/synthetic-instruct-gptj-pairwise", "train"): 33_143,
    ("yitingxie/rlhf-reward-datasets", "train"): 76_256, ("yitingxie/rlhf-reward-datasets", "test"): 5_103,
    ("HuggingFaceH4/ultrafeedback_binarized", "train_prefs"): 61_135,
    ("HuggingFaceH4/ultrafeedback_binarized", "test_prefs"): 2_000,
}


def map_columns(columns: dict[str, str]) -> Adapter:
    """An adapter for any table: our column name -> the table's column name."""
    def adapt(row: Row) -> Row:
        return {ours: (row.get(theirs) or "") if theirs else "" for ours, theirs in
                {"prompt": columns.get("prompt"), "chosen": columns.get("chosen"),
                 "rejected": columns.get("rejected")}.items()}

    return adapt


# DeepSpeed-Chat's turn markers: a marker starts the text or follows white space.
_TURN = re.compile(r"(?:^|(?<=\s))(Human|Assistant):")
_ROLES = {"Human": "user", "Assistant": "assistant"}
# Stands for an answer in the probe that finds what a template writes after one.
_PROBE = "\u2063ANSWER\u2063"


def dschat_messages(prompt: str) -> list[dict]:
    """The turns of a prompt in DeepSpeed-Chat's form (" Human: ... Assistant: ... Human: ... Assistant:")
    as role/content messages, less the empty assistant turn it ends with. A prompt that does not end
    with that cue is one user message (a plain question); text before the first marker joins the first
    user message, and consecutive turns of one role are joined, since templates expect user and
    assistant to alternate starting with the user."""
    parts = _TURN.split(prompt)
    preface, turns = parts[0].strip(), list(zip(parts[1::2], parts[2::2], strict=True))
    if not turns or turns[-1][0] != "Assistant" or turns[-1][1].strip():
        return [{"role": "user", "content": prompt.strip()}]
    messages: list[dict] = []
    for marker, text in turns[:-1]:
        role, text = _ROLES[marker], text.strip()
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + text
        else:
            messages.append({"role": role, "content": text})
    if not messages or messages[0]["role"] != "user":
        messages.insert(0, {"role": "user", "content": ""})
    if preface:
        messages[0]["content"] = (preface + "\n\n" + messages[0]["content"]).strip()
    return messages


def chat_tokenizer(tokenizer, mode: str):
    """The tokenizer whose chat template renders prompts and answers (data.chat_template=auto and it has
    one), else None: DeepSpeed-Chat's " Human: ... Assistant:" text (a base model without a template,
    or data.chat_template=none)."""
    if mode == "none" or tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    return tokenizer


class ChatFormat:
    """How one model's prompts and answers are written: through ``tokenizer``'s chat template, or in
    DeepSpeed-Chat's form where ``tokenizer`` is None (see chat_tokenizer). The one rendering that every
    step's data (rlhf.data.blend) and the chat CLI (rlhf.chat) use, so a model is trained, scored and
    talked to on the same text."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        # What the template writes after an answer (Qwen's <|im_end|>, Llama 3's <|eot_id|>), and that
        # less the eos token, which tokenization appends to every answer: what rendered answers end with.
        self.turn_end = self._turn_end() if tokenizer is not None else ""
        eos = getattr(tokenizer, "eos_token", None)
        self.end_of_turn = self.turn_end[: -len(eos)] if eos and self.turn_end.endswith(eos) else self.turn_end
        # A template that writes the bos token itself (Llama 3, Mistral) would get a second one from
        # the tokenizer, which adds it to every prompt it encodes; the rendered text leaves it out.
        bos = getattr(tokenizer, "bos_token", None)
        self.drop_bos = bool(bos) and tokenizer("x").input_ids[:1] == [tokenizer.bos_token_id]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as err:  # the template's own check (roles out of order, a role it lacks)
            raise ValueError(f"the tokenizer's chat template refused the turns "
                             f"{[m['role'] for m in messages]}: {err}") from None

    def _turn_end(self) -> str:
        # The answer must end with it for the model to learn to close its turn. Trailing white space
        # opens the next turn.
        text = self._render([{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}], False)
        return text.split(_PROBE, 1)[1].rstrip() if _PROBE in text else ""

    def prompt(self, messages: list[dict]) -> str:
        """The text before the model's answer to these turns (the last one the user's)."""
        if self.tokenizer is None:
            turns = {"user": " Human: ", "assistant": " Assistant: ", "system": " "}
            return "".join(turns.get(m["role"], " ") + m["content"].strip() for m in messages) + " Assistant:"
        text = self._render(messages, True)
        if self.drop_bos and text.startswith(self.tokenizer.bos_token):
            text = text[len(self.tokenizer.bos_token):]
        return text

    def answer(self, text: str) -> str:
        """An answer as it follows the prompt: DeepSpeed-Chat's " answer", or the template's content and
        end of turn (an empty answer stays empty: the data report counts it)."""
        if not text or not text.strip():
            return ""
        return _answer(text) if self.tokenizer is None else text.strip() + self.end_of_turn

    def content(self, text: str) -> str:
        """An answer as a rule reads it: the text before the template's end of turn, without it
        (DeepSpeed-Chat's form, which has none, as it is)."""
        if self.tokenizer is None:
            return text
        for marker in (self.turn_end, self.end_of_turn):
            if marker and marker in text:
                text = text.split(marker, 1)[0]
        return text.strip()

    def row(self, row: Row) -> Row:
        """A row in DeepSpeed-Chat's form (what the adapters write) in this format."""
        if self.tokenizer is None:
            return row

        def text(value, render):  # a value that is not text is left for the data report to count
            return render(value) if isinstance(value, str) and value.strip() else value

        return {**row, "prompt": text(row["prompt"], lambda p: self.prompt(dschat_messages(p))),
                "chosen": text(row["chosen"], self.answer), "rejected": text(row["rejected"], self.answer)}


def render_conversation(messages: list[dict], tokenizer=None, fmt: ChatFormat | None = None) -> tuple[str, str]:
    """(prompt, answer) from role/content messages ending with the assistant's answer: through the
    tokenizer's chat template when it has one, else in DeepSpeed-Chat's " Human: ... Assistant:" form."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("a conversation must end with an assistant message (the answer)")
    fmt = fmt or ChatFormat(chat_tokenizer(tokenizer, "auto"))
    return fmt.prompt(messages[:-1]), fmt.answer(messages[-1]["content"])


def adapt_rows(rows: list[Row], name: str) -> list[Row]:
    """Apply a registered adapter to rows (used on the fixtures in tests and inside load_source)."""
    return [ADAPTERS[name](r) for r in rows]
