"""Prompts with a checkable answer: the shipped verifiers (math, exact) on hand-worked answers, rows of
{prompt, answer} (and GSM8K's, MATH's and conversations' shapes) through the data path, a rule that
receives the reference answer, the pairwise steps' refusal of such a source, and pipeline=rlvr end to end.

    python -m pytest -q tests/test_verifiers.py
"""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest
from conftest import compose, run_cli

from rlhf import rewards
from rlhf.config import DataError, to_schema
from rlhf.data.blend import DataReport, data_rule, load_step_data, references
from rlhf.launch import run
from rlhf.rewards.verifiers import as_number, final_answer, math_score

QUIET = ["logging.progress_bar=false", "data.max_eval_samples=64"]


@pytest.mark.parametrize(("answer", "reference", "right"), [
    (" 72", "Natalia sold 48/2 = 24 clips in May. 48+24 = 72 #### 72", True),   # GSM8K's reference
    (" so the total is 1,000.", "#### 1000", True),                              # thousands, prose around it
    (" 71", "#### 72", False),
    (" -3", " -3", True),
    (" 0.5", "$\\boxed{\\frac{1}{2}}$", True),                                   # MATH's reference
    (" \\boxed{\\dfrac{3}{4}}", "\\boxed{0.75}", True),
    (" 50%", "#### 0.5", True),
    (" \\boxed{x + 1}", "the answer is \\boxed{X+1}", True),                     # an expression: as text
    (" \\boxed{x + 2}", "\\boxed{x+1}", False),
    (" no idea", "#### 5", False),
    (" The answer is 25%.", "What percent? 10/40 = 25% #### 25", True),           # GSM8K's percent questions
    (" \\boxed{25\\%}", "#### 25", True),
    (" 25 %", "#### 25", True),
    (" 25%", "#### 0.25", True),
    (" 2.5%", "#### 25", False),
    (" -50%", "#### -50", True),
    (" #### Step 1\nHer 3 bags hold 6 each.\n#### Step 2\n\\boxed{18} for her 2 kids", "#### 18", True),  # headings
    (" #### 18 apples in 2 baskets", "#### 18", True),                           # the first number after the marker
    (" #### Step 2: she has 18", "#### 18", True),                               # a heading only: the last number
    (" #### Step 1\n\\boxed{17} for her 2 kids", "#### 18", False),
])
def test_the_math_verifier_on_hand_worked_answers(answer, reference, right):
    assert math_score("prompt", answer, reference) == float(right)


def test_final_answers_and_numbers():
    assert final_answer("a \\boxed{\\frac{a}{b}} c") == "\\frac{a}{b}"
    assert final_answer("work #### 12") == "12" and final_answer(" 7") == "7"
    assert as_number("\\frac{6}{8}") == as_number("0.75") == as_number("3/4")
    assert as_number("no number") is None
    assert as_number("25%") == 25 and as_number("\\frac{1}{2}%") == Fraction(1, 2)
    assert final_answer("#### Step 1\nwork\n\\boxed{7} in all #### Step 2") == "7"


def _folder(tmp_path, rows_train, rows_eval, name="qa"):
    data = tmp_path / name
    data.mkdir()
    for split, rows in (("train", rows_train), ("eval", rows_eval)):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def _qa(n, offset=0):
    return [{"prompt": f" Human: What is {i} + {i}? Assistant:", "answer": f" {2 * i}"} for i in range(offset, offset + n)]


def test_prompt_and_answer_rows_serve_sft_and_ppo_and_the_pairwise_steps_refuse_them(tmp_path):
    data = _folder(tmp_path, _qa(50), _qa(10, 100))
    cfg = to_schema(compose([f"data.sources=[{{path: {data}}}]", "data.rule=math"])).data
    train, evals = load_step_data(cfg, "sft", DataReport())
    assert train[0]["chosen"].strip().isdigit() and not any(train["rejected"])
    assert len(load_step_data(cfg, "ppo", DataReport())[0]) > 0
    for step in ("reward", "dpo", "simpo", "kto"):
        with pytest.raises(DataError, match=rf"data.sources\[0\] \({data}\) has no rejected answers "
                                            rf"\(prompt-and-answer rows\): step {step} learns from preference pairs"):
            load_step_data(cfg, step, DataReport())
    # The rule gets each prompt's reference answer, train and eval rows alike.
    table = references(cfg)
    assert table[" Human: What is 3 + 3? Assistant:"] == " 6" and table[" Human: What is 105 + 105? Assistant:"] == " 210"
    rule = data_rule(cfg, evals["prompt"])
    assert rule(" Human: What is 105 + 105? Assistant:", " 210") == 1.0
    assert rule(" Human: What is 105 + 105? Assistant:", " 211") == 0.0
    with pytest.raises(RuntimeError, match="no row of the data has one for prompt ' Human: What is 7 - 1"):
        rule(" Human: What is 7 - 1? Assistant:", " 6")


def test_left_truncated_prompts_are_scored_against_their_rows_references(tmp_path):
    """data.long_prompts=truncate_left cuts a long prompt to its last tokens; the rule still finds the
    row's reference answer (it once looked up the cut text, found none and blamed the data)."""
    filler = " ".join(["context"] * 40)
    rows = [{"prompt": f" Human: {filler} What is {i} + {i}? Assistant:", "answer": f" {2 * i}"} for i in range(24)]
    data = _folder(tmp_path, rows, rows[:8])
    final = run(compose(["step=ppo", "actor.random_init=true", f"data.sources=[{{path: {data}}}]", "data.rule=math",
                         "data.long_prompts=truncate_left",
                         "step.reward_fn=rule", "step.reward_model_weight=0", "step.advantage_estimator=grpo",
                         "step.samples_per_prompt=4", "step.rollout_batch_size_per_device=8",
                         "step.micro_batch_size_per_device=8", "step.max_steps=2", "step.max_prompt_len=16",
                         "step.eval_prompts=8", "step.eval_every_steps=0", "step.keep_best=false", *QUIET,
                         f"run_dir={tmp_path / 'run'}"]))
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["truncated"]["train"] > 0 and "eval/accuracy" in final


def test_a_budget_too_short_for_the_data_s_answers_is_refused_in_the_dry_run_naming_the_key(tmp_path):
    """Worked answers of 20-30 tokens ('... #### n') under the rlvr chain's 8-token budgets: every
    generated answer would be cut before its final number and judged wrong. The dry-run refuses each
    step that generates, naming its chain key and a budget that holds them; with that budget it starts."""
    def row(i):
        return {"prompt": f" Human: What is {i} + {i}? Assistant:",
                "answer": f" We add {i} and {i} one step at a time: {i} plus {i} makes {2 * i}. #### {2 * i}"}
    data = _folder(tmp_path, [row(i) for i in range(60)], [row(i) for i in range(100, 120)])
    base = ["pipeline=rlvr", f"data.sources=[{{path: {data}}}]", "data.rule=math", "launch.dry_run=true",
            f"run_dir={tmp_path / 'chain'}"]
    proc = run_cli(*base, timeout=600)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = proc.stdout.strip().splitlines()[-1]
    for step in ("sft", "ppo"):
        found = re.search(rf"pipeline\.{step}\.step\.max_new_tokens=8 holds only 0% of the data's 80 reference answers "
                          rf"whole \((\d+) tokens with the end of the answer hold 90% .* Set pipeline\.{step}\.step\.max_new_tokens=(\d+)", verdict)
        assert found and 20 <= int(found.group(1)) <= int(found.group(2)) < int(found.group(1)) + 8, verdict
    fixes = re.findall(r"Set (pipeline\.\w+\.step\.max_new_tokens=\d+)", verdict)
    again = run_cli(*base, *fixes, timeout=600)
    assert len(fixes) == 2 and again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]


def test_a_users_rule_with_a_reference_parameter_receives_it_and_a_two_argument_rule_still_works(tmp_path, monkeypatch):
    data = _folder(tmp_path, _qa(20), _qa(5, 100))
    (tmp_path / "my_rules.py").write_text(
        "def with_ref(prompt, answer, reference):\n    return float(answer.strip() == reference.strip()) * 2.0\n"
        "def plain(prompt, answer):\n    return float(len(answer))\n")
    monkeypatch.chdir(tmp_path)
    cfg = to_schema(compose([f"data.sources=[{{path: {data}}}]", "data.rule=my_rules:with_ref"])).data
    rule = data_rule(cfg, [])
    assert rule(" Human: What is 4 + 4? Assistant:", " 8") == 2.0
    assert rule(" Human: What is 4 + 4? Assistant:", " 9") == 0.0
    plain = rewards.task_rule("my_rules:plain", [])
    assert plain("anything", "abc") == 3.0


def test_gsm8k_math_and_conversation_rows_map_to_a_prompt_and_its_reference(tmp_path):
    gsm = _folder(tmp_path, [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7 #### 7"}] * 3,
                  [{"question": "2 times 6?", "answer": "2*6=12 #### 12"}], "gsm")
    hendrycks = _folder(tmp_path, [{"problem": "Compute $1/2+1/4$.", "solution": "It is $\\boxed{\\frac{3}{4}}$."}] * 3,
                        [{"problem": "What is $2^3$?", "solution": "$\\boxed{8}$"}], "math")
    chats = _folder(tmp_path, [{"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}] * 3,
                    [{"messages": [{"role": "user", "content": "What is 3 + 3?"}], "answer": "6"}], "chats")
    for folder, adapter, prompt, answer in (
            (gsm, "openai/gsm8k", " Human: 2 times 6? Assistant:", " 12"),
            (hendrycks, "hendrycks/competition_math", " Human: What is $2^3$? Assistant:", " 8"),
            (chats, None, " Human: What is 3 + 3? Assistant:", " 6")):
        source = f"{{path: {folder}" + (f", adapter: {adapter}}}" if adapter else "}")
        cfg = to_schema(compose([f"data.sources=[{source}]", "data.rule=math"])).data
        evals = load_step_data(cfg, "sft", DataReport())[1]
        assert evals["prompt"] == [prompt], evals["prompt"]
        rule = data_rule(cfg, evals["prompt"])
        assert rule(prompt, answer) == 1.0 and rule(prompt, " 13") == 0.0


def test_rlvr_chain_trains_grpo_against_the_verifier_without_a_reward_model(tmp_path):
    """pipeline=rlvr at tiny scale: SFT on the reference answers, then GRPO rewarded by `math` against
    each prompt's reference; no reward model or critic is trained or built."""
    overrides = ["pipeline=rlvr", *QUIET, f"run_dir={tmp_path}", "pipeline.sft.step.max_steps=5",
                 "pipeline.ppo.step.max_steps=2", "pipeline.ppo.step.rollout_batch_size_per_device=16",
                 "pipeline.ppo.step.micro_batch_size_per_device=8", "pipeline.ppo.step.eval_prompts=8",
                 "pipeline.on_weak_step=warn"]
    result = run(compose(overrides), overrides=overrides)
    assert set(result["outputs"]) == {"sft", "ppo"} and not (tmp_path / "reward").exists()
    final = json.loads((tmp_path / "ppo" / "final_metrics.json").read_text())
    assert final["step"] == 2 and "eval/accuracy" in final and not (tmp_path / "ppo" / "critic").exists()
    rows = [json.loads(x) for x in open(tmp_path / "ppo" / "metrics.jsonl") if "rollout/rule_accuracy" in x]
    assert rows and all(r["reward/score_mean"] == pytest.approx(r["rollout/rule_accuracy"]) for r in rows)
