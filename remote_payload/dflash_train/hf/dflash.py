"""`DFlashDraftModel` for transformers' `AutoModel.from_pretrained(export, trust_remote_code=True)`.

Shipped in every export beside `dflash_model.py`, which is the trainer's own `model.py` copied
verbatim: the math is the trainer's, not a second implementation. The weights' names are the
trainer's (and z-lab's). The class offers z-lab's interface (their README's quick start):

    draft.spec_generate(input_ids=..., max_new_tokens=..., temperature=..., target=target,
                        stop_token_ids=[...])

with a transformers causal-LM target, the config-derived `target_layer_ids`, `block_size` and
`mask_token_id`, and z-lab's `forward(position_ids, noise_embedding=, target_hidden=,
past_key_values=)`. The trainer's own forward over blocks at anchors is `block_forward`. The
drafter needs its target's embeddings and LM head, which the export does not carry.
"""

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel, Qwen3Config

from .dflash_model import DFlashDrafter, DrafterSpec, Shape, apply_rope, attend, rope_cos_sin


class DFlashDraftModel(PreTrainedModel):
    """The exported DFlash drafter as a transformers model."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"

    def __init__(self, config):
        super().__init__(config)
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        rope_theta = getattr(config, "rope_theta", None) or rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        kind = scaling.pop("rope_type", scaling.pop("type", "default"))
        scaling = () if kind == "default" else tuple(sorted({"rope_type": kind, **scaling}.items()))
        shape = Shape(
            config.hidden_size,
            config.intermediate_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.rms_norm_eps,
            rope_theta,
            scaling,
        )
        dflash = config.dflash_config
        types = tuple(getattr(config, "layer_types", None) or ())
        sliding = "sliding_attention" in types
        self.spec = DrafterSpec(
            shape,
            config.num_hidden_layers,
            config.block_size,
            tuple(dflash["target_layer_ids"]),
            dflash["mask_token_id"],
            types if sliding else (),
            config.sliding_window if sliding else None,
        )
        self.target_layer_ids = list(self.spec.target_layer_ids)
        self.block_size = self.spec.block_size
        self.mask_token_id = self.spec.mask_token_id
        inner = DFlashDrafter(self.spec)
        self.layers, self.norm, self.fc, self.hidden_norm = inner.layers, inner.norm, inner.fc, inner.hidden_norm
        self.on_layer = None
        self.post_init()

    # The trainer's forward: all blocks of a sequence at once, under the block mask (training, tests).
    block_forward = DFlashDrafter.forward

    def _init_weights(self, module):
        """The weights come from the checkpoint: nothing to initialise."""

    def forward(
        self,
        position_ids,
        attention_mask=None,
        noise_embedding=None,
        target_hidden=None,
        past_key_values=None,
        use_cache=False,
        **kwargs,
    ):
        """z-lab's draft step: hidden states [N, Q, H] (after the final norm) of the Q block tokens
        `noise_embedding` [N, Q, H], given the target features `target_hidden` [N, C, L*H] of the
        C context positions before them. `position_ids` [N, C+Q] are those positions. With
        `past_key_values` (a transformers Cache) the context's keys/values are appended to it and
        the block attends to everything cached, else to the C positions; `attention_mask` (for
        SDPA, over the keys) defaults to all visible. Crop the block's entries off the cache after."""
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))  # [N, C, H]
        x = noise_embedding.to(dtype)  # [N, Q, H]
        q_len = x.shape[1]
        shape = self.spec.shape
        cos, sin = rope_cos_sin(
            position_ids, shape.head_dim, shape.rope_theta, dtype, shape.rope_scaling
        )  # [N, C+Q, d]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rope(attn.queries(h), cos[:, -q_len:], sin[:, -q_len:])  # [N, nh, Q, d]
            k_ctx, v_ctx = attn.keys_values(ctx)
            k_blk, v_blk = attn.keys_values(h)
            k = apply_rope(torch.cat([k_ctx, k_blk], dim=2), cos, sin)  # [N, nkv, C+Q, d]
            v = torch.cat([v_ctx, v_blk], dim=2)
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, i)
            mask = attention_mask
            if self.spec.layer_type(i) == "sliding_attention":
                mask = _window(mask, position_ids, q_len, k.shape[2], self.spec.sliding_window)
            x = x + attn.output(attend(q, k, v, mask))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    @torch.inference_mode()
    def spec_generate(
        self,
        target,
        input_ids,
        max_new_tokens,
        stop_token_ids=None,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        mask_token_id=None,
    ):
        """Speculative decoding of one prompt `input_ids` [1, P] with a transformers causal-LM
        `target`: the prompt and up to `max_new_tokens` new tokens [1, P+n], ending at the first
        of `stop_token_ids` if one comes. Greedy at temperature 0 (the target's own greedy text),
        else speculative sampling (distributed as the target's samples with top_p/top_k).
        `mask_token_id` defaults to the config's (z-lab's older signature passed it)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate decodes one prompt: input_ids must be [1, P], not {list(input_ids.shape)}")
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError("temperature and top_k must be >= 0 and top_p in (0, 1]")
        self.eval()
        block, mask = self.block_size, self.mask_token_id if mask_token_id is None else mask_token_id
        device, prompt_len = input_ids.device, input_ids.shape[1]
        stops = set(stop_token_ids or ())
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        target_cache, draft_cache = DynamicCache(), DynamicCache()
        cached = {_cache_keyword(target): target_cache, "use_cache": True, "output_hidden_states": True}

        out = target(input_ids, logits_to_keep=1, **cached)
        context = self._features(out.hidden_states)  # [1, P, L*H]
        first = _probs(out.logits[0, -1:], temperature, top_p, top_k)  # [1, V]
        new = [int(_pick(first, temperature)[0])]  # the prefill's own token
        context_start = 0
        while len(new) < max_new_tokens and not stops.intersection(new):
            start = prompt_len + len(new) - 1  # position of new[-1]
            ids = torch.full((1, block), mask, dtype=torch.long, device=device)
            ids[0, 0] = new[-1]
            positions = torch.arange(context_start, start + block, device=device)[None]
            hidden = self(
                position_ids=positions,
                noise_embedding=embed(ids),
                target_hidden=context,
                past_key_values=draft_cache,
                use_cache=True,
            )
            _keep(draft_cache, start)  # the context only
            q = _probs(head(hidden[0, 1:].to(head.weight.dtype)), temperature, top_p, top_k)  # [B-1, V]
            ids[0, 1:] = _pick(q, temperature)
            out = target(ids, **cached)
            p = _probs(out.logits[0], temperature, top_p, top_k)  # [B, V]
            k, following = _accept(ids[0, 1:], q, p, temperature)
            new += ids[0, 1 : 1 + k].tolist() + [following]
            _keep(target_cache, start + k + 1)  # anchor + accepted drafts
            context, context_start = self._features(out.hidden_states)[:, : k + 1], start
        hit = [i for i, t in enumerate(new) if t in stops]
        new = new[: hit[0] + 1] if hit else new
        tail = torch.tensor([new[:max_new_tokens]], dtype=input_ids.dtype, device=device)
        return torch.cat([input_ids, tail], dim=1)

    def _features(self, hidden_states):
        """The drafter's context: the target's hidden states after each layer of
        `target_layer_ids` (hidden_states[0] is the embeddings), concatenated."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)


def _window(mask, position_ids, q_len, k_len, window):
    """A sliding layer's mask: `mask` (None, boolean, or additive over the k_len keys) where the
    block's queries also see only the context within `window` positions (q - k < window) and
    their whole block. The keys are contiguous positions ending at the block's last one."""
    last = position_ids[:, -1:]  # [N, 1]
    keys = last - (k_len - 1) + torch.arange(k_len, device=position_ids.device)  # [N, K]
    queries = position_ids[:, -q_len:]  # [N, Q]
    near = (queries[:, :, None] - keys[:, None, :]) < window  # [N, Q, K]
    near[:, :, k_len - q_len :] = True  # the block itself
    near = near[:, None]  # [N, 1, Q, K]
    if mask is None:
        return near
    if mask.dtype == torch.bool:
        return mask & near
    return mask.masked_fill(~near, torch.finfo(mask.dtype).min)


def _cache_keyword(target):
    """The name of the target's KV-cache argument: `cache` where transformers has it (5.24
    warns that `past_key_values` goes in 5.40), else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _keep(cache, length):
    """Crop a transformers cache to its first `length` positions (`crop(-n)` removes n in both the
    4.x and 5.x API; 5.x refuses a positive length)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _probs(logits, temperature, top_p, top_k):
    """Rows of logits [T, V] -> what to draw from: at temperature 0 the logits themselves (drawn
    by argmax), else probabilities (fp32) at `temperature` kept to the top_k most likely and the
    smallest set reaching top_p, renormalised."""
    if temperature == 0:
        return logits
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
    if top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # the mass of the likelier ones
        kept = torch.where(before < top_p * ordered.sum(-1, keepdim=True), ordered, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, kept)
    return probs / probs.sum(-1, keepdim=True)


def _pick(rows, temperature):
    """One token per row of `_probs` output: the argmax (temperature 0) or a draw."""
    return rows.argmax(-1) if temperature == 0 else torch.multinomial(rows, 1)[:, 0]


def _accept(drafts, q, p, temperature):
    """(accepted drafts k, next token) for drafts [B-1] drawn from q [B-1, V], against the
    target's p [B, V] (row i: the token after block position i). Greedy: the drafts equal to the
    target's argmax, then its argmax. Sampled: the speculative-sampling rule (draft i stands with
    probability min(1, p/q); the first to fall is replaced by a draw from max(0, p - q))."""
    if temperature == 0:
        best = p.argmax(-1)
        k = int((best[:-1] == drafts).long().cumprod(0).sum())
        return k, int(best[k])
    for i, token in enumerate(drafts.tolist()):
        if float(torch.rand(())) * float(q[i, token]) >= float(p[i, token]):  # rejected
            residual = (p[i] - q[i]).clamp_min(0)
            residual = residual if residual.sum() > 0 else p[i]
            return i, int(torch.multinomial(residual / residual.sum(), 1))
    return len(drafts), int(torch.multinomial(p[-1], 1))
