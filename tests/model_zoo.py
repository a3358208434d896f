"""Tiny real models built from configs with random weights (nothing is downloaded).

Shared by tests/test_models.py and bench/models_report.py, so the tests and docs/models.md
describe the same models and inputs. Every builder seeds torch, returns the model in eval mode
and its example inputs (a tuple of positional arguments).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

VOCAB = 128
BATCH = 2
SEQ = 8


def token_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def gpt2(attn: str, use_cache: bool = False, positions: int = 32) -> tuple[torch.nn.Module, tuple]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=positions,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=use_cache,
        attn_implementation=attn,
    )
    return GPT2LMHeadModel(config).eval(), (token_ids(),)


def bert(attn: str) -> tuple[torch.nn.Module, tuple]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=32,
        use_cache=False,
        attn_implementation=attn,
    )
    ids = token_ids()
    # the second sequence is padded: its last 3 tokens are masked out
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    return BertModel(config).eval(), (ids, mask)


def llama(attn: str) -> tuple[torch.nn.Module, tuple]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config).eval(), (token_ids(),)


def transformer_encoder_layer() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
    return layer.eval(), (torch.randn(BATCH, SEQ, 64),)


def conv_bn_relu() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    bn = block[1]
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
        bn.bias.normal_()
    return block.eval(), (torch.randn(BATCH, 3, 16, 16),)


def image() -> torch.Tensor:
    return torch.randn(BATCH, 3, 32, 32)


def _hf_tiny(config_name: str, model_name: str, inputs: Callable[[], tuple], **config) -> Callable:
    """A transformers model from a tiny config, random weights, eval mode."""

    def build() -> tuple[torch.nn.Module, tuple]:
        import transformers

        torch.manual_seed(0)
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(**config))
        return model.eval(), inputs()

    return build


_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    use_cache=False,
)
_ENCODER = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
)


# tiny vision configs the zoo shares with bench/arch_sweep.py
_POOLFORMER = dict(hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1])
_SEGFORMER = dict(
    num_encoder_blocks=2,
    depths=[1, 1],
    sr_ratios=[2, 1],
    hidden_sizes=[16, 32],
    num_attention_heads=[1, 2],
    patch_sizes=[7, 3],
    strides=[4, 2],
    mlp_ratios=[2, 2],
)
_SWIN = dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4)


def gpt2_12() -> tuple[torch.nn.Module, tuple]:
    """A model as deep as GPT-2 small, of tiny widths: 12 layers, GPT-2's defaults otherwise (its
    DynamicCache returned). The start-up benches' deep model; not in MODELS."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=12, n_head=4)
    return GPT2LMHeadModel(config).eval(), (token_ids(),)


def _whisper_encoder() -> tuple[torch.nn.Module, tuple]:
    from transformers import WhisperConfig, WhisperModel

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
        max_source_positions=16, use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        decoder_start_token_id=0,
    )  # fmt: skip
    return WhisperModel(config).get_encoder().eval(), (torch.randn(BATCH, 16, 32),)


# More architectures (tests/test_architectures.py): vision (patches, convolutions, channels-last
# LayerNorm, pooling), encoder-decoder with relative position buckets, GQA decoders with rotary
# variants, sliding windows and gated MLPs, and audio (conv front end). Default attention.
MORE_MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {
    "vit": _hf_tiny(
        "ViTConfig",
        "ViTModel",
        lambda: (image(),),
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    ),
    "resnet": _hf_tiny(
        "ResNetConfig",
        "ResNetModel",
        lambda: (image(),),
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="bottleneck",
    ),
    "convnext": _hf_tiny(
        "ConvNextConfig",
        "ConvNextModel",
        lambda: (image(),),
        hidden_sizes=[16, 32],
        depths=[1, 1],
        num_stages=2,
    ),
    "t5": _hf_tiny(
        "T5Config",
        "T5ForConditionalGeneration",
        lambda: (token_ids(), None, token_ids()),
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        use_cache=False,
    ),
    "qwen2": _hf_tiny(
        "Qwen2Config", "Qwen2ForCausalLM", lambda: (token_ids(),), num_key_value_heads=2, **_DECODER
    ),
    "mistral": _hf_tiny(
        "MistralConfig",
        "MistralForCausalLM",
        lambda: (token_ids(),),
        num_key_value_heads=2,
        sliding_window=4,
        **_DECODER,
    ),
    "gemma": _hf_tiny(
        "GemmaConfig",
        "GemmaForCausalLM",
        lambda: (token_ids(),),
        num_key_value_heads=1,
        head_dim=16,
        **_DECODER,
    ),
    "gpt_neox": _hf_tiny("GPTNeoXConfig", "GPTNeoXForCausalLM", lambda: (token_ids(),), **_DECODER),
    "distilbert": _hf_tiny(
        "DistilBertConfig",
        "DistilBertModel",
        lambda: (token_ids(),),
        vocab_size=VOCAB,
        dim=64,
        n_layers=2,
        n_heads=4,
        hidden_dim=128,
        max_position_embeddings=32,
    ),
    "roberta": _hf_tiny(
        "RobertaConfig", "RobertaModel", lambda: (token_ids(),), max_position_embeddings=40, **_ENCODER
    ),
    "whisper_encoder": _whisper_encoder,
    "poolformer": _hf_tiny("PoolFormerConfig", "PoolFormerModel", lambda: (image(),), **_POOLFORMER),
    "segformer": _hf_tiny("SegformerConfig", "SegformerModel", lambda: (image(),), **_SEGFORMER),
    "swin": _hf_tiny("SwinConfig", "SwinModel", lambda: (image(),), **_SWIN),
}


# name -> builder; the names are test ids and the rows of docs/models.md
MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {
    "gpt2-eager": lambda: gpt2("eager"),
    "gpt2-sdpa": lambda: gpt2("sdpa"),
    "bert-eager": lambda: bert("eager"),
    "bert-sdpa": lambda: bert("sdpa"),
    "llama-eager": lambda: llama("eager"),
    "llama-sdpa": lambda: llama("sdpa"),
    "transformer_encoder_layer": transformer_encoder_layer,
    "conv_bn_relu": conv_bn_relu,
}

DESCRIPTIONS = {
    "gpt2-eager": "GPT2LMHeadModel, attn_implementation='eager'",
    "gpt2-sdpa": "GPT2LMHeadModel, attn_implementation='sdpa'",
    "bert-eager": "BertModel (with pooler, padded attention_mask), attn_implementation='eager'",
    "bert-sdpa": "BertModel (with pooler, padded attention_mask), attn_implementation='sdpa'",
    "llama-eager": "LlamaForCausalLM (GQA: 4 heads, 2 KV heads), attn_implementation='eager'",
    "llama-sdpa": "LlamaForCausalLM (GQA: 4 heads, 2 KV heads), attn_implementation='sdpa'",
    "transformer_encoder_layer": "nn.TransformerEncoderLayer(d_model=64, nhead=4, batch_first=True).eval()",
    "conv_bn_relu": "Conv2d(3, 8, 3) + BatchNorm2d(8).eval() + ReLU",
}

DESCRIPTIONS |= {
    "vit": "ViTModel, 32x32 images, 8x8 patches",
    "resnet": "ResNetModel, bottleneck stages [16, 32] (conv + BatchNorm + ReLU, max pool, mean pool)",
    "convnext": "ConvNextModel, stages [16, 32] (depthwise conv, channels-last LayerNorm, GELU, layer scale)",
    "t5": "T5ForConditionalGeneration (relative position buckets, RMS norm), encoder and decoder",
    "qwen2": "Qwen2ForCausalLM (GQA, rotary, q/k/v biases, SiLU-gated MLP)",
    "mistral": "MistralForCausalLM (GQA, sliding window 4)",
    "gemma": "GemmaForCausalLM (one KV head, (1 + w) RMS norm, GELU-tanh gated MLP, scaled embeddings)",
    "gpt_neox": "GPTNeoXForCausalLM (parallel attention and MLP, partial rotary)",
    "distilbert": "DistilBertModel",
    "roberta": "RobertaModel (padding-aware position ids)",
    "whisper_encoder": "WhisperModel's encoder (two Conv1d + GELU front end, sinusoidal positions)",
    "poolformer": "PoolFormerModel (GroupNorm(1, C) over dynamic image sizes, average-pool token mixer)",
    "segformer": "SegformerModel (overlapping patch convolutions, reduced-resolution attention, Mix-FFN)",
    "swin": "SwinModel (shifted windows: padding to the window, window views, roll; export past its "
    "budget with dynamic image sizes, so the batch dim only)",
}


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 when both are all zeros)."""
    scale = expected.abs().max().item()
    err = (actual.double() - expected.double()).abs().max().item()
    return err / scale if scale > 0 else err
