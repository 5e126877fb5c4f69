"""Small configs shared by tests (as `load_config` overrides): fast to capture on a CPU."""

SMALL = {
    "device": "cpu",
    "model.hidden_size": 64,
    "model.num_heads": 4,
    "model.num_kv_heads": 2,
    "model.vocab_size": 512,
    "batching.max_num_seqs": 8,
    "batching.max_num_tokens": 64,
    "kv_cache.num_blocks": 64,
    "kv_cache.max_model_len": 128,
    "capture.max_size": 16,  # sizes 1, 2, 4, 8, 16; uniform keys up to 8 (max_num_seqs)
}
"""A 64-wide model, sizes up to 16."""
