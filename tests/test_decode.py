"""The rollout decode loop against Hugging Face ``generate`` on the same random models: the same
greedy tokens, generate's sampling distribution (temperature, top-k, top-p; drawn by inverse
transform, so other draws than generate's for one seed), eos stopping and padding after it, for
left-padded prompt batches of OPT and LLaMA."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf.config import ModelConfig
from rlhf.generation.decode import accepts, decode, next_tokens
from rlhf.models import load_causal_lm, load_tokenizer, resolve_path

PROMPTS = [" Human: sort d b a c Assistant:", " Human: add 3 4 Assistant:", " Human: reverse a b Assistant:",
           " Human: sort q w e r t y Assistant:"]


def _model(family: str):
    path = resolve_path(ModelConfig(name=f"tiny-{family}", family=family, random_init=True, dropout=0.0))
    tok = load_tokenizer(path)
    tok.padding_side = "left"
    return load_causal_lm(path, tok).eval(), tok


def _hf(model, tok, enc, **kw):
    kw.setdefault("top_k", 0)  # generate's own default is 50; 0 is off, as in ours
    out = model.generate(**enc, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **kw)
    return out[:, enc["input_ids"].shape[1]:]


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_greedy_tokens_match_generate(family):
    model, tok = _model(family)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ours = decode(model, enc["input_ids"], enc["attention_mask"], 8, tok.eos_token_id, tok.pad_token_id)
    theirs = _hf(model, tok, enc, max_new_tokens=8, do_sample=False)
    assert torch.equal(ours, theirs[:, :ours.shape[1]]) and (theirs[:, ours.shape[1]:] == tok.pad_token_id).all()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (0, 0.8), (5, 1.0), (8, 0.7)])
def test_sampling_draws_generate_s_distribution(top_k, top_p):
    """The frequencies of 40000 draws match the probabilities generate's warpers give (temperature,
    top-k, top-p), each within 0.01 (4 standard errors at p = 0.5, more below), and no token outside
    the warped support is ever drawn. top-k draws among the k best only."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(1, 300) * 2
    warped = logits
    warpers = [TemperatureLogitsWarper(1.3), *([TopKLogitsWarper(top_k)] if top_k else []), TopPLogitsWarper(top_p)]
    for warper in warpers:
        warped = warper(None, warped)
    expected = warped.softmax(-1)[0]
    draws = next_tokens(logits.expand(40000, -1), True, 1.3, top_k, top_p)
    freq = torch.bincount(draws, minlength=300).double() / len(draws)
    assert set(draws.unique().tolist()) <= set(expected.nonzero().flatten().tolist())
    assert (freq - expected).abs().max() < 0.01, (freq - expected).abs().max()


def test_sampling_never_draws_a_token_of_zero_probability():
    """Inverse-transform sampling over a distribution with masked tokens at both ends and between:
    100000 draws land only on the three allowed tokens, in proportion."""
    logits = torch.full((100000, 50), float("-inf"))
    logits[:, [3, 20, 48]] = torch.tensor([0.0, 1.0, -1.0])
    torch.manual_seed(1)
    draws = next_tokens(logits, True, 1.0, 0, 1.0)
    assert set(draws.unique().tolist()) == {3, 20, 48}
    freq = torch.bincount(draws, minlength=50)[[3, 20, 48]].double() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.0, 1.0, -1.0]).softmax(-1).double(), atol=0.01)


def test_eos_stops_a_row_and_pads_after_it():
    model, tok = _model("llama")
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():  # make eos the only likely token after the prompt's first answer token
        bias = torch.zeros(model.config.vocab_size)
        bias[tok.eos_token_id] = 50.0
        model.lm_head.bias = torch.nn.Parameter(bias)
    out = decode(model, enc["input_ids"], enc["attention_mask"], 8, tok.eos_token_id, tok.pad_token_id,
                 min_new_tokens=2)
    assert out.shape[1] == 3, "every row ended at its eos, so the loop stopped there"
    assert (out[:, 2] == tok.eos_token_id).all() and (out[:, :2] != tok.eos_token_id).all()


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_lora_wrapped_model_decodes_and_scores_like_the_bare_one(family):
    """PEFT's forward takes **kwargs: the loop and the scoring must still hand it position ids (left
    padding) and logits_to_keep, so a fresh adapter (B = 0) changes no token and no logit."""
    from rlhf.config import LoraConfig
    from rlhf.generation.rollout import answer_logits, position_ids
    from rlhf.models import apply_lora

    model, tok = _model(family)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    bare = decode(model, enc["input_ids"], enc["attention_mask"], 8, tok.eos_token_id, tok.pad_token_id)
    seq = torch.cat([enc["input_ids"], bare], dim=1)
    attn = torch.cat([enc["attention_mask"], torch.ones_like(bare)], dim=1)
    pos, start = position_ids(attn), enc["input_ids"].shape[1] - 1
    with torch.no_grad():
        full = model(input_ids=seq, attention_mask=attn, position_ids=pos).logits[:, start:-1]
        assert torch.allclose(answer_logits(model, seq, attn, pos, start), full, atol=1e-5)
        lora = apply_lora(model, LoraConfig(rank=4)).eval()
        assert accepts(lora, "position_ids") and accepts(lora, "logits_to_keep")
        assert torch.equal(decode(lora, enc["input_ids"], enc["attention_mask"], 8, tok.eos_token_id,
                                  tok.pad_token_id), bare)
        assert torch.allclose(answer_logits(lora, seq, attn, pos, start), full, atol=1e-5)


def _config_model(family: str):
    """Small random models of the shapes the family forwards must handle beyond the tiny defaults:
    grouped-query attention and llama3 rope scaling; OPT-350m's post-norm layers with projections
    in and out of a narrower embedding; Qwen2 (LLaMA's layers with q/k/v biases); Qwen3 (a norm over
    each head's query and key); a family without a forward of ours (GPT-2), and Mistral with a sliding
    window shorter than the sequences."""
    from transformers import (
        AutoModelForCausalLM,
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        OPTConfig,
        Qwen2Config,
        Qwen3Config,
    )

    configs = {
        "llama-gqa-rope3": LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 16}),
        "opt-350m-shape": OPTConfig(vocab_size=300, hidden_size=64, word_embed_proj_dim=32, ffn_dim=96,
                                    num_hidden_layers=2, num_attention_heads=4, do_layer_norm_before=False,
                                    max_position_embeddings=64),
        "gpt2": GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64),
        "qwen2": Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        "qwen3": Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64),
        "mistral-window8": MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         sliding_window=8),
    }
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(configs[family], attn_implementation="sdpa").eval()


def _left_padded(vocab: int):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :4], mask[2, :1] = 0, 0
    return ids.masked_fill(mask == 0, 1), mask


@pytest.mark.parametrize("family", ["llama", "opt", "llama-gqa-rope3", "opt-350m-shape", "qwen2"])
def test_own_forward_gives_the_model_s_logits_at_every_step(family):
    """Our family forward (preallocated cache, one attention call per layer) against the model's own
    forward, token by token over a left-padded batch: the same logits to float precision."""
    from rlhf.generation.decode import _model_steps, _own_forward, _own_steps

    model = _model(family)[0] if family in ("llama", "opt") else _config_model(family)
    ids, mask = _left_padded(model.config.vocab_size)
    own = _own_forward(model)
    assert own is not None, "this family has a forward of ours"
    ours, theirs = _own_steps(own, ids, mask, 6), _model_steps(model, ids, mask)
    tok = None
    with torch.no_grad():
        for _ in range(6):
            a, b = ours(tok), theirs(tok)
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
            tok = b.argmax(-1)


@pytest.mark.parametrize("family", ["gpt2", "mistral-window8"])
def test_a_family_without_our_forward_decodes_through_its_own(family, capsys):
    """GPT-2 has no forward of ours; Mistral's has none where its sliding window (8) is shorter than
    prompt + answer (16): ours would attend past the window. Both decode through the model's own
    forward to generate's tokens, and the static path says so in one line and does the same."""
    model = _config_model(family)
    from rlhf.generation.decode import _own_forward

    assert _own_forward(model, 16) is None
    ids, mask = _left_padded(model.config.vocab_size)
    ours = decode(model, ids, mask, 6, eos_id=2, pad_id=1)
    assert torch.equal(decode(model, ids, mask, 6, eos_id=2, pad_id=1, static=True), ours)
    assert "no static decode step" in capsys.readouterr().out
    theirs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                            eos_token_id=2, pad_token_id=1)[:, ids.shape[1]:]
    assert torch.equal(ours, theirs[:, :ours.shape[1]])


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2"])
def test_rollout_logprobs_equal_a_forward_over_the_finished_sequences(family):
    """PPO's old log-probs taken from the logits that sampled (step.old_logprobs=rollout) against a
    full forward over prompt + answer (recompute), at the sampling temperature, over left-padded
    prompts, with an eos that ends a row early (0 after it); our forward and the model's own (GPT-2)."""
    from rlhf import losses
    from rlhf.generation.rollout import answer_logits, position_ids, response_mask

    model = _model(family)[0] if family in ("llama", "opt") else _config_model(family)
    ids, mask = _left_padded(model.config.vocab_size)
    sampling = {"do_sample": True, "temperature": 0.7}
    torch.manual_seed(3)
    first = decode(model, ids, mask, 8, eos_id=2, pad_id=1, **sampling)
    # The same seed draws the same tokens: with a token of row 0 that it had not drawn before as
    # eos, row 0 ends there.
    end = next(j for j in range(2, 8) if int(first[0, j]) not in first[0, :j].tolist())
    eos = int(first[0, end])
    torch.manual_seed(3)
    tokens, logprobs = decode(model, ids, mask, 8, eos_id=eos, pad_id=1, with_logprobs=True, **sampling)
    rmask = response_mask(tokens, eos)
    assert tokens.shape == logprobs.shape and rmask[0].sum() == end + 1 and (tokens[0, end + 1:] == 1).all()
    seq, attn = torch.cat([ids, tokens], 1), torch.cat([mask, rmask], 1)
    with torch.no_grad():
        full = losses.token_logprobs(answer_logits(model, seq, attn, position_ids(attn), ids.shape[1] - 1),
                                     tokens, 0.7)
    assert torch.allclose(logprobs * rmask, full * rmask, atol=1e-4), (logprobs - full).abs().max()
    assert (logprobs[rmask == 0] == 0).all()

    # Before min_new_tokens the sampler never draws eos: its log-probs are of the distribution
    # without eos, which a forward reproduces with losses.forbid_early_eos (and which puts more
    # mass on every other token than the plain softmax).
    torch.manual_seed(5)
    tokens, logprobs = decode(model, ids, mask, 8, eos_id=eos, pad_id=1, with_logprobs=True, min_new_tokens=3,
                              **sampling)
    assert (tokens[:, :3] != eos).all()
    rmask = response_mask(tokens, eos)
    seq, attn = torch.cat([ids, tokens], 1), torch.cat([mask, rmask], 1)
    with torch.no_grad():
        logits = answer_logits(model, seq, attn, position_ids(attn), ids.shape[1] - 1)
        full = losses.token_logprobs(losses.forbid_early_eos(logits, eos, 3), tokens, 0.7)
        plain = losses.token_logprobs(logits, tokens, 0.7)
    assert torch.allclose(logprobs * rmask, full * rmask, atol=1e-4), (logprobs - full).abs().max()
    assert (full[:, :3] > plain[:, :3]).all() and torch.allclose(full[:, 3:], plain[:, 3:])


@pytest.mark.parametrize("family", ["llama", "opt", "opt-350m-shape", "qwen2", "qwen3", "llama-lora"])
def test_a_bf16_model_decodes_as_close_to_fp32_as_its_own_forward(family):
    """On CPU a bf16 model's residual stream, cache and attention stay fp32 (faster there; norms,
    projections in and out, per-head norms and LoRA layers each take their own path): its logits must
    stay as close to the fp32 model's as the model's own bf16 forward is, token by token."""
    from rlhf.config import LoraConfig
    from rlhf.generation.decode import _model_steps, _own_forward, _own_steps
    from rlhf.models import apply_lora

    name = family.removesuffix("-lora")
    model = _model(name)[0] if name in ("llama", "opt") else _config_model(name)
    if family.endswith("-lora"):  # an adapter that changes the logits: B drawn, not PEFT's zeros
        model = apply_lora(model, LoraConfig(rank=4)).eval()
        torch.manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.data.normal_(0, 0.05)
    ids, mask = _left_padded(model.config.vocab_size)
    exact = _model_steps(model, ids, mask)
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert _own_forward(half) is not None
    ours, theirs = _own_steps(_own_forward(half), ids, mask, 6), _model_steps(half, ids, mask)
    tok = None
    with torch.no_grad():
        for _ in range(6):
            want = exact(tok)
            a, b = ours(tok).float(), theirs(tok).float()
            assert (a - want).abs().max() <= 1.5 * (b - want).abs().max() + 1e-3
            tok = want.argmax(-1)


@pytest.mark.parametrize("family", ["llama", "opt", "llama-gqa-rope3", "opt-350m-shape", "qwen2"])
@pytest.mark.parametrize("sampling", [{"do_sample": True, "temperature": 0.7}, {}], ids=["sampled", "greedy"])
@pytest.mark.parametrize("span", [8, 0], ids=["spans", "whole-cache"])
def test_static_step_decodes_the_tokens_and_logprobs_of_the_default_loop(family, sampling, span, monkeypatch):
    """The static-shape step (every token attends over the cache up to the end of its span, or the
    whole cache, under an in-place mask, the position a device tensor; what a CUDA graph records)
    against the default loop, same seed: the same tokens, the same log-probs (1e-6), padding after a
    row's eos; and where every row has ended before its first look (row 0 alone), the same length,
    although it looks for the end only every STATIC_CHECK_EVERY tokens and trims what it decoded
    past it. Spans of 8 positions: the 35 tokens cross several."""
    from rlhf.generation import decode as decode_module
    from rlhf.generation.decode import STATIC_CHECK_EVERY

    monkeypatch.setattr(decode_module, "STATIC_SPAN", span)

    model = _model(family)[0] if family in ("llama", "opt") else _config_model(family)
    ids, mask = _left_padded(model.config.vocab_size)
    new = 2 * STATIC_CHECK_EVERY + 3
    for rows in (slice(None), slice(0, 1)):
        ids_, mask_ = ids[rows], mask[rows]
        torch.manual_seed(3)
        first = decode(model, ids_, mask_, 12, eos_id=-1, pad_id=1, **sampling)[0]
        # A token row 0 draws after its first step and not before: as eos it ends row 0 there.
        end, eos = next((j, int(t)) for j, t in enumerate(first[1:], 1) if int(t) not in first[:j].tolist())
        runs = []
        for static in (False, True):
            torch.manual_seed(3)
            runs.append(decode(model, ids_, mask_, new, eos_id=eos, pad_id=1, with_logprobs=True, static=static,
                               **sampling))
        (tokens, logprobs), (stokens, slogprobs) = runs
        assert tokens[0, end] == eos and (tokens[0, end + 1:] == 1).all()
        if rows.stop == 1:
            assert tokens.shape[1] == end + 1 < STATIC_CHECK_EVERY
        assert torch.equal(stokens, tokens)
        assert (slogprobs - logprobs).abs().max() <= 1e-6, (slogprobs - logprobs).abs().max()


class _HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts the tensor calls that read a value back to the host (each waits for the device)."""

    NAMES = {"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.NAMES
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_static_decode_reads_back_to_the_host_once_per_check_interval(family):
    """33 tokens (eos forbidden throughout): the default loop reads the all-ended flag back after
    every token but the last; the static one once per STATIC_CHECK_EVERY tokens, plus once for the
    trim. (Every torch call passes through the counting mode: a few seconds per decode.)"""
    from rlhf.generation.decode import STATIC_CHECK_EVERY

    model, tok = _model(family)
    ids, mask = _left_padded(model.config.vocab_size)
    counts = {}
    for static in (False, True):
        with _HostSyncs() as syncs:
            out = decode(model, ids, mask, 33, eos_id=2, pad_id=1, do_sample=True, min_new_tokens=33, static=static)
        assert out.shape == (3, 33)
        counts[static] = syncs.count
    assert counts[False] >= 32
    assert counts[True] <= 32 // STATIC_CHECK_EVERY + 1, counts


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_static_token_step_traces_as_one_graph(family):
    """The token step compiles with fullgraph=True (no graph break: no host read-back, no shape that
    depends on a value), the condition for recording it as a CUDA graph, and the compiled step gives
    the eager step's logits token after token."""
    from rlhf.generation.decode import _own_forward, _StaticSteps

    model = _model(family)[0]
    ids, mask = _left_padded(model.config.vocab_size)
    eager, traced = (_StaticSteps(_own_forward(model), ids, mask, 6) for _ in range(2))
    token = torch.compile(traced.token, fullgraph=True, backend="eager")
    with torch.no_grad():
        a, b = eager(None), traced(None)
        for _ in range(5):
            nxt = a.argmax(-1)
            a = eager(nxt)
            traced.tok.copy_(nxt.unsqueeze(1))
            b = token()
            assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
