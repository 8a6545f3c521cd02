"""A lean decode loop for rollouts: one forward per token over a KV cache, sampling in a few tensor
ops, no logits-processor or stopping-criteria machinery.

At the sizes PPO rolls out on CPU, Hugging Face ``generate``'s per-token bookkeeping costs about as
much as the model's forward; this loop keeps only the forward. It serves any HF causal LM that takes
``past_key_values`` (OPT, LLaMA, GPT-2, GPT-NeoX, ...): left-padded prompts, position ids from the
attention mask where the model takes them, eos stopping, temperature / top-k / top-p in
``generate``'s order, so that the same logits give the same greedy tokens and the same sampling
distribution (tests/test_decode.py; the draws themselves differ, see ``_draw``).
``synced`` keeps every rank stepping until all are done: ZeRO-3's layer-by-layer gathers are
collectives.

For the families in ``FORWARDS`` (LLaMA, OPT) the loop does not call the model's own forward at all
when every weight is present (not ZeRO-3, or ZeRO-3 gathered whole): a short forward over the
model's own submodules (so LoRA layers and any bias still apply) writes keys and values into a
cache preallocated for prompt + answer and attends with one ``scaled_dot_product_attention``. It
leaves out what transformers does per token for generality (mask building for every attention
backend, cache-class dispatch, output dataclasses, input checks), which at rollout sizes costs as
much as the arithmetic. Other families, and ZeRO-3 with layer-by-layer gathers, use the model's
forward; tests check both give the tokens ``generate`` gives.

    python bench/decode.py          # tokens/s of this loop against HF generate, same model and batch
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.generation.forwards import FORWARDS, _base, _Cache, _own_forward, accepts  # noqa: F401 - re-exported
from rlhf.generation.sampling import Sampling
from rlhf.losses import token_logprobs


def _filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), as ``generate``'s warpers apply them."""
    if temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        # Drop the tokens after the cumulative mass passes top_p; the most likely token always stays.
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(-1)
    logits = logits.float()
    if top_k and top_k < logits.shape[-1]:
        # Draw among the k best only: the distribution of masking the rest to -inf, at k/vocab of the
        # cost. A tie at the k-th logit, which generate keeps, is dropped.
        best, index = torch.topk(logits, top_k, dim=-1)
        return index.gather(-1, _draw(_filter(best, temperature, 0, top_p))).squeeze(1)
    return _draw(_filter(logits, temperature, top_k, top_p)).squeeze(1)


def _draw(logits: torch.Tensor) -> torch.Tensor:
    """One index per row drawn from softmax(logits), by inverse transform: one uniform number per row
    against the cumulative distribution. ``torch.multinomial`` (and so ``generate``) races one
    exponential per vocabulary entry, which costs 5-7x more on CPU at vocabularies of 8k-50k
    (bench/decode.py's sampler rows); the draws differ from its draws, the distribution is the same
    (tests/test_decode.py). The running sums are float64 so that their rounding over 50k entries
    cannot move mass between tokens; ``right=True`` never lands on a token of zero probability."""
    weights = (logits - logits.amax(-1, keepdim=True)).exp().double().cumsum(-1)
    u = torch.rand(weights.shape[0], 1, dtype=torch.float64, device=weights.device) * weights[:, -1:]
    return torch.searchsorted(weights, u, right=True).clamp(max=logits.shape[-1] - 1)


# The static path looks at "has every row ended?" once per this many tokens: each look waits for the
# device (a host synchronization), which a replayed CUDA graph otherwise never does. Tokens decoded
# past the end are padding and are trimmed, so the output is the same as looking every token.
STATIC_CHECK_EVERY = 16


@torch.no_grad()
def decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: Sampling | int, eos_id: int,
           pad_id: int, *, synced: bool = False, with_logprobs: bool = False, static: bool = False, tp_group=None,
           **settings):
    """New tokens [batch, <= max_new_tokens] for left-padded prompts; after a row's eos, pad.

    ``sampling``: how tokens are drawn (rlhf.generation.sampling.Sampling), or its short form, max_new_tokens
    with the other settings as keywords (``decode(model, ids, mask, 8, eos, pad, do_sample=True)``).

    ``with_logprobs``: (tokens, logprobs), each new token's log-probability under the softmax of
    the logits / temperature over the whole vocabulary, eos left out before ``min_new_tokens``
    (0 after eos) -- what PPO's ratio divides by, taken from the logits that sampled instead of a
    second forward over the finished sequences. Top-k / top-p are not in these log-probs: PPO
    refuses them (rlhf.config.PPOStepConfig).

    ``static``: the one-token step with every shape fixed (``_StaticSteps``), recorded once as a
    CUDA graph and replayed per token on a GPU, and the all-rows-ended check every
    ``STATIC_CHECK_EVERY`` tokens; the default loop's tokens and log-probs in exact arithmetic (in
    fp32 the same tokens; in bf16 both loops round differently, and their log-probs match one forward
    over their own tokens equally closely: bench/gpu.sh's decode phase). Families
    without a forward of ours decode the default way (a one-line notice says so).

    ``tp_group``: ``model`` is this rank's tensor-parallel slice (rlhf.generation.shards) and the group decodes
    the same rows; every token is the group's first rank's draw, so the group never parts.
    """
    sampling = Sampling.coerce(sampling, settings)
    max_new_tokens = sampling.max_new_tokens
    own = _own_forward(model, input_ids.shape[1] + max_new_tokens)
    if static and own is None:
        _notice(f"[decode] {type(_base(model)).__name__}: no static decode step for this family (rlhf.generation.forwards.FORWARDS)"
                " or its weights are partitioned (ZeRO-3 without gathering whole); decoding through its own forward")
        static = False
    if static:
        step = _StaticSteps(own, input_ids, attention_mask, max_new_tokens)
    elif own:
        step = _own_steps(own, input_ids, attention_mask, max_new_tokens)
    else:
        step = _model_steps(model, input_ids, attention_mask)
    check_every = STATIC_CHECK_EVERY if static else 1
    batch = input_ids.shape[0]
    done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    pad = torch.full_like(done, pad_id, dtype=input_ids.dtype)
    tokens, logprobs, ended = [], [], []
    eos = torch.tensor([eos_id], device=input_ids.device)
    logits = step(None)
    for t in range(max_new_tokens):
        tok, scaled = sample_token(logits, t, sampling, eos, with_logprobs)
        if tp_group is not None:  # each rank's RNG differs; a rank that parted would hang the group
            dist.broadcast(tok, src=dist.get_global_rank(tp_group, 0), group=tp_group)
        tok = torch.where(done, pad, tok)
        tokens.append(tok)
        if with_logprobs:  # of the distribution that drew (eos excluded before min_new_tokens)
            logprobs.append(token_logprobs(scaled, tok).masked_fill(done, 0.0))
        done = done | (tok == eos_id)
        ended.append(done)
        if t == max_new_tokens - 1:
            break
        if (t + 1) % check_every == 0:
            finished = done.all()
            # Every rank runs as many forwards as the slowest where the model's forward gathers ZeRO-3
            # weights (collectives); our own forward runs none.
            if synced and own is None:
                flag = (~finished).float().reshape(1)
                dist.all_reduce(flag)
                finished = flag.item() == 0
            if finished:
                break
        logits = step(tok)
    # Cut what was decoded after every row had ended (the static path looks only every few tokens):
    # the length the every-token check stops at, so both paths return the same tensor.
    length = min(int((~torch.stack(ended, dim=1)).sum(1).max()) + 1, len(tokens)) if check_every > 1 else len(tokens)
    out = torch.stack(tokens[:length], dim=1)
    return (out, torch.stack(logprobs[:length], dim=1)) if with_logprobs else out


def sample_token(logits: torch.Tensor, t: int, sampling: Sampling, eos: torch.Tensor,
                 with_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The token [batch] drawn from one decoding step's ``logits`` [batch, vocab] for answer position
    ``t``, and the logits the sampler scaled (by the temperature, eos forbidden before
    min_new_tokens), which the token's log-prob is read from."""
    if t < sampling.min_new_tokens:  # the answer may not end yet: eos is out of the distribution here
        logits = logits.index_fill(-1, eos, float("-inf"))
    do_sample, temperature = sampling.do_sample, sampling.temperature
    # Scaled once for the sampler and the log-probs (greedy picks on the raw logits, as generate).
    scaled = logits.float() / temperature if temperature != 1.0 and (do_sample or with_logprobs) else logits
    return next_tokens(scaled if do_sample else logits, do_sample, 1.0, sampling.top_k, sampling.top_p), scaled


_told: set[str] = set()


def _notice(line: str) -> None:
    """Say ``line`` once per process (decode runs per rollout batch)."""
    if line not in _told:
        _told.add(line)
        print(line, flush=True)


def _positions(attention_mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Position ids of prompt + answer [batch, prompt + max_new_tokens], counted over valid tokens."""
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return torch.cat([pos, pos[:, -1:] + torch.arange(1, max_new_tokens + 1, device=pos.device)], dim=1)


def _cache_dtype(device: torch.device) -> torch.dtype | None:
    # On CPU a half-precision model's one-query attention is slower than the same attention in fp32
    # (docs/design-notes.md, "Half precision on CPU"): there the cache and the attention stay fp32 (the
    # projections follow ``_Cache.linear``). GPUs have fast half-precision attention and keep the model's dtype.
    return torch.float32 if device.type == "cpu" else None


def _prompt_mask(valid: torch.Tensor, prompt: int) -> torch.Tensor:
    """The prompt attends causally over its own valid tokens; a padding position attends to itself
    too, so that no row of the softmax is empty (its output is never read)."""
    at = torch.arange(prompt, device=valid.device)
    return (valid[..., :prompt] & (at[None, :] <= at[:, None])) | torch.eye(prompt, dtype=torch.bool,
                                                                               device=valid.device)


def _own_steps(own, input_ids, attention_mask, max_new_tokens):
    """step(None) runs the prompt, step(tok) one new token; each returns the last position's logits."""
    batch, prompt = input_ids.shape
    device = input_ids.device
    valid = torch.ones(batch, 1, 1, prompt + max_new_tokens, dtype=torch.bool, device=device)
    valid[..., :prompt] = attention_mask.bool()[:, None, None]
    cache = _Cache(_positions(attention_mask, max_new_tokens), _cache_dtype(device))
    state = {"at": prompt}
    # Where the attention's dtype is known (the fp32 cache on CPU), the tokens' mask is additive
    # (0 / -inf) in that dtype, made once: attention converts a boolean mask to that form in every
    # layer, every token.
    tokens_mask = valid if cache.dtype is None else torch.zeros(valid.shape, dtype=cache.dtype, device=device).masked_fill(
        ~valid, float("-inf"))

    def step(tok):
        if tok is None:
            return own(input_ids, cache, 0, _prompt_mask(valid, prompt))
        # Sliced once per token, contiguous: attention over a strided mask costs twice as much, per layer.
        mask = tokens_mask[..., :state["at"] + 1].contiguous()
        logits = own(tok.unsqueeze(1), cache, state["at"], mask)
        state["at"] += 1
        return logits
    return step


# The static path's attention reads the cache up to the next multiple of this many positions past
# the token's own (not the whole prompt + max_new_tokens), one CUDA graph per such span: the KV
# cache is most of what a decoding step reads at rollout batch sizes, and attending over the whole
# cache from the first answer token reads on average max_new_tokens / 2 positions more per row than
# the tokens need. A span's graph is recorded when the first token reaches it (a capture only; the
# warm-up runs before the first). 0: every token attends over the whole cache, one graph.
STATIC_SPAN = 64


def static_span(needed: int, length: int) -> int:
    """The cache positions a static step attends over when its token needs the first ``needed``: that
    many rounded up to a multiple of ``STATIC_SPAN``, at most the whole cache of ``length``."""
    return min(length, -(-needed // STATIC_SPAN) * STATIC_SPAN) if STATIC_SPAN else length


class _StaticSteps:
    """The steps of ``_own_steps`` with every per-token shape fixed: each token's forward attends over
    the cache up to the end of its span (``STATIC_SPAN``) under a mask that opens one position per
    token in place, and the position is a device tensor advanced in place. Nothing in a token's step
    (``token``) reads a value back to the host or changes shape within a span, so on a GPU each
    span's step is recorded once as a CUDA graph (the first after the prompt's forward has built the
    cache and its tables) and replayed for every token in it: one launch instead of a few hundred
    kernel launches from Python. The host knows which span a token is in from the count of tokens
    fed, never from the device. On CPU the same step runs eagerly (bench/decode.py's
    ``static_over_default``: its price there)."""

    def __init__(self, own, input_ids, attention_mask, max_new_tokens):
        batch, self.prompt = input_ids.shape
        device = input_ids.device
        self.own, self.input_ids, self.max_new_tokens = own, input_ids, max_new_tokens
        self.valid = torch.zeros(batch, 1, 1, self.prompt + max_new_tokens, dtype=torch.bool, device=device)
        self.valid[..., :self.prompt] = attention_mask.bool()[:, None, None]
        self.cache = _Cache(_positions(attention_mask, max_new_tokens), _cache_dtype(device))
        self.at = torch.full((1,), self.prompt, dtype=torch.long, device=device)
        self.tok = torch.zeros(batch, 1, dtype=input_ids.dtype, device=device)
        self.fed = 0  # tokens fed so far: the next one's key goes to position prompt + fed
        self.graphs = {}  # span -> (graph, its output buffer, rewritten by every replay)

    def feed(self, tok: torch.Tensor) -> int:
        """Take ``tok`` as the next token to run and set its span (the positions up to its own,
        ``static_span``); returns the span."""
        self.tok.copy_(tok.unsqueeze(1))
        self.cache.span = static_span(self.prompt + self.fed + 1, self.cache.length)
        self.fed += 1
        return self.cache.span

    def token(self) -> torch.Tensor:
        """One token's forward from ``self.tok`` at ``self.at`` over ``self.cache.span`` positions; the
        logits [batch, vocab]."""
        self.valid.index_fill_(-1, self.at, True)
        logits = self.own(self.tok, self.cache, self.at, self.valid[..., :self.cache.span])
        self.at.add_(1)
        return logits

    def __call__(self, tok):
        if tok is None:
            return self.own(self.input_ids, self.cache, 0, _prompt_mask(self.valid, self.prompt))
        span = self.feed(tok)
        if self.input_ids.device.type != "cuda":
            return self.token()
        if span not in self.graphs:
            self.graphs[span] = self._record(warm_up=not self.graphs)
        graph, out = self.graphs[span]
        graph.replay()
        return out

    def _record(self, warm_up: bool):
        """Record ``token`` as a CUDA graph at the span set in ``self.cache``. Before the first capture
        of a decode, a few warm-up runs on a side stream (as capture requires), then the position and
        mask put back (the warm-up's cache writes sit at positions the real steps overwrite before
        they read them); a capture itself launches nothing. Returns the graph and its output buffer."""
        if warm_up:
            at = self.prompt + self.fed - 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(min(2, self.max_new_tokens)):
                    self.token()
            torch.cuda.current_stream().wait_stream(side)
            self.at.fill_(at)
            self.valid[..., at:] = False
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.token()
        return graph, out


def _model_steps(model, input_ids, attention_mask):
    """The same steps through the model's own forward and a transformers cache."""
    from transformers import DynamicCache

    attn = attention_mask.long()
    kwargs = {}
    # The prompt's forward needs the lm head at its last position only, where the model allows it.
    first = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}
    positions = accepts(model, "position_ids")
    state = {}
    if positions:
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        kwargs["position_ids"] = pos
        state["pos"] = pos[:, -1:]
    # Transformers 5 names the cache argument `cache`; earlier versions and some families `past_key_values`.
    cache_arg = "cache" if accepts(model, "cache") else "past_key_values"
    kwargs[cache_arg] = DynamicCache()  # filled in place by every forward
    ones = torch.ones(attn.shape[0], 1, dtype=attn.dtype, device=attn.device)
    state["attn"] = attn

    def step(tok):
        if tok is None:
            return model(input_ids=input_ids, attention_mask=attn, use_cache=True, **kwargs, **first).logits[:, -1]
        state["attn"] = torch.cat([state["attn"], ones], dim=1)
        if positions:
            state["pos"] = state["pos"] + 1
            kwargs["position_ids"] = state["pos"]
        return model(input_ids=tok.unsqueeze(1), attention_mask=state["attn"], use_cache=True, **kwargs).logits[:, -1]
    return step
