"""The SGLang adapter: the KV manager, sender, receiver and bootstrap server SGLang's registry hands out,
built on the engine (which imports nothing of SGLang)."""
