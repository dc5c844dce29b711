"""Tiny Hugging Face ``transformers`` models for the zoo: random weights, no hub access, every
dropout probability 0 (so gradients are deterministic). Attention is eager except in the
models of :data:`SDPA`, which keep transformers' default (``scaled_dot_product_attention``,
which torch.export decomposes into the same ops; it cannot export GPT-2's).

Each entry of :data:`ZOO` builds ``(module, inputs, target)``: a ``torch.nn.Module`` returning one
logits tensor of shape ``(rows, classes)``, its example inputs (one batch) and class targets.
Language models return their per-token logits flattened to ``(batch * seq, vocab)``.

The families, by what they bring:

- decoders: GPT-2, Llama, Qwen2, Mistral (grouped-query attention, sliding window); BLOOM
  (ALiBi); Falcon (multi-query attention, parallel attention and MLP); GPT-NeoX (rotary on half
  the head, parallel residual); GPT-J (interleaved rotary on part of the head); GPTBigCode
  (multi-query); Gemma 2 (attention and final logit soft-capping, sliding windows); Mixtral and
  Qwen2-MoE (top-2 of 4 experts, Qwen2-MoE with a gated shared expert); a PEFT LoRA Llama;
- encoders: BERT, RoBERTa, ALBERT, DistilBERT, ELECTRA; DeBERTa and DeBERTa-v2 (disentangled
  relative attention, v2's log-bucketed positions); ConvBERT (span-based dynamic convolution);
- encoder-decoders: T5, BART;
- vision: ViT, DeiT, Swin, Swin v2 (continuous position bias from an MLP), BEiT (relative
  position bias, layer scale), DINOv2 (layer scale); ResNet, ConvNeXt, ConvNeXt v2 (global
  response normalization), EfficientNet, RegNet; SegFormer (spatial-reduction attention), CvT
  (convolutional projections with batch norm), MobileViT (unfold/fold around attention), LeViT
  (batch norm inside attention);
- audio: the Audio Spectrogram Transformer; Wav2Vec2 on raw waveforms (convolutional feature
  encoder, weight-normed positional convolution); Whisper's encoder.

Mixture-of-experts models use ``experts_implementation="batched_mm"`` (each token's top-k
experts' weights gathered): torch.export cannot take transformers' default (``grouped_mm``
calls ``torch.histc`` and a custom grouped-matmul op, which TVM's importer has no converter
for) nor the eager one (it loops over the experts a token chose, a data-dependent shape).
MobileViT and LeViT train on a batch of 4: both normalize over the batch (LeViT's classifier, its
last stage's single token, MobileViT's late stages), and over a batch of 2 a batch norm's
output is +-1 by the sign of the two values' difference, so that every float32 gradient,
PyTorch's included, depends on which of the nearly equal features rounding flips (PyTorch's
float32 LeViT features differ from float64's by 4.0).
"""

import functools

import numpy as np
import torch
import transformers as tf

BATCH, SEQ, VOCAB, HIDDEN, CLASSES, IMAGE = 2, 8, 32, 32, 3, 32
TEXT = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=32)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


class Logits(torch.nn.Module):
    """``model(*inputs).logits``, flattened to ``(rows, classes)`` when ``flat``."""

    def __init__(self, model, flat=False):
        super().__init__()
        self.model, self.flat = model, flat

    def forward(self, *inputs):
        logits = self.model(*inputs).logits
        return logits.reshape(-1, logits.shape[-1]) if self.flat else logits


class Seq2Seq(Logits):
    """An encoder-decoder's ``(input_ids, decoder_input_ids) -> (batch * seq, vocab)`` logits."""

    def forward(self, input_ids, decoder_input_ids):
        logits = self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits
        return logits.reshape(-1, logits.shape[-1])


def _eager(config):
    config._attn_implementation = "eager"
    return config


def _sdpa(config):
    return config  # transformers' default


def _tokens(rng, pad=None):
    ids = rng.integers(2, VOCAB, (BATCH, SEQ))
    if pad is not None:
        ids[:, -2:] = pad  # padded tails: the pad row of the embedding gets no gradient
    return torch.from_numpy(ids)


def _images(rng, channels=3, size=IMAGE, batch=BATCH):
    return torch.from_numpy(rng.standard_normal((batch, channels, size, size)).astype("float32"))


def _classify(model_class, config, make_input, attention=_eager, batch=BATCH):
    def build(rng):
        torch.manual_seed(0)
        module = Logits(model_class(attention(config())))
        return module, (make_input(rng),), rng.integers(0, CLASSES, batch)
    return build


def _waveform(samples):
    def make(rng):
        return torch.from_numpy(rng.standard_normal((BATCH, samples)).astype("float32"))
    return make


def _features(mels, frames):
    def make(rng):
        return torch.from_numpy(rng.standard_normal((BATCH, mels, frames)).astype("float32"))
    return make


def _without(build, path):
    """``build`` with the parameter at ``path`` removed: one the forward pass does not use (so
    PyTorch leaves its ``.grad`` None), as DINOv2's mask token of masked-image pretraining."""
    def drop(rng):
        module, inputs, target = build(rng)
        owner, name = path.rsplit(".", 1)
        setattr(module.get_submodule(owner), name, None)
        return module, inputs, target
    return drop


def _lora(rng):
    """A PEFT LoRA (r=4 on q_proj and v_proj) of a tiny Llama: the base weights frozen. LoRA's
    B starts at zero, which would leave A without a gradient: B is drawn at random."""
    import peft

    torch.manual_seed(0)
    base = tf.LlamaForCausalLM(_eager(tf.LlamaConfig(**DECODER, use_cache=False)))
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    return Logits(model, flat=True), (_tokens(rng),), rng.integers(0, VOCAB, BATCH * SEQ)


def _rope(factor):
    """Rotary embeddings on a ``factor`` of each head's dimensions."""
    return dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=factor)


def _causal_lm(model_class, config, attention=_eager):
    def build(rng):
        torch.manual_seed(0)
        module = Logits(model_class(attention(config())), flat=True)
        return module, (_tokens(rng),), rng.integers(0, VOCAB, BATCH * SEQ)
    return build


def _seq2seq(model_class, config):
    def build(rng):
        torch.manual_seed(0)
        module = Seq2Seq(model_class(_eager(config())))
        inputs = (_tokens(rng), _tokens(rng))
        return module, inputs, rng.integers(0, VOCAB, BATCH * SEQ)
    return build


DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
               attention_dropout=0.0)
VISION = dict(image_size=IMAGE, num_channels=3, num_labels=CLASSES)
VIT = dict(VISION, patch_size=8, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=64, **NO_DROPOUT)
#: a Wav2Vec2 with a one-layer feature encoder: 400 samples -> 79 frames
SPEECH = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              conv_dim=(16,), conv_kernel=(10,), conv_stride=(5,), conv_bias=True,
              num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
              activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0,
              final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0,
              apply_spec_augment=False, classifier_proj_size=16, num_labels=CLASSES)
MOE = dict(num_experts_per_tok=2, experts_implementation="batched_mm")

#: models with transformers' default SDPA attention
SDPA = ("llama", "bert")
#: models whose batch has padding tokens -> (embedding parameter, padding_idx)
PADDED = {
    "bert": ("model.bert.embeddings.word_embeddings.weight", 0),
    "roberta": ("model.roberta.embeddings.word_embeddings.weight", 1),
    "distilbert": ("model.distilbert.embeddings.word_embeddings.weight", 0),
    "albert": ("model.albert.embeddings.word_embeddings.weight", 0),
    "deberta": ("model.deberta.embeddings.word_embeddings.weight", 0),
    "electra": ("model.electra.embeddings.word_embeddings.weight", 0),
}

ZOO = {
    "gpt2": _causal_lm(tf.GPT2LMHeadModel, lambda: tf.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)),
    # without a key/value cache, Llama's causal mask takes the cumsum of a bool tensor
    "llama": _causal_lm(tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**DECODER, use_cache=False),
                        _sdpa),
    "qwen2": _causal_lm(tf.Qwen2ForCausalLM, lambda: tf.Qwen2Config(**DECODER)),
    "mistral": _causal_lm(tf.MistralForCausalLM, lambda: tf.MistralConfig(**DECODER)),
    "bert": _classify(tf.BertForSequenceClassification, lambda: tf.BertConfig(
        **TEXT, **NO_DROPOUT, num_labels=CLASSES, pad_token_id=0), lambda rng: _tokens(rng, 0),
        _sdpa),
    "roberta": _classify(tf.RobertaForSequenceClassification, lambda: tf.RobertaConfig(
        **TEXT, **NO_DROPOUT, num_labels=CLASSES, pad_token_id=1), lambda rng: _tokens(rng, 1)),
    # one layer's weights shared by both layers: each gradient sums over the layers
    "albert": _classify(tf.AlbertForSequenceClassification, lambda: tf.AlbertConfig(
        **TEXT, embedding_size=16, **NO_DROPOUT, classifier_dropout_prob=0.0,
        num_labels=CLASSES, pad_token_id=0), lambda rng: _tokens(rng, 0)),
    "distilbert": _classify(tf.DistilBertForSequenceClassification, lambda: tf.DistilBertConfig(
        vocab_size=VOCAB, dim=HIDDEN, n_layers=2, n_heads=4, hidden_dim=64,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0,
        num_labels=CLASSES, pad_token_id=0), lambda rng: _tokens(rng, 0)),
    "t5": _seq2seq(tf.T5ForConditionalGeneration, lambda: tf.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=0.0, relative_attention_num_buckets=8)),
    "bart": _seq2seq(tf.BartForConditionalGeneration, lambda: tf.BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0)),
    "vit": _classify(tf.ViTForImageClassification, lambda: tf.ViTConfig(**VIT), _images),
    "deit": _classify(tf.DeiTForImageClassification, lambda: tf.DeiTConfig(**VIT), _images),
    "swin": _classify(tf.SwinForImageClassification, lambda: tf.SwinConfig(
        **VISION, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0),
        _images),
    "resnet": _classify(tf.ResNetForImageClassification, lambda: tf.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8], depths=[1], layer_type="basic",
        num_labels=CLASSES), _images),
    "convnext": _classify(tf.ConvNextForImageClassification, lambda: tf.ConvNextConfig(
        num_channels=3, num_stages=1, hidden_sizes=[8], depths=[1], num_labels=CLASSES,
        drop_path_rate=0.0), _images),
    "efficientnet": _classify(tf.EfficientNetForImageClassification,
                              lambda: tf.EfficientNetConfig(
        num_channels=3, image_size=IMAGE, width_coefficient=0.25, depth_coefficient=0.1,
        kernel_sizes=[3, 5], in_channels=[32, 16], out_channels=[16, 24], strides=[1, 2],
        num_block_repeats=[1, 1], expand_ratios=[1, 6], depthwise_padding=[], hidden_dim=320,
        num_labels=CLASSES, dropout_rate=0.0, drop_connect_rate=0.0), _images),
    "regnet": _classify(tf.RegNetForImageClassification, lambda: tf.RegNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8], depths=[1], groups_width=4,
        num_labels=CLASSES), _images),
    "audio_spectrogram": _classify(tf.ASTForAudioClassification, lambda: tf.ASTConfig(
        hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        patch_size=8, frequency_stride=8, time_stride=8, max_length=32, num_mel_bins=16,
        num_labels=CLASSES, **NO_DROPOUT),
        lambda rng: torch.from_numpy(rng.standard_normal((BATCH, 32, 16)).astype("float32"))),
    "mobilevit": _classify(tf.MobileViTForImageClassification, lambda: tf.MobileViTConfig(
        num_channels=3, image_size=64, patch_size=2, hidden_sizes=[16, 24, 32],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64], num_attention_heads=2,
        num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0), lambda rng: _images(rng, size=64, batch=4), batch=4),
    "levit": _classify(tf.LevitForImageClassification, lambda: tf.LevitConfig(
        image_size=64, num_channels=3, hidden_sizes=[16, 24, 32], num_attention_heads=[1, 2, 2],
        depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=CLASSES),
        lambda rng: _images(rng, size=64, batch=4), batch=4),
    "deberta_v2": _classify(tf.DebertaV2ForSequenceClassification, lambda: tf.DebertaV2Config(
        **TEXT, **NO_DROPOUT, num_labels=CLASSES, relative_attention=True,
        pos_att_type=["p2c", "c2p"], position_buckets=4, max_relative_positions=16,
        pooler_dropout=0.0), _tokens),
    "convbert": _classify(tf.ConvBertForSequenceClassification, lambda: tf.ConvBertConfig(
        **TEXT, **NO_DROPOUT, num_labels=CLASSES), _tokens),
    "bloom": _causal_lm(tf.BloomForCausalLM, lambda: tf.BloomConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2, n_head=4, hidden_dropout=0.0,
        attention_dropout=0.0)),
    "falcon": _causal_lm(tf.FalconForCausalLM, lambda: tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
        ffn_hidden_size=64, max_position_embeddings=32, multi_query=True, parallel_attn=True,
        new_decoder_architecture=False, alibi=False, hidden_dropout=0.0, attention_dropout=0.0)),
    "gpt_neox": _causal_lm(tf.GPTNeoXForCausalLM, lambda: tf.GPTNeoXConfig(
        **TEXT, rope_parameters=_rope(0.5), use_parallel_residual=True, hidden_dropout=0.0,
        attention_dropout=0.0)),
    "gptj": _causal_lm(tf.GPTJForCausalLM, lambda: tf.GPTJConfig(
        vocab_size=VOCAB, n_positions=32, n_embd=HIDDEN, n_layer=2, n_head=4, rotary_dim=4,
        n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_bigcode": _causal_lm(tf.GPTBigCodeForCausalLM, lambda: tf.GPTBigCodeConfig(
        vocab_size=VOCAB, n_positions=32, n_embd=HIDDEN, n_layer=2, n_head=4, n_inner=64,
        multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gemma2": _causal_lm(tf.Gemma2ForCausalLM, lambda: tf.Gemma2Config(
        **DECODER, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
        attn_logit_softcapping=1.0, final_logit_softcapping=1.0)),
    "mixtral": _causal_lm(tf.MixtralForCausalLM, lambda: tf.MixtralConfig(
        **DECODER, num_local_experts=4, **MOE)),
    "qwen2_moe": _causal_lm(tf.Qwen2MoeForCausalLM, lambda: tf.Qwen2MoeConfig(
        **DECODER, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        **MOE)),
    "lora": _lora,
    "deberta": _classify(tf.DebertaForSequenceClassification, lambda: tf.DebertaConfig(
        **TEXT, **NO_DROPOUT, relative_attention=True, pos_att_type=["c2p", "p2c"],
        max_relative_positions=16, pooler_dropout=0.0, num_labels=CLASSES, pad_token_id=0),
        lambda rng: _tokens(rng, 0)),
    "electra": _classify(tf.ElectraForSequenceClassification, lambda: tf.ElectraConfig(
        **TEXT, embedding_size=16, **NO_DROPOUT, num_labels=CLASSES, pad_token_id=0),
        lambda rng: _tokens(rng, 0)),
    "swinv2": _classify(tf.Swinv2ForImageClassification, lambda: tf.Swinv2Config(
        **VISION, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0),
        _images),
    "beit": _classify(tf.BeitForImageClassification, lambda: tf.BeitConfig(
        **VIT, use_relative_position_bias=True, layer_scale_init_value=0.1,
        use_mean_pooling=True, drop_path_rate=0.0), _images),
    "dinov2": _without(_classify(tf.Dinov2ForImageClassification, lambda: tf.Dinov2Config(
        **VIT, layerscale_value=0.1, drop_path_rate=0.0), _images),
        "model.dinov2.embeddings.mask_token"),
    "convnextv2": _classify(tf.ConvNextV2ForImageClassification, lambda: tf.ConvNextV2Config(
        num_channels=3, num_stages=1, hidden_sizes=[8], depths=[1], num_labels=CLASSES,
        drop_path_rate=0.0), _images),
    "segformer": _classify(tf.SegformerForImageClassification, lambda: tf.SegformerConfig(
        num_channels=3, num_encoder_blocks=1, depths=[2], sr_ratios=[2], hidden_sizes=[32],
        patch_sizes=[7], strides=[4], num_attention_heads=[2], mlp_ratios=[2],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
        drop_path_rate=0.0, num_labels=CLASSES), _images),
    # one stage (transformers indexes a stage's drop-path rates by the stage's index)
    "cvt": _classify(tf.CvtForImageClassification, lambda: tf.CvtConfig(
        num_channels=3, patch_sizes=[7], patch_stride=[4], patch_padding=[2], embed_dim=[32],
        num_heads=[4], depth=[2], mlp_ratio=[2.0], attention_drop_rate=[0.0], drop_rate=[0.0],
        drop_path_rate=[0.0], qkv_bias=[True], cls_token=[True], qkv_projection_method=["dw_bn"],
        kernel_qkv=[3], padding_kv=[1], stride_kv=[2], padding_q=[1], stride_q=[1],
        num_labels=CLASSES), _images),
    "wav2vec2": _classify(tf.Wav2Vec2ForSequenceClassification, lambda: tf.Wav2Vec2Config(
        **SPEECH, feat_extract_norm="group"), _waveform(400)),
    "whisper": _classify(tf.WhisperForAudioClassification, lambda: tf.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, encoder_attention_heads=4,
        decoder_layers=1, decoder_attention_heads=4, d_model=HIDDEN, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=16, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
        decoder_layerdrop=0.0, classifier_proj_size=16, num_labels=CLASSES), _features(8, 32)),
}


@functools.cache
def imported(name: str):
    """``(module, inputs, target, model)``: :data:`ZOO`'s ``name`` built from seed 0 and its
    ``from_torch`` import, once per process (the zoo's tests and the mixed-precision ones of a
    model share it: one xdist group). Neither is changed by the tests: the Trainers copy the
    weights, and PyTorch's side trains copies of the module."""
    from relaxgrad.training import from_torch

    module, inputs, target = ZOO[name](np.random.default_rng(0))
    return module, inputs, target, from_torch(module, inputs)
