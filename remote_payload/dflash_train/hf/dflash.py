"""`DFlashDraftModel` for transformers' `AutoModel.from_pretrained(export, trust_remote_code=True)`.

Shipped in every export beside `dflash_model.py`, which is the trainer's own `model.py` copied
verbatim: the math is the trainer's, not a second implementation. The weights' names are the
trainer's (and z-lab's). The drafter needs its target's embeddings and LM head, which the export
does not carry: `forward(target_hidden, block_embeds, anchors, mask)` returns the block's hidden
states [N, A*B, H]; apply the target's `lm_head` to them (see dflash_train/speculate.py).
"""

from transformers import PreTrainedModel, Qwen3Config

from .dflash_model import DFlashDrafter, DrafterSpec, Shape


class DFlashDraftModel(PreTrainedModel):
    """The exported DFlash drafter as a transformers model (forward: `DFlashDrafter.forward`)."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"

    def __init__(self, config):
        super().__init__(config)
        rope_theta = getattr(config, "rope_theta", None) or (config.rope_parameters or {})["rope_theta"]
        shape = Shape(config.hidden_size, config.intermediate_size, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim, config.rms_norm_eps, rope_theta)
        dflash = config.dflash_config
        self.spec = DrafterSpec(shape, config.num_hidden_layers, config.block_size,
                                tuple(dflash["target_layer_ids"]), dflash["mask_token_id"])
        inner = DFlashDrafter(self.spec)
        self.layers, self.norm, self.fc, self.hidden_norm = inner.layers, inner.norm, inner.fc, inner.hidden_norm
        self.on_layer = None
        self.post_init()

    forward = DFlashDrafter.forward

    def _init_weights(self, module):
        """The weights come from the checkpoint: nothing to initialise."""
