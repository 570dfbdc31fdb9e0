"""Qwen-Image-2.1's released architecture sizes, for building the full-size models without their weights (the
memory plan's measurements, benchmarks, train.make_tiny --full_size_configs).

Sources: the transformer and the VAE are diffusers' defaults for QwenImage21Transformer2DModel and
AutoencoderKLQwenImage21, which agree with the published configs' facts (32 single-stream blocks of width 4096 =
32 heads x 128, SwiGLU 12288, 64 latent channels unpatched, RoPE (16, 56, 56); the VAE base 96 / decoder 144, dim_mult
(1, 2, 4, 8, 8), 16x, RGBA), as a public write-up of the released files lists them
(https://github.com/ling0322/libwaifu/blob/main/docs/qwen_image.md, "The denoiser", "The autoencoder"); the text
encoder is Qwen3-VL-8B-Instruct's config.json (its text and vision parts; vocabulary and token ids are the
tokenizer's), which the same write-up names as the text encoder, and its processor's image limits (assumed to be
the released 2.1 processor's: the pipeline loads it unchanged).
"""

# QwenImage21Transformer2DModel: every value is diffusers' default; written out so that a change there shows.
TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    out_channels=64,
    num_layers=32,
    attention_head_dim=128,
    num_attention_heads=32,
    context_in_dim=4096,
    mlp_ratio=3,
    axes_dims_rope=(16, 56, 56),
    causal_condition=True,
)

# Qwen3-VL-8B-Instruct's config.json (transformers 5 spells rope_scaling rope_parameters).
VL_TEXT = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    vocab_size=151936,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
)
VL_VISION = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    out_hidden_size=4096,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
    hidden_act="gelu_pytorch_tanh",
)
VL_PIXELS = {"shortest_edge": 65536, "longest_edge": 16777216}  # the released processor's image limits
