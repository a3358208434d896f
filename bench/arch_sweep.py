"""gjit on 45 more Hugging Face architectures than the test zoo holds, each from a tiny config with
random weights (nothing downloaded), each in a fresh process with a time limit.

    .venv/bin/python bench/arch_sweep.py                    # every model: a table on stdout
    .venv/bin/python bench/arch_sweep.py swin mixtral       # some of them

A row says whether the compiled call ran (OK: every output within 1e-4 of eager relative to its
largest value; MISMATCH; EAGER: gjit ran it eagerly; CRASH; TIMEOUT), the largest relative error,
the kernels and the ATen externs of the entry, whether the export ran past its budget
(gjit.config.dynamic_export_budget) and the seconds of the first call, compile included. Kernels
run in Triton's CPU interpreter with poisoned buffers (tests/helpers.py run_compiled). It finds
what the zoo's models do not exercise; what it found becomes a test (tests/model_zoo.py).
"""

from __future__ import annotations

import collections
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
# the zoo's sizes and decoder config (tests/model_zoo.py), so the sweep's models are the zoo's kind
from model_zoo import _DECODER as DEC  # noqa: E402
from model_zoo import _POOLFORMER, _SEGFORMER, _SWIN, BATCH, SEQ, VOCAB  # noqa: E402

GQA = dict(DEC, num_key_value_heads=2)
ENC = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=64,
)
SEQ2SEQ = dict(
    vocab_size=VOCAB,
    d_model=64,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_position_embeddings=64,
    use_cache=False,
    pad_token_id=0,
    decoder_start_token_id=0,
)
VIT = dict(
    image_size=32,
    patch_size=8,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
)
AUDIO = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    conv_dim=(16, 16),
    conv_stride=(5, 2),
    conv_kernel=(10, 3),
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4,
)

# name -> (config class, model class, inputs: "ids" | "ids+decoder" | "image" | "image64" | "audio", config)
MODELS: dict[str, tuple[str, str, str, dict]] = {
    "phi": ("PhiConfig", "PhiForCausalLM", "ids", DEC),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "ids", dict(GQA, pad_token_id=0)),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        "ids",
        dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, use_cache=False),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        "ids",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
            use_cache=False,
        ),
    ),
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        "ids",
        dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, use_cache=False),
    ),
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        "ids",
        dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64, use_cache=False),
    ),
    "codegen": (
        "CodeGenConfig",
        "CodeGenForCausalLM",
        "ids",
        dict(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            rotary_dim=8,
            n_positions=64,
            n_ctx=64,
            use_cache=False,
        ),
    ),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", "ids", GQA),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", "ids", GQA),
    "cohere": ("CohereConfig", "CohereForCausalLM", "ids", GQA),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", "ids", GQA),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "ids", dict(GQA, head_dim=16)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", "ids", GQA),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        "ids",
        dict(GQA, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        "ids",
        dict(
            GQA,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "ids",
        dict(DEC, num_key_value_heads=1, head_dim=16, sliding_window=4),
    ),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        "ids",
        dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False),
    ),
    "mpt": (
        "MptConfig",
        "MptForCausalLM",
        "ids",
        dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, use_cache=False),
    ),
    "xglm": (
        "XGLMConfig",
        "XGLMForCausalLM",
        "ids",
        dict(
            vocab_size=VOCAB,
            d_model=64,
            num_layers=2,
            attention_heads=4,
            ffn_dim=128,
            max_position_embeddings=64,
            use_cache=False,
        ),
    ),
    "deberta_v2": ("DebertaV2Config", "DebertaV2Model", "ids", ENC),
    "deberta": ("DebertaConfig", "DebertaModel", "ids", ENC),
    "electra": ("ElectraConfig", "ElectraModel", "ids", dict(ENC, embedding_size=32)),
    "albert": ("AlbertConfig", "AlbertModel", "ids", dict(ENC, embedding_size=32)),
    "xlm_roberta": ("XLMRobertaConfig", "XLMRobertaModel", "ids", ENC),
    "mobilebert": (
        "MobileBertConfig",
        "MobileBertModel",
        "ids",
        dict(
            ENC, embedding_size=32, intra_bottleneck_size=32, true_hidden_size=32, num_feedforward_networks=2
        ),
    ),
    "convbert": ("ConvBertConfig", "ConvBertModel", "ids", dict(ENC, embedding_size=64)),
    "funnel": (
        "FunnelConfig",
        "FunnelModel",
        "ids",
        dict(
            vocab_size=VOCAB,
            d_model=64,
            n_head=4,
            d_head=16,
            d_inner=128,
            block_sizes=[1, 1],
            num_decoder_layers=1,
        ),
    ),
    "clip_text": (
        "CLIPTextConfig",
        "CLIPTextModel",
        "ids",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
    ),
    "bart": ("BartConfig", "BartForConditionalGeneration", "ids+decoder", SEQ2SEQ),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", "ids+decoder", SEQ2SEQ),
    "marian": ("MarianConfig", "MarianMTModel", "ids+decoder", SEQ2SEQ),
    "mt5": (
        "MT5Config",
        "MT5Model",
        "ids+decoder",
        dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4, use_cache=False),
    ),
    "deit": ("DeiTConfig", "DeiTModel", "image", VIT),
    "beit": ("BeitConfig", "BeitModel", "image", dict(VIT, use_relative_position_bias=True)),
    "dinov2": ("Dinov2Config", "Dinov2Model", "image", VIT),
    "clip_vision": ("CLIPVisionConfig", "CLIPVisionModel", "image", VIT),
    "siglip_vision": ("SiglipVisionConfig", "SiglipVisionModel", "image", VIT),
    "swin": ("SwinConfig", "SwinModel", "image", _SWIN),
    "segformer": ("SegformerConfig", "SegformerModel", "image", _SEGFORMER),
    "poolformer": ("PoolFormerConfig", "PoolFormerModel", "image", _POOLFORMER),
    "mobilenet_v2": (
        "MobileNetV2Config",
        "MobileNetV2Model",
        "image",
        dict(image_size=32, depth_multiplier=0.25),
    ),
    "regnet": (
        "RegNetConfig",
        "RegNetModel",
        "image",
        dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8),
    ),
    "mobilevit": (
        "MobileViTConfig",
        "MobileViTModel",
        "image64",
        dict(image_size=64, hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64]),
    ),
    "levit": (
        "LevitConfig",
        "LevitModel",
        "image64",
        dict(
            image_size=64,
            hidden_sizes=[32, 48, 64],
            num_attention_heads=[1, 2, 2],
            depths=[1, 1, 1],
            key_dim=[8, 8, 8],
        ),
    ),
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2Model", "audio", AUDIO),
    "hubert": ("HubertConfig", "HubertModel", "audio", AUDIO),
}


def inputs(kind: str) -> tuple:
    import torch

    ids = lambda: torch.randint(0, VOCAB, (BATCH, SEQ))  # noqa: E731
    return {
        "ids": lambda: (ids(),),
        "ids+decoder": lambda: (ids(), None, ids()),
        "image": lambda: (torch.randn(BATCH, 3, 32, 32),),
        "image64": lambda: (torch.randn(BATCH, 3, 64, 64),),
        "audio": lambda: (torch.randn(BATCH, 800),),
    }[kind]()


def run_one(name: str) -> str:
    """One model in this process: its table row."""
    import torch
    import torch.utils._pytree as pytree
    import transformers

    import gjit
    from helpers import run_compiled
    from model_zoo import max_rel_err

    config_name, model_name, kind, config = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**config)).eval()
    args = inputs(kind)
    start = time.perf_counter()
    with torch.no_grad():
        expected = model(*args)
        try:
            out, cm = run_compiled(model, *args, expect_eager=None)
        except Exception as e:  # noqa: BLE001 - a row says what went wrong
            return f"CRASH {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        seconds = time.perf_counter() - start
        if gjit.stats()["eager_runs"]:
            return f"EAGER {cm.eager_reason}"
        report = gjit.explain(cm, *args)
    got, want = pytree.tree_leaves(out), pytree.tree_leaves(expected)
    pairs = [(a, e) for a, e in zip(got, want) if isinstance(e, torch.Tensor)]
    same = len(got) == len(want) and all(a.shape == e.shape and a.dtype == e.dtype for a, e in pairs)
    error = max((max_rel_err(a, e) for a, e in pairs if same), default=float("nan"))
    status = "OK" if same and error < 1e-4 else "MISMATCH"
    externs = collections.Counter(
        str(e.op).removeprefix("aten.").removesuffix(".default") for e in report.externs
    )
    listed = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in sorted(externs.items())) or "-"
    budget = "yes" if gjit.stats().get("dynamic_exports_abandoned") else "no"
    return f"{status} | {error:.1e} | {len(report.kernels)} | {listed} | {budget} | {seconds:.1f}"


def main(names: list[str]) -> None:
    print("| model | result | max rel err | kernels | externs | past budget | first call s |")
    print("|---|---|---:|---:|---|---|---:|")
    env = {**os.environ, "GJIT_CACHE": "0"}
    for name in names or list(MODELS):
        cmd = [sys.executable, __file__, "--one", name]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
            rows = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
            row = rows[-1][4:] if rows else f"CRASH (exit {done.returncode}): {done.stderr.strip()[-80:]}"
        except subprocess.TimeoutExpired:
            row = "TIMEOUT (600 s)"
        cells = row.split(" | ")
        print(f"| {name} | " + " | ".join(cells + [""] * (6 - len(cells))) + " |", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print("ROW " + run_one(sys.argv[2]), flush=True)
    else:
        main(sys.argv[1:])
