"""Forward passes for decoding: a static-cache decoder for declared model families (decoder) and
transformers' forward over a KV cache with per-row rollback (kv); speculative decoding uses both."""
