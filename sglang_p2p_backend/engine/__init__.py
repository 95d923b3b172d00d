"""The point-to-point KV transfer engine: planning, staging, transports and the per-pair data path.

Imports nothing from SGLang; `sglang_p2p_backend.adapter.conn` adapts it to SGLang's KV manager interface.
"""
