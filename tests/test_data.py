"""Shipped synthetic data, the rule, DeepSpeed-Chat's split, weighted blends and bad rows."""

from __future__ import annotations

import json
import re

import pytest
from datasets import Dataset

from rlhf.config import DataConfig, SourceConfig
from rlhf.data import synthetic
from rlhf.data.blend import DataReport, blend, heldout_split, load_step_data, split_part
from rlhf.data.tokenize import IGNORE_INDEX, BadRowError, PadCollator, sft_dataset
from rlhf.rewards.verifiers import math_score
from tests.conftest import ROOT, run_cli

SORT = str(ROOT / "data" / "synthetic" / "sort")


def test_shipped_files_are_what_the_generator_writes(tmp_path):
    synthetic.write(tmp_path, seed=0)
    for task in synthetic.SIZES:
        for split in ("train", "eval"):
            assert (tmp_path / task / f"{split}.jsonl").read_bytes() == \
                (ROOT / "data" / "synthetic" / task / f"{split}.jsonl").read_bytes()


def test_the_numbers_task_s_reference_answers_are_right_by_the_math_rule_and_near_misses_are_not():
    from rlhf.rewards.verifiers import math_score

    rows = [json.loads(line) for line in open(ROOT / "data" / "synthetic" / "numbers" / "train.jsonl")][:500]
    for row in rows:
        kind, numbers = row["prompt"].split(" of ")[0].split()[-1], [int(n) for n in row["prompt"].split(" of ")[1]
                                                                     .split("?")[0].split(", ")]
        assert row["answer"] == f" {max(numbers) if kind == 'largest' else min(numbers)}" and "rejected" not in row
        assert math_score(row["prompt"], row["answer"], row["answer"]) == 1.0
        assert math_score(row["prompt"], f" {int(row['answer']) + 1}", row["answer"]) == 0.0


def test_the_arithmetic_tasks_are_plain_questions_whose_reference_the_verifier_accepts():
    for task in ("arithmetic", "words"):
        rows = [json.loads(line) for line in open(ROOT / "data" / "synthetic" / task / "eval.jsonl")]
        train = {json.loads(line)["prompt"] for line in open(ROOT / "data" / "synthetic" / task / "train.jsonl")}
        assert len(rows) == synthetic.SIZES[task][1] and not train & {r["prompt"] for r in rows}
        for row in rows[:200]:
            a, b = map(int, re.findall(r"\d+", row["prompt"])[:2])
            assert "Human:" not in row["prompt"]  # a chat model's question, rendered by its own template
            assert math_score(row["prompt"], row["answer"], row["answer"]) == 1.0
            assert math_score(row["prompt"], f"{a} + {b} = {a + b}", row["answer"]) == 1.0
            assert math_score(row["prompt"], f"{a + b + 1}", row["answer"]) == 0.0


@pytest.mark.parametrize("task", [t for t in synthetic.SIZES if t not in synthetic.GENERATORS])
def test_rule_accepts_chosen_rejects_near_misses(task):
    rows = [json.loads(line) for line in open(ROOT / "data" / "synthetic" / task / "train.jsonl")][:500]
    for row in rows:
        assert row["prompt"].startswith(" Human: ") and row["prompt"].endswith(" Assistant:")
        assert synthetic.rule_score(row["prompt"], row["chosen"]) == 1.0
        assert synthetic.rule_score(row["prompt"], row["rejected"]) == 0.0
        # A near miss keeps the answer's form: a few letters (or one number), never random text.
        n = len(row["chosen"].split())
        assert n - 1 <= len(row["rejected"].split()) <= n + 1
        assert all(w.isalpha() and len(w) == 1 or w.isdigit() for w in row["rejected"].split())


def test_sort_near_misses_include_the_policy_s_neighbour_letter_mistakes():
    """The mistake SFT policies make most (a letter replaced by its alphabet neighbour) must be common
    among the rejected answers, or the reward model never learns it and PPO learns to make it."""
    rows = [json.loads(line) for line in open(ROOT / "data" / "synthetic" / "sort" / "train.jsonl")][:2000]
    neighbour = 0
    for row in rows:
        chosen, rejected = row["chosen"].split(), row["rejected"].split()
        diff = [(a, b) for a, b in zip(chosen, rejected, strict=False) if a != b]
        args = synthetic.parse_prompt(row["prompt"])[1]
        if len(chosen) == len(rejected) and len(diff) == 1 and diff[0][1] not in args:
            neighbour += 0 < abs(ord(diff[0][0]) - ord(diff[0][1])) <= synthetic.NEAR
    assert 0.25 < neighbour / len(rows) < 0.45, neighbour / len(rows)


def test_rule_by_hand():
    p = " Human: sort d b a c Assistant:"
    assert synthetic.rule_score(p, " a b c d") == 1.0
    assert synthetic.rule_score(p, "a  b c d ") == 1.0
    assert synthetic.rule_score(p, " a c b d") == 0.0
    assert synthetic.rule_score(p, "") == 0.0
    assert synthetic.rule_score(" Human: add 27 6 Assistant:", " 33") == 1.0
    assert synthetic.rule_score(" Human: reverse a b c d Assistant:", " d c b a") == 1.0
    with pytest.raises(ValueError, match="not a prompt"):
        synthetic.rule_score("hello", "x")


def test_train_and_eval_prompts_are_disjoint():
    for task in synthetic.SIZES:
        folder = ROOT / "data" / "synthetic" / task
        train = {json.loads(line)["prompt"] for line in open(folder / "train.jsonl")}
        evals = {json.loads(line)["prompt"] for line in open(folder / "eval.jsonl")}
        assert not train & evals


def _cfg(**kw) -> DataConfig:
    return DataConfig(name="t", sources=[SourceConfig(path=SORT)], **kw)


def test_split_parts_are_disjoint_cover_all_and_are_deterministic():
    from datasets import Dataset

    ds = Dataset.from_dict({"i": list(range(1000))})
    parts = [list(split_part(ds, [0.2, 0.4, 0.4], k, seed=7)["i"]) for k in range(3)]
    assert [len(p) for p in parts] == [200, 400, 400]
    assert set(parts[0]).isdisjoint(parts[1]) and set(parts[1]).isdisjoint(parts[2])
    assert sorted(parts[0] + parts[1] + parts[2]) == list(range(1000))
    assert list(split_part(ds, [0.2, 0.4, 0.4], 1, seed=7)["i"]) == parts[1]
    assert list(split_part(ds, [0.2, 0.4, 0.4], 1, seed=8)["i"]) != parts[1]


def test_held_out_rows_split_by_prompt_into_a_select_and_a_report_half():
    """Rules select on one half of the distinct prompts, figures are reported on the other: no prompt
    in both, every row of a prompt in one half, and the halves do not move with the cap (every step of
    a chain selects on the same prompts whatever its own cap)."""
    prompts = ["a", "b", "a", "c", "d", "e", "b", "f", "g"]  # 7 distinct: halves of 3, one prompt in neither
    select, report = heldout_split(prompts, seed=1234)
    chosen, reported = {prompts[i] for i in select}, {prompts[i] for i in report}
    assert len(chosen) == len(reported) == 3 and not chosen & reported
    assert select == [i for i, p in enumerate(prompts) if p in chosen]  # every row of a chosen prompt
    assert report == [i for i, p in enumerate(prompts) if p in reported]
    select2, report2 = heldout_split(prompts, seed=1234, cap=2)
    assert len({prompts[i] for i in select2}) == len({prompts[i] for i in report2}) == 2
    assert set(select2) <= set(select) and set(report2) <= set(report)
    assert heldout_split(["only"], seed=1234) == ([], [])
    assert heldout_split(prompts, seed=1234) == (select, report), "the same seed, the same halves"


def test_held_out_halves_are_shuffled_so_both_draw_from_every_source_of_a_blend():
    """Eval rows come source by source; halves in file order would select on the first source and
    report on the second. Shuffled by the data seed, each half holds both; the halves depend on the
    count of distinct prompts and the seed only, so a chain's steps (prompt text in one, prompt token
    ids in another) split alike."""
    prompts = [f"first source {i}" for i in range(100)] + [f"second source {i}" for i in range(100)]
    for seed in range(5):
        select, report = heldout_split(prompts, seed)
        for half in (select, report):
            share = sum(i < 100 for i in half) / len(half)
            assert 0.3 < share < 0.7, (seed, share)
        as_ids = [tuple(ord(c) for c in p) for p in prompts]
        assert heldout_split(as_ids, seed) == (select, report)
    assert heldout_split(prompts, 0) != heldout_split(prompts, 1)


def test_step_parts_of_the_shipped_blend_are_disjoint():
    prompts = {}
    for step in ("sft", "reward", "ppo"):
        train, _ = load_step_data(_cfg(), step, DataReport())
        prompts[step] = set(train["prompt"])
    assert len(prompts["sft"]) == 8000 and len(prompts["reward"]) == 16000
    assert not prompts["sft"] & prompts["reward"] and not prompts["reward"] & prompts["ppo"]


def test_blend_weights_sample_in_proportion():
    from datasets import Dataset

    a = Dataset.from_dict({"src": ["a"] * 300})
    b = Dataset.from_dict({"src": ["b"] * 300})
    out, counts = blend([a, b], [3.0, 1.0], seed=0, total=400)
    assert counts == [300, 100]
    assert list(out["src"]).count("a") == 300
    # A weight asking for more rows than the part has repeats it instead of failing.
    out, counts = blend([a, b], [9.0, 1.0], seed=0, total=600)
    assert counts == [540, 60] and list(out["src"]).count("a") == 540


class _Tok:
    """A whitespace tokenizer with the calling convention of HF tokenizers, for hand-checked ids."""

    eos_token_id, pad_token_id, bos_token_id = 2, 0, 1

    def __call__(self, text, add_special_tokens=True):
        ids = [10 + len(w) for w in text.split()]
        return type("E", (), {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids})


def _rows(*triples):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [t[0] for t in triples], "chosen": [t[1] for t in triples],
                              "source": ["s.jsonl"] * len(triples), "row": list(range(len(triples)))})


def test_sft_labels_mask_the_prompt():
    ds = sft_dataset(_rows(("a bb", "ccc")), _Tok(), 16, "answer", DataReport(), "train")
    assert ds[0]["input_ids"] == [1, 11, 12, 13, 2]
    assert ds[0]["labels"] == [IGNORE_INDEX] * 3 + [13, 2]
    ds = sft_dataset(_rows(("a bb", "ccc")), _Tok(), 16, "all", DataReport(), "train")
    assert ds[0]["labels"] == [1, 11, 12, 13, 2]


def test_bad_rows_are_dropped_and_counted():
    report = DataReport()
    ds = sft_dataset(_rows(("a", "b"), ("", "b"), ("a", " "), ("a " * 20, "b")), _Tok(), 8, "answer", report, "train")
    assert len(ds) == 1
    assert report.dropped["train"] == {"empty prompt": 1, "empty answer": 1, "longer than step.max_seq_len=8": 1}


def test_bad_row_error_names_source_row_and_column():
    with pytest.raises(BadRowError, match=r"bad row in s.jsonl, row 2, column 'chosen': empty answer"):
        sft_dataset(_rows(("a", "b"), ("a", "")), _Tok(), 8, "answer", DataReport(), "train", on_bad_row="error")


def test_collator_pads_right():
    batch = PadCollator(0)([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [1], "labels": [1]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [1, -100, -100]]


def _pairs(*triples):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [t[0] for t in triples], "chosen": [t[1] for t in triples],
                              "rejected": [t[2] for t in triples], "source": ["p.jsonl"] * len(triples),
                              "row": list(range(len(triples)))})


def test_pairs_drop_and_count_bad_rows():
    from rlhf.data.tokenize import pair_dataset

    report = DataReport()
    ds = pair_dataset(_pairs(("a", "b c", "c b"), ("a", "b", " b "), ("a", "", "b"), ("a", "b", "c " * 20),
                             ("", "b", "c")), _Tok(), 8, report, "train")
    assert len(ds) == 1
    # The whitespace tokenizer maps words by length, so both sides read [bos, a, b, c, eos].
    assert ds[0]["chosen_ids"] == ds[0]["rejected_ids"] == [1, 11, 11, 11, 2]
    assert report.dropped["train"] == {"chosen equals rejected": 1, "empty answer": 1,
                                       "longer than step.max_seq_len=8": 1, "empty prompt": 1}


def test_pair_bad_row_error_names_the_row():
    from rlhf.data.tokenize import pair_dataset

    with pytest.raises(BadRowError, match=r"bad row in p.jsonl, row 1, column 'rejected': chosen equals rejected"):
        pair_dataset(_pairs(("a", "b", "b")), _Tok(), 8, DataReport(), "train", on_bad_row="error")


def test_pair_collator_lines_up_chosen_then_rejected():
    from rlhf.data.tokenize import PairCollator

    batch = PairCollator(0)([{"chosen_ids": [1, 5, 2], "rejected_ids": [1, 6, 7, 2]}])
    assert batch["input_ids"].tolist() == [[1, 5, 2, 0], [1, 6, 7, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


def test_candidate_answers_hold_one_right_answer():
    import random

    cands = synthetic.candidate_answers(" Human: sort d b a c Assistant:", 6, random.Random(0))
    assert len(cands) == 6 and [a for a, s in cands if s == 1.0] == [" a b c d"]
    assert all(synthetic.rule_score(" Human: sort d b a c Assistant:", a) == s for a, s in cands)


def test_tokenized_cache_hits_and_misses_on_every_keyed_setting(tmp_path):
    import os
    import shutil

    from rlhf.config import ModelConfig
    from rlhf.data.cache import cached_step_data
    from rlhf.models import load_tokenizer, resolve_path

    src = tmp_path / "src"
    src.mkdir()
    for split in ("train", "eval"):
        lines = open(ROOT / "data" / "synthetic" / "sort" / f"{split}.jsonl").readlines()[:200]
        (src / f"{split}.jsonl").write_text("".join(lines))
    tok = load_tokenizer(resolve_path(ModelConfig(name="tiny-llama", random_init=True)))

    def load(cfg: DataConfig, max_len: int = 64):
        report = DataReport()
        train, eval_ds, prompts = cached_step_data(
            "sft", cfg, tok, {"max_seq_len": max_len}, report,
            lambda rows, split, rep: sft_dataset(rows, tok, max_len, "answer", rep, split))
        return report.cache["hit"], train, report

    cfg = DataConfig(name="t", sources=[SourceConfig(path=str(src))])
    hit, first, report = load(cfg)
    assert not hit and report.sources and len(first) == 40  # 2/10 of 200 rows
    hit, again, _ = load(cfg)
    assert hit and again["input_ids"] == first["input_ids"]
    assert not load(cfg, max_len=32)[0], "a length setting is part of the key"
    assert not load(DataConfig(name="t", sources=[SourceConfig(path=str(src))], seed=7))[0], "so is the split seed"
    os.utime(src / "train.jsonl", ns=(1, 1))
    assert not load(cfg)[0], "and the source files"
    tok.chat_template = "{{ messages }}"
    assert not load(cfg)[0], "and the tokenizer with its chat template"
    shutil.rmtree(src)


def _folder(tmp_path, train_text: str, name: str = "train.jsonl"):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / name).write_text(train_text)
    good = json.dumps({"prompt": " Human: hi Assistant:", "chosen": " yes", "rejected": " no"})
    (folder / "eval.jsonl").write_text(good + "\n")
    return folder, good


def test_a_line_that_is_not_json_is_named_or_dropped_and_counted(tmp_path):
    from rlhf.config import DataConfig, DataError, SourceConfig
    from rlhf.data.blend import load_step_data

    folder, good = _folder(tmp_path, "\n".join([good_row := json.dumps({"prompt": " Human: a Assistant:",
                                                                        "chosen": " b", "rejected": " c"}),
                                                 "{not json", good_row, "[1, 2]", good_row]) + "\n")
    cfg = DataConfig(name="mine", sources=[SourceConfig(path=str(folder))], split="1,1,1", on_bad_row="error")
    with pytest.raises(DataError, match=rf"{folder / 'train.jsonl'}, line 2: not a JSON object \(2 such line"):
        load_step_data(cfg, "sft", DataReport())
    cfg.on_bad_row = "drop"
    report = DataReport()
    train, _ = load_step_data(cfg, "reward", report)
    assert report.dropped["source"] == {f"{folder / 'train.jsonl'}: not a JSON object (line 2, 4)": 2}
    assert report.sources[str(folder)]["train_rows"] == 3


def test_dropped_rows_are_said_on_the_console_with_file_and_line(tmp_path):
    rows = [json.dumps({"prompt": f" Human: sort {c} a Assistant:", "chosen": f" a {c}", "rejected": f" {c} a"})
            for c in "bcdefghijklmnopqrstuvwxyz" * 4]
    folder, _ = _folder(tmp_path, "\n".join([*rows[:3], "{broken", *rows[3:]]) + "\n")
    proc = run_cli(f"data.sources=[{{path: {folder}}}]", "step.max_steps=2", "logging.progress_bar=false",
                   f"run_dir={tmp_path / 'run'}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (f"[sft] rows dropped (data.on_bad_row=drop; data_report.json): 1 source: {folder / 'train.jsonl'}: "
            "not a JSON object (line 4)") in proc.stdout, proc.stdout[-2000:]


def test_an_empty_train_file_and_a_number_for_text_are_named(tmp_path):
    from rlhf.config import DataConfig, DataError, SourceConfig
    from rlhf.data.blend import load_step_data

    folder, _ = _folder(tmp_path, "")
    cfg = DataConfig(name="mine", sources=[SourceConfig(path=str(folder))])
    with pytest.raises(DataError, match=rf"{folder / 'train.jsonl'} holds no rows \(empty\)"):
        load_step_data(cfg, "sft", DataReport())
    with pytest.raises(BadRowError, match=r"row 1, column 'chosen': answer is a int, not text"):
        sft_dataset(Dataset.from_dict({"prompt": ["p"], "chosen": [7], "source": ["f.jsonl"], "row": [0]}), _Tok(), 8,
                    "answer", DataReport(), "train", on_bad_row="error")


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_bad_data_is_one_line_and_exit_code_2_on_the_command_line(tmp_path, ranks):
    """With two ranks the error surfaces inside the ranks: still one line, exit 2, no rank tracebacks
    (the rank waiting at a barrier for the one that stopped included)."""
    from tests.conftest import free_port, run_cli

    folder, _ = _folder(tmp_path, '{"prompt": " Human: a Assistant:", "chosen": " b", "rejected": " c"}\n{oops\n')
    extra = ["hardware=cpu-2rank", f"launch.master_port={free_port()}"] if ranks == 2 else []
    proc = run_cli("step=sft", f"data.sources=[{{path: {folder}}}]", "data.on_bad_row=error", *extra,
                   f"run_dir={tmp_path / 'run'}", timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = f"data error: {folder / 'train.jsonl'}, line 2: not a JSON object"
    assert (proc.stdout + proc.stderr).count(line) == 1
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_sources_split_does_not_depend_on_where_the_checkout_or_folder_lives(tmp_path):
    """A fresh clone elsewhere must split the data as this checkout does (the split seed once hashed
    the absolute path, so the same command gave other numbers in another folder)."""
    from rlhf.data.blend import _seed_for

    assert _seed_for(42, "/work/main/data/synthetic/sort") == _seed_for(42, str(tmp_path / "synthetic" / "sort"))
    assert _seed_for(42, "/a/sort") != _seed_for(42, "/a/reverse") != _seed_for(43, "/a/reverse")
