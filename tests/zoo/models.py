"""Tiny Hugging Face ``transformers`` models for the zoo: random weights, no hub access, every
dropout probability 0 (so gradients are deterministic). Attention is eager except in the
models of :data:`SDPA`, which keep transformers' default (``scaled_dot_product_attention``,
which torch.export decomposes into the same ops; it cannot export GPT-2's).

Each entry of :data:`ZOO` builds ``(module, inputs, target)``: a ``torch.nn.Module`` returning one
logits tensor of shape ``(rows, classes)``, its example inputs (one batch) and class targets.
Language models return their per-token logits flattened to ``(batch * seq, vocab)``.
"""

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


def _images(rng, channels=3, size=IMAGE):
    return torch.from_numpy(rng.standard_normal((BATCH, channels, size, size)).astype("float32"))


def _classify(model_class, config, make_input, attention=_eager):
    def build(rng):
        torch.manual_seed(0)
        module = Logits(model_class(attention(config())))
        return module, (make_input(rng),), rng.integers(0, CLASSES, BATCH)
    return build


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

#: models with transformers' default SDPA attention
SDPA = ("llama", "bert")
#: models whose batch has padding tokens -> (embedding parameter, padding_idx)
PADDED = {
    "bert": ("model.bert.embeddings.word_embeddings.weight", 0),
    "roberta": ("model.roberta.embeddings.word_embeddings.weight", 1),
    "distilbert": ("model.distilbert.embeddings.word_embeddings.weight", 0),
    "albert": ("model.albert.embeddings.word_embeddings.weight", 0),
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
}
