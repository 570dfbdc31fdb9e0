"""The released architectures' sizes, for building full-size models without their weights (benchmarks, the
memory plan's measurements, train.make_tiny --full_size_configs)."""

# Qwen-Image(-Edit) transformer, as in the released transformer/config.json.
FULL_ARCH = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))

# Qwen2.5-VL-7B-Instruct's config.json (the text_encoder of Qwen-Image-Edit), vocabulary and token ids aside.
VL_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=1000000.0,
               vocab_size=152064, rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default",
                                                "type": "default"})
VL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                 fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", tokens_per_second=2)
VL_PIXELS = dict(min_pixels=3136, max_pixels=12845056)  # the released processor's image limits
