"""Forward passes for decoding, each a ``protocol.Decoder``: a static-cache decoder for declared
model families (decoder) and transformers' forward over a KV cache, with per-row rollback or plain
(kv); speculative decoding and the speed bench decode through them."""
